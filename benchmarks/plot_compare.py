"""Bar charts (PNG) of compare.py results: tokens/s and peak RSS, mindqwen beside the peer.

    python benchmarks/compare.py --peer PY > a.json; python benchmarks/compare.py --peer PY --no-fusion > b.json
    python benchmarks/plot_compare.py a.json b.json --out docs/img/throughput.png

Each input is one compare.py JSON line; a workload run with ``--no-fusion`` is labelled so. Only the
training workloads are drawn (decode tokens/s is two orders of magnitude smaller).
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def bars(results: list) -> list:
    """[(label, mindqwen figures, peer figures)] in input order."""
    rows = []
    for res in results:
        for workload in ("lora", "full"):
            if workload in res:
                label = f"{res.get('shape', 'bench-small')} {workload}" + ("" if res.get("fusion", True) else ", no fusion")
                rows.append((label, res[workload]["mindqwen"], res[workload]["peer"]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", help="compare.py output files")
    ap.add_argument("--out", required=True, help="PNG path")
    args = ap.parse_args()
    results = []
    for path in args.results:
        with open(path, encoding="utf-8") as f:
            results.append(json.loads(f.read().strip().splitlines()[-1]))
    rows = bars(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "tokens_per_s", "tokens/s (higher is better)"),
                           (axes[1], "peak_rss_mb", "peak RSS, MB (lower is better)")):
        xs = range(len(rows))
        mine = [r[1].get(key, 0) for r in rows]
        peer = [r[2].get(key, 0) for r in rows]
        ax.bar([x - 0.2 for x in xs], mine, 0.4, label="mindqwen")
        ax.bar([x + 0.2 for x in xs], peer, 0.4, label="HF + PEFT (torch)")
        for x, a, b in zip(xs, mine, peer):
            if a and b:
                ax.annotate(f"{a / b:.2f}×", (x, max(a, b)), ha="center", va="bottom", fontsize=9)
        ax.set_xticks(list(xs), [r[0] for r in rows], rotation=15)
        ax.set_title(title)
        ax.margins(y=0.12)
        ax.legend(fontsize=8)
    fig.suptitle("bench-small, 2 CPU threads, fp32: medians of alternated runs (benchmarks/compare.py)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(json.dumps({"benchmark": "plot_compare", "out": args.out, "bars": [r[0] for r in rows]}))


if __name__ == "__main__":
    main()
