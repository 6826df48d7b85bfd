"""Peak memory of a bench-small training step against sequence length and micro-batch, with and
without recompute: one JSON line (and ``--plot`` a PNG).

Every point is a fresh process (``benchmarks/train.py`` with few steps), because peak RSS is a
process-lifetime high-water mark.

    python benchmarks/memory.py [--seqs 128,256,512] [--batches 1,4] [--recompute none,full]
                                [--full] [--no-fusion] [--plot docs/img/memory.png]
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def point(seq: int, batch: int, recompute: str, full: bool, fusion: bool, steps: int) -> dict:
    cmd = [sys.executable, os.path.join(HERE, "train.py"), "--seq", str(seq), "--batch", str(batch),
           "--recompute", recompute, "--steps", str(steps), "--warmup", "1", "--threads", "2",
           *(["--full"] if full else []), *([] if fusion else ["--no-fusion"])]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "GLOG_v": "3"})
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"seq {seq} batch {batch} recompute {recompute}: {out['peak_rss_mb']} MB, {out['step_ms']} ms",
          file=sys.stderr, flush=True)
    return {k: out[k] for k in ("seq", "batch", "recompute", "peak_rss_mb", "rss_after_build_mb", "step_ms",
                                "tokens_per_s")}


def plot(points: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for batch in sorted({p["batch"] for p in points}):
        for recompute in sorted({p["recompute"] for p in points}):
            xs = [p for p in points if p["batch"] == batch and p["recompute"] == recompute]
            ax.plot([p["seq"] for p in xs], [p["peak_rss_mb"] for p in xs], marker="o",
                    linestyle="-" if recompute == "none" else "--", label=f"batch {batch}, recompute {recompute}")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("peak RSS (MB)")
    ax.set_title("bench-small training step, peak memory")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="128,256,512")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--recompute", default="none,full")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--no-fusion", dest="fusion", action="store_false")
    ap.add_argument("--plot", help="write a PNG of peak RSS against sequence length (needs matplotlib)")
    args = ap.parse_args()
    points = [point(int(s), int(b), r, args.full, args.fusion, args.steps)
              for b in args.batches.split(",") for r in args.recompute.split(",") for s in args.seqs.split(",")]
    if args.plot:
        plot(points, args.plot)
    print(json.dumps({"benchmark": "memory", "mode": "full" if args.full else "lora", "fusion": args.fusion,
                      "points": points}))


if __name__ == "__main__":
    main()
