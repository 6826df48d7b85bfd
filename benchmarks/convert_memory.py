"""Peak memory of checkpoint conversion against the largest shard it reads.

Writes a ~150M-parameter Qwen2 checkpoint (fp32, sharded at 200 MB; its largest tensor, the
131 MB embedding, sits in a shard) from random tensors, then converts it in fresh processes:
HF → mindformers-mcore safetensors (interleaved q/k/v and gate/up) and HF → HF bf16. Reports each
one's peak RSS growth over a process that only imported the converter, as a multiple of the
largest input shard. Prints one JSON line.

    python benchmarks/convert_memory.py [--workdir DIR]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False,
              max_position_embeddings=2048)


def hwm_mb() -> float:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) / 1024


def child(args) -> None:
    from mindqwen.io.convert import convert
    if args[0] != "none":
        convert(*args)
    print(json.dumps({"peak_rss_mb": hwm_mb()}))


def make_checkpoint(folder: str) -> None:
    from functools import partial
    import numpy as np
    from mindqwen.config import QwenConfig
    from mindqwen.io.hf import no_init_parameters, save_tensors
    from mindqwen.io.safetensors import LazyTensor
    from mindqwen.models.qwen import QwenForCausalLM
    cfg = QwenConfig(**CONFIG)
    with no_init_parameters():
        shapes = {p.name: tuple(p.shape) for p in QwenForCausalLM(cfg).get_parameters()}
    draw = lambda shape, seed: np.random.default_rng(seed).standard_normal(shape, np.float32) * 0.02  # noqa: E731
    tensors = {k: LazyTensor(s, np.dtype(np.float32), partial(draw, s, i)) for i, (k, s) in enumerate(shapes.items())}
    save_tensors(folder, tensors, cfg.to_hf(), None, "200MB")


def run(*args) -> float:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=True,
                         env={**os.environ, "GLOG_v": "3"})
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mb"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child([None if a == "-" else a for a in args.child])
        return
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        src = os.path.join(tmp, "hf")
        make_checkpoint(src)
        shard_mb = max(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src) if f.endswith(".safetensors")) / 2**20
        base = run("none")
        mcore = run(src, os.path.join(tmp, "mcore.safetensors"), "hf", "mindformers-mcore", src, "-", "interleaved",
                    "interleaved")
        bf16 = run(src, os.path.join(tmp, "bf16"), "hf", "hf", src, "bf16")
    print(json.dumps({"benchmark": "convert_memory", "largest_shard_mb": round(shard_mb, 1),
                      "baseline_rss_mb": round(base), "to_mcore_growth_mb": round(mcore - base),
                      "to_mcore_ratio": round((mcore - base) / shard_mb, 2), "to_bf16_growth_mb": round(bf16 - base),
                      "to_bf16_ratio": round((bf16 - base) / shard_mb, 2)}))


if __name__ == "__main__":
    main()
