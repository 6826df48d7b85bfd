"""A line chart (PNG) of first_step.py's JSON lines: whole process to the first LoRA step
against depth, one line per layout and one for the peer.

    python benchmarks/first_step.py --depths 4,8,16,24 --layouts auto,off --peer PY > fs.jsonl
    python benchmarks/plot_first_step.py fs.jsonl --out docs/img/first_step.png
"""
import argparse
import json
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def series(lines: list) -> dict:
    """{label: [(layers, seconds)]} from first_step.py's records."""
    out = defaultdict(list)
    for rec in lines:
        label = f"mindqwen, compile_once {rec['layout']}" if rec["framework"] == "mindqwen" else rec["framework"]
        out[label].append((rec["layers"], rec["wall_to_first_step_s"]))
    return {label: sorted(points) for label, points in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", help="first_step.py output (JSON lines)")
    ap.add_argument("--out", required=True, help="PNG path")
    args = ap.parse_args()
    with open(args.results, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.startswith("{")]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, points in series(lines).items():
        ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xlabel("decoder layers (Qwen2.5-0.5B widths)")
    ax.set_ylabel("seconds from spawn to the first finished step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"{lines[0]['shape']}, LoRA r 8, batch {lines[0]['batch']} x {lines[0]['seq']}, 2 CPU cores")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
