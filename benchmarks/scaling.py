"""Tokens/s and peak RSS against depth and sequence length, mindqwen beside the peer: JSON + PNG.

Each point runs ``train.py`` and ../shared/bench/peer_hf_lora.py once each, in fresh processes, in
alternating order (as compare.py does), on one shape's dimensions with its depth or sequence
length changed. Not part of CI.

    python benchmarks/scaling.py --peer PEER_VENV/bin/python [--shape qwen2.5-0.5b]
        [--depths 4,8,16,24] [--seqs 256,512,1024] [--depth-seq 512] [--steps 6] [--out docs/img/scaling.png]
    python benchmarks/scaling.py --replot RESULT.json --out docs/img/scaling.png
"""
import argparse
import json
import sys

from compare import PEER_SCRIPT, commands, run
from train import SHAPES


def point(args: argparse.Namespace, layers: int, seq: int, flip: bool) -> dict:
    cmds = commands("lora", args.peer, argparse.Namespace(
        shape=args.shape, layers=layers, batch=1, seq=seq, steps=args.steps, fusion=True, peer_script=args.peer_script))
    out = {}
    for who in (("peer", "mindqwen") if flip else ("mindqwen", "peer")):
        res = run(cmds[who])
        out[who] = {k: res.get(k) for k in ("tokens_per_s", "peak_rss_mb", "compile_s")}
        print(f"layers {layers} seq {seq} {who}: {out[who]}", file=sys.stderr, flush=True)
    return {"layers": layers, "seq": seq, **out}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    deepest = max(p["layers"] for p in result["depth"])
    by_seq = {p["seq"]: p for p in result["depth"] if p["layers"] == deepest}  # the depth sweep's deepest
    by_seq.update({p["seq"]: p for p in result["seq"]})  # point is also a sequence point
    sweeps = {"depth": result["depth"], "seq": [by_seq[k] for k in sorted(by_seq)]}
    for row, (sweep, x) in enumerate((("depth", "layers"), ("seq", "seq"))):
        points = sweeps[sweep]
        for col, (key, title) in enumerate((("tokens_per_s", "tokens/s"), ("peak_rss_mb", "peak RSS, MB"))):
            ax = axes[row][col]
            for who, label in (("mindqwen", "mindqwen"), ("peer", "HF + PEFT (torch)")):
                ax.plot([p[x] for p in points], [p[who][key] for p in points], "o-", label=label)
            ax.set_xlabel("decoder layers" if x == "layers" else "sequence length (batch 1)")
            ax.set_title(f"{title} vs {'depth' if x == 'layers' else 'sequence'}")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle(f"{result['shape']} dimensions, LoRA r8 q,v, fp32, 2 CPU threads")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peer")
    ap.add_argument("--replot", help="draw a saved result (this script's JSON line) again")
    ap.add_argument("--peer-script", default=PEER_SCRIPT)
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=SHAPES)
    ap.add_argument("--depths", default="4,8,16,24")
    ap.add_argument("--seqs", default="256,512,1024")
    ap.add_argument("--depth-seq", type=int, default=512, help="sequence length of the depth sweep")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", help="PNG path")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot, encoding="utf-8") as f:
            return plot(json.loads(f.read().strip().splitlines()[-1]), args.out)
    if not args.peer:
        ap.error("--peer is required")
    depths = [int(d) for d in args.depths.split(",")]
    result = {"benchmark": "scaling", "shape": args.shape, "steps": args.steps,
              "depth": [point(args, d, args.depth_seq, i % 2 == 1) for i, d in enumerate(depths)],
              "seq": [point(args, depths[-1], int(s), i % 2 == 1) for i, s in enumerate(args.seqs.split(","))]}
    if args.out:
        plot(result, args.out)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
