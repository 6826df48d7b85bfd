#!/usr/bin/env python3
"""PEER: lm-evaluation-harness's ``hf`` backend (HFLM over transformers' Qwen2ForCausalLM, fp32, CPU)
scoring the same token requests as ``benchmarks/harness.py``'s mindqwen child, one JSON line.
Run with a Python that has ``torch==2.13.0`` and ``lm-eval[hf]==0.4.13``; the driver passes the
model config. Random init: ``torch.manual_seed(0)``."""
import argparse
import json
import os
import resource
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.dirname(HERE))  # after the standard library: benchmarks/profile.py is no stdlib profile


def main() -> None:
    t0 = time.perf_counter()
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="uniform")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    from harness import TOKENIZER, measure
    from harness_requests import requests
    torch.manual_seed(0)
    config = json.loads(args.config)
    model = Qwen2ForCausalLM(Qwen2Config(**config)).eval()
    lm = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(TOKENIZER), batch_size=args.batch_size,
              dtype="float32", device="cpu")
    build_s = time.perf_counter() - t0
    reqs = requests(args.workload, config["vocab_size"], args.requests)
    with torch.no_grad():
        out = measure(lm, reqs, args, build_s, lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
