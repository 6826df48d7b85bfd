"""Where a bench-small training step spends its time: MindSpore's profiler, one JSON line.

Builds the step exactly as train.py does (same options), runs ``--warmup`` steps, profiles
``--steps`` more, and prints the op types by total time (ms per step and share), and the
single ops that cost the most.

    python benchmarks/profile.py [--full] [--no-fusion] [--steps 3] [--top 12] [--out /tmp/mindqwen_profile]
"""
import csv
import glob
import json
import os
import shutil

from train import build, parser


def read_table(folder: str, name: str) -> list:
    path, = glob.glob(os.path.join(folder, "*", "FRAMEWORK", name))
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", default="/tmp/mindqwen_profile", help="profiler output folder (replaced)")
    ap.set_defaults(steps=3)
    args = ap.parse_args()
    model, config, stepper, data = build(args)
    import mindspore as ms
    from mindspore.profiler import Profiler
    ids = ms.Tensor(data[0])
    for _ in range(args.warmup):
        stepper([(ids, ids)])
    shutil.rmtree(args.out, ignore_errors=True)
    profiler = Profiler(output_path=args.out)
    for _ in range(args.steps):
        stepper([(ids, ids)])
    profiler.stop()
    profiler.analyse()
    types = read_table(args.out, "cpu_op_type_info_0.csv")
    total = sum(float(t["total_compute_time"]) for t in types) / args.steps
    by_type = sorted(types, key=lambda t: -float(t["total_compute_time"]))[:args.top]
    ops = sorted(read_table(args.out, "cpu_op_detail_info_0.csv"), key=lambda o: -float(o["op_total_time(ms)"]))
    print(json.dumps({
        "benchmark": "profile", "mode": "full" if args.full else "lora", "fusion": args.fusion,
        "kernel_ms_per_step": round(total, 1),
        "op_types": [{"type": t["op_type"], "per_step": int(t["execution_frequency(per-step)"]),
                      "ms_per_step": round(float(t["total_compute_time"]) / args.steps, 1),
                      "share": round(float(t["total_compute_time"]) / args.steps / total, 3)} for t in by_type],
        "top_ops": [{"op": o["full_op_name"], "ms_per_step": round(float(o["op_total_time(ms)"]) / args.steps, 1)}
                    for o in ops[:args.top]]}))


if __name__ == "__main__":
    main()
