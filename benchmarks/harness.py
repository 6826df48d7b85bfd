"""lm-evaluation-harness log-likelihood requests: mindqwen's backend (``MindQwenLM``) against the
harness's own ``hf`` backend (transformers on torch, ``benchmarks/peers/lm_eval_hf.py``) on the
same random model and the same token requests: one JSON line.

Two workloads (``benchmarks/harness_requests.py``): ``uniform``, ``--requests`` rows of 256 tokens
at batch 8 (each its own context), timed after one warm-up batch (compilation on mindqwen's side;
``first_batch_s`` and ``build_s`` report what a user waits for first); ``choice``, 1,000
multiple-choice requests (250 questions × 4 answers) timed whole, compilation included. Each run
is its own process; the backends alternate for ``--rounds`` rounds and the best of each is kept.

    python benchmarks/harness.py --shape qwen2.5-0.5b --workload uniform --requests 32 --peer /work/peer/bin/python
    python benchmarks/harness.py --shape bench-small --workload choice --peer /work/peer/bin/python
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER = os.path.join(HERE, "..", "tests", "fixtures", "harness", "tokenizer")  # pads and decodes only


def child(args: argparse.Namespace) -> dict:
    """One process: build the model, score the requests (batch ``--batch-size``), time it."""
    t0 = time.perf_counter()
    import mindqwen  # noqa: F401  before MindSpore
    import mindspore as ms
    from mindqwen import QwenConfig, QwenForCausalLM
    from mindqwen.harness import MindQwenLM
    from mindqwen.train.metrics import peak_memory_mb
    from harness_requests import requests
    ms.set_seed(0)
    config = json.loads(args.config)
    model = QwenForCausalLM(QwenConfig(**config))
    lm = MindQwenLM(model, tokenizer=TOKENIZER, batch_size=args.batch_size)
    build_s = time.perf_counter() - t0
    reqs = requests(args.workload, config["vocab_size"], args.requests)
    return measure(lm, reqs, args, build_s, peak_memory_mb)


def measure(lm, reqs, args, build_s, peak_memory_mb) -> dict:
    """Shared by both backends: the warm-up batch, then the rest (uniform), or all at once (choice)."""
    first = args.batch_size if args.workload == "uniform" else 0
    t = time.perf_counter()
    warm = lm._loglikelihood_tokens(reqs[:first], disable_tqdm=True) if first else []
    first_s = time.perf_counter() - t
    t = time.perf_counter()
    scored = warm + lm._loglikelihood_tokens(reqs[first:], disable_tqdm=True)
    timed_s = time.perf_counter() - t
    return {"build_s": round(build_s, 1), "first_batch_s": round(first_s, 2), "timed_requests": len(reqs) - first,
            "timed_s": round(timed_s, 2), "requests_per_s": round((len(reqs) - first) / timed_s, 3),
            "peak_rss_mb": round(peak_memory_mb()), "logprob_sum": round(sum(ll for ll, _ in scored), 3)}



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--workload", choices=["uniform", "choice"], default="uniform")
    ap.add_argument("--requests", type=int, default=0, help="default: 32 (uniform), 1000 (choice)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--peer", help="a Python with lm-eval[hf] (benchmarks/peers/lm_eval_hf.py runs in it)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.requests = args.requests or (32 if args.workload == "uniform" else 1000)
    if args.child:
        print(json.dumps(child(args)))
        return
    sys.path.insert(0, HERE)
    from train import child_json, shape_config
    config = shape_config(args.shape)
    common = ["--workload", args.workload, "--requests", str(args.requests), "--batch-size", str(args.batch_size),
              "--config", json.dumps(config)]
    runs = {"mindqwen": [], "hf": []}
    for _ in range(args.rounds):  # alternated, so that a slow stretch of the machine hits both
        runs["mindqwen"].append(child_json([sys.executable, __file__, "--child", *common]))
        if args.peer:
            runs["hf"].append(child_json([args.peer, os.path.join(HERE, "peers", "lm_eval_hf.py"), *common]))
    best = {k: max(r, key=lambda x: x["requests_per_s"]) for k, r in runs.items() if r}
    out = {"benchmark": "harness", "shape": args.shape, "workload": args.workload, "requests": args.requests,
           "batch_size": args.batch_size, "rounds": args.rounds, "runs": runs}
    if args.peer:
        out["requests_per_s_vs_hf"] = round(best["mindqwen"]["requests_per_s"] / best["hf"]["requests_per_s"], 3)
        out["peak_rss_vs_hf"] = round(best["mindqwen"]["peak_rss_mb"] / best["hf"]["peak_rss_mb"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
