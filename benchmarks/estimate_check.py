"""`mindqwen estimate` against measured peak memory on CPU: one JSON line per configuration.

Each configuration trains a few steps of bench-small (benchmarks/train.py) in a fresh process and
reads its peak resident memory (VmHWM); the estimate is computed for the same shapes with
``device=CPU``. ``ratio`` = estimate / measured; the acceptance band is 0.75–1.25.

    python benchmarks/estimate_check.py [--quick] [--moe]

``--moe``: bench-small-moe (8 experts top-2), exact and ``moe_capacity_factor`` 1.25, instead.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from train import BENCH_SMALL, BENCH_SMALL_MOE  # noqa: E402

# (mode, layers, batch, seq, recompute). The CPU constants in mindqwen/estimate.py were fitted
# to CALIBRATION; HELD_OUT checks them on shapes outside the fit.
CALIBRATION = [("lora", 4, 4, 256, "none"), ("full", 4, 4, 256, "none"), ("lora", 2, 2, 128, "none"),
               ("full", 8, 2, 256, "none"), ("lora", 4, 8, 256, "none"), ("full", 4, 4, 512, "none")]
HELD_OUT = [("lora", 6, 2, 384, "none"), ("full", 3, 6, 192, "none"), ("lora", 4, 4, 256, "full")]
# bench-small-moe: (mode, layers, batch, seq, recompute, moe_capacity_factor)
MOE = [("lora", 4, 4, 256, "none", None), ("lora", 4, 4, 256, "none", 1.25), ("full", 4, 4, 256, "none", 1.25)]


def measure(mode: str, layers: int, batch: int, seq: int, recompute: str, factor=False) -> dict:
    cmd = [sys.executable, os.path.join(HERE, "train.py"), "--steps", "4", "--warmup", "1", "--layers", str(layers),
           "--batch", str(batch), "--seq", str(seq), "--recompute", recompute] + (["--full"] if mode == "full" else [])
    if factor is not False:  # bench-small-moe
        cmd += ["--shape", "bench-small-moe"] + ([] if factor is None else ["--moe-capacity-factor", str(factor)])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "GLOG_v": "3"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def estimated_bytes(mode: str, layers: int, batch: int, seq: int, recompute: str, factor=False) -> float:
    from mindqwen import LoraConfig, QwenConfig
    from mindqwen.estimate import estimate
    from mindqwen.train.config import TrainerConfig
    from mindqwen.train.distributed import ParallelConfig
    shape = BENCH_SMALL if factor is False else dict(BENCH_SMALL_MOE, moe_capacity_factor=factor)
    config = QwenConfig(**{**shape, "num_hidden_layers": layers})
    lora = LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"]) if mode == "lora" else None
    trainer = TrainerConfig(micro_batch_size=batch, recompute=recompute)
    return estimate(config, lora, trainer, ParallelConfig(), "float32", seq, "CPU").total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the first held-out configuration")
    ap.add_argument("--moe", action="store_true", help="the bench-small-moe configurations instead")
    args = ap.parse_args()
    for cfg in MOE if args.moe else HELD_OUT[:1] if args.quick else CALIBRATION + HELD_OUT:
        measured = measure(*cfg)["peak_rss_mb"]
        est = estimated_bytes(*cfg) / 2 ** 20
        print(json.dumps({"benchmark": "estimate_check", "held_out": cfg in HELD_OUT, "mode": cfg[0], "layers": cfg[1], "batch": cfg[2],
                          "seq": cfg[3], "recompute": cfg[4], **({"moe_capacity_factor": cfg[5]} if args.moe else {}),
                          "measured_peak_mb": measured,
                          "estimate_mb": round(est), "ratio": round(est / measured, 3)}), flush=True)


if __name__ == "__main__":
    main()
