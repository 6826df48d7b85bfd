"""Export time and the exported graphs' decode speed on bench-small: one JSON line.

Exports bench-small (fp32, batch 1, a 32-token prompt bucket, ``--max-seq-len`` cache slots) with
``mindqwen.export.export_model``, timing the graph export alone (``parity=False``) and the full
export with its parity report. Then runs greedy generation through the exported MindIR with the
folder's own ``run_exported.py`` (MindSpore GraphCell backend, the KV cache copied in and out of
every call, as on Lite): ``decode_tokens_per_s`` = 127 / (time for 128 tokens − time for 1).

    python benchmarks/export.py [--max-seq-len 192] [--repeats 3]
"""
import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

from train import BENCH_SMALL


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-seq-len", type=int, default=192)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import mindspore as ms
    import numpy as np
    from mindqwen import QwenConfig, QwenForCausalLM
    from mindqwen.export import export_model
    ms.set_device("CPU")
    ms.set_seed(0)
    model = QwenForCausalLM(QwenConfig(**BENCH_SMALL))
    model.set_train(False)
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "export")
        t = time.perf_counter()
        export_model(model, folder, [1], args.max_seq_len, [32], "float32", parity=False)
        export_s = time.perf_counter() - t
        t = time.perf_counter()
        export_model(model, folder, [1], args.max_seq_len, [32], "float32")
        export_parity_s = time.perf_counter() - t
        spec = importlib.util.spec_from_file_location("run_exported", os.path.join(folder, "run_exported.py"))
        runner = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(runner)
        with open(os.path.join(folder, "manifest.json"), encoding="utf-8") as f:
            manifest = json.load(f)
        manifest["generation"]["eos_token_id"] = None  # always the full number of tokens
        graphs = runner.MindSporeGraphs(folder, manifest, 0)
        prompt = np.random.default_rng(1234).integers(0, BENCH_SMALL["vocab_size"], (1, 32)).tolist()

        def timed(n):
            t0 = time.perf_counter()
            runner.generate(graphs, manifest, prompt, n)
            return time.perf_counter() - t0

        timed(args.new_tokens)  # first calls load and compile both graphs
        full = statistics.median(timed(args.new_tokens) for _ in range(args.repeats))
        first = statistics.median(timed(1) for _ in range(args.repeats))
    print(json.dumps({"benchmark": "export", "config": "bench-small", "dtype": "float32",
                      "max_seq_len": args.max_seq_len, "export_s": round(export_s, 1),
                      "export_with_parity_s": round(export_parity_s, 1),
                      "tokens_per_s": round(args.new_tokens / full, 1),
                      "decode_tokens_per_s": round((args.new_tokens - 1) / (full - first), 1),
                      "ms_per_decode_step": round((full - first) / (args.new_tokens - 1) * 1e3, 2),
                      "python": sys.version.split()[0]}))


if __name__ == "__main__":
    main()
