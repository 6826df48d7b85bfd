"""``from_pretrained`` time against reading the same files: one JSON line.

Writes a random fp32 HF folder of a real shape (config.json + safetensors shards, numpy only),
then, in fresh processes and alternating order, times (a) reading every tensor with
``safetensors.safe_open`` into numpy (the floor: the file's bytes), and (b)
``mindqwen.from_pretrained`` (config, model built without a random init, every tensor read and
set). The files are in the page cache for both.

    python benchmarks/load_time.py [--shape qwen2.5-1.5b] [--rounds 2] [--workdir DIR]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from train import SHAPES, shape_config


def write_folder(shape: str, folder: str) -> int:
    """A random HF folder of ``shape``; returns its tensor bytes."""
    import numpy as np
    from mindqwen import QwenConfig
    from mindqwen.io.safetensors import LazyTensor
    from mindqwen.io.hf import save_tensors
    config = QwenConfig(**shape_config(shape))
    names = config.tensor_shapes()  # HF's names (a mixture of experts' experts one by one)
    rng = np.random.default_rng(0)

    def draw(shape):
        return lambda: rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)

    save_tensors(folder, {n: LazyTensor(s, np.dtype(np.float32), draw(s)) for n, s in names.items()},
                 config.to_hf(), max_shard_size="2GB")
    return sum(int(np.prod(s)) * 4 for s in names.values())


def child(kind: str, folder: str) -> None:
    t = time.perf_counter()
    if kind == "read":
        import glob

        from safetensors import safe_open
        total = 0
        for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
            with safe_open(path, "np") as f:
                for key in f.keys():
                    total += f.get_tensor(key).nbytes
    else:
        import mindqwen
        import mindspore as ms
        ms.set_device("CPU")
        model = mindqwen.from_pretrained(folder)
        total = sum(p.nbytes for p in model.get_parameters())
    print(json.dumps({"kind": kind, "seconds": time.perf_counter() - t, "bytes": total}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=SHAPES)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", help="where the checkpoint is written (default: a temporary folder)")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "FOLDER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child)
    folder = os.path.join(args.workdir or tempfile.mkdtemp(), args.shape)
    if not os.path.exists(os.path.join(folder, "config.json")):
        write_folder(args.shape, folder)
    seen = {"read": [], "from_pretrained": []}
    for i in range(args.rounds):
        for kind in (("read", "from_pretrained") if i % 2 == 0 else ("from_pretrained", "read")):
            r = subprocess.run([sys.executable, __file__, "--child", kind, folder], capture_output=True, text=True,
                               env={**os.environ, "GLOG_v": "3"})
            if r.returncode != 0:
                sys.exit(r.stderr[-3000:])
            seen[kind].append(json.loads(r.stdout.strip().splitlines()[-1])["seconds"])
    read, load = statistics.median(seen["read"]), statistics.median(seen["from_pretrained"])
    print(json.dumps({"benchmark": "load_time", "shape": args.shape, "rounds": args.rounds,
                      "read_s": round(read, 2), "from_pretrained_s": round(load, 2),
                      "ratio": round(load / read, 2), "runs": seen}))


if __name__ == "__main__":
    main()
