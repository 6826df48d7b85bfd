"""Inspect a checkpoint: keys, shapes, dtypes, and parameter counts by group.

    python ckpt_tools/inspect_ckpt.py PATH  (not inspect.py: that would shadow the stdlib module) [--keys]
    python ckpt_tools/inspect_ckpt.py A --diff B      per-tensor max |Δ|, missing and extra keys

PATH is an HF folder (single file or sharded), a ``.safetensors`` file (model, adapter or
mindqwen training checkpoint), or a folder holding ``adapter_model.safetensors``.
"""
import argparse
import os
import re
import sys
from collections import defaultdict

import numpy as np

from mindqwen.io.hf import open_checkpoint
from mindqwen.io.safetensors import CheckpointError, SafetensorsFile


def tensors(path: str) -> dict:
    """key → opened file, for any of the layouts above."""
    if os.path.isfile(path):
        f = SafetensorsFile(path)
        return {k: f for k in f.keys()}
    adapter = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(adapter):
        return tensors(adapter)
    return open_checkpoint(path)


def group_of(key: str) -> str:
    """Layer indices collapsed: ``model.layers.3.mlp.up_proj.weight`` → ``model.layers.*.mlp``."""
    key = re.sub(r"\.\d+\.", ".*.", key)
    return key.rsplit(".", 2)[0] if ".*." in key else key.rsplit(".", 1)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path")
    ap.add_argument("--keys", action="store_true", help="list every tensor")
    ap.add_argument("--diff", metavar="OTHER", help="compare with another checkpoint, tensor by tensor")
    args = ap.parse_args(argv)
    try:
        found = tensors(args.path)
        if args.diff:
            return diff(found, tensors(args.diff), args.path, args.diff)
    except CheckpointError as e:
        print(f"inspect: error: {e}", file=sys.stderr)
        return 1
    groups, dtypes, total = defaultdict(int), defaultdict(int), 0
    for key in sorted(found):
        f = found[key]
        n = 1
        for d in f.shape(key):
            n *= d
        groups[group_of(key)] += n
        dtypes[f.dtype(key)] += n
        total += n
        if args.keys:
            print(f"{key:70s} {f.dtype(key):5s} {list(f.shape(key))}")
    for g, n in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"{g:60s} {n:>15,d}  {100 * n / total:5.1f}%")
    print(f"{len(found)} tensors, {total:,d} parameters; dtypes: "
          + ", ".join(f"{d} {n:,d}" for d, n in sorted(dtypes.items())))
    return 0


def diff(a: dict, b: dict, name_a: str, name_b: str) -> int:
    """Per-tensor max |Δ| (in fp32) of shared keys; missing / extra keys. Exit 0 only if identical."""
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    worst, differing = 0.0, 0
    for key in sorted(set(a) & set(b)):
        if tuple(a[key].shape(key)) != tuple(b[key].shape(key)):
            print(f"{key:70s} shape {list(a[key].shape(key))} vs {list(b[key].shape(key))}")
            differing += 1
            continue
        d = float(np.abs(a[key].get(key) - b[key].get(key)).max()) if a[key].shape(key) else 0.0
        if d > 0:
            print(f"{key:70s} max |Δ| {d:.3e}")
            differing += 1
        worst = max(worst, d)
    for key in only_a:
        print(f"{key:70s} only in {name_a}")
    for key in only_b:
        print(f"{key:70s} only in {name_b}")
    print(f"{len(set(a) & set(b))} shared tensors, {differing} differ (max |Δ| {worst:.3e}); "
          f"{len(only_a)} only in {name_a}, {len(only_b)} only in {name_b}")
    return 0 if not (differing or only_a or only_b) else 2


if __name__ == "__main__":
    sys.exit(main())
