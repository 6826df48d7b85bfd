"""Generation speed on bench-small (../shared/bench/README.md) or a real shape: one JSON line.

Greedy, KV cache, fp32, a 32-token prompt drawn as the peer draws it
(``default_rng(1234).integers(0, vocab, (batch, 32))``), 128 new tokens, batch 1 and batch 8.
Method as the peer's ``--gen``: ``tokens_per_s`` = batch·128 / median(generate time);
``decode_tokens_per_s`` = batch·127 / (median(generate 128) − median(generate 1)), which takes the
prefill out. Graph compilation happens in the warm-up and is reported as ``compile_s``; the first
call, one new token from a fresh model, as ``first_token_s``.

Next to the achieved rate it prints the weight-streaming floor measured in the same process: a
batch-1 decode step reads every weight once (the tied embedding once, as the LM head), so it
cannot beat ``weight bytes ÷ memory bandwidth``; the bandwidth is that of a (1, 4096) ×
(16384, 4096)ᵀ fp32 matmul, the decode step's access pattern, best of 10.

    python benchmarks/generate.py [--shape qwen2.5-0.5b] [--repeats 5] [--peer /path/to/peer/python]

``--peer`` runs ../shared/bench/peer_hf_lora.py --gen (HF transformers ``generate``) with that
interpreter, alternating with mindqwen's rounds, and adds the peer's figures and the ratios.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from train import SHAPES, shape_config

PEER_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "bench", "peer_hf_lora.py")


def measure(generate, model, prompt, new_tokens: int, repeats: int) -> dict:
    def timed(n):
        t0 = time.perf_counter()
        out = generate(model, prompt, max_new_tokens=n)
        return time.perf_counter() - t0, out

    first_token_s = timed(1)[0]  # cold: compiles the prefill graph
    compile_s = first_token_s + timed(new_tokens)[0]  # and the decode graph
    full = [timed(new_tokens)[0] for _ in range(repeats)]
    first = [timed(1)[0] for _ in range(repeats)]
    _, out = timed(new_tokens)
    b = prompt.shape[0]
    med, med1 = statistics.median(full), statistics.median(first)
    return {"tokens_per_s": round(b * new_tokens / med, 1),
            "decode_tokens_per_s": round(b * (new_tokens - 1) / (med - med1), 1),
            "gen_ms": round(med * 1e3, 1), "prefill_plus_1_ms": round(med1 * 1e3, 1),
            "ms_per_decode_step": round((med - med1) / (new_tokens - 1) * 1e3, 2),
            "first_token_s": round(first_token_s, 1), "compile_s": round(compile_s, 1), "first_new_ids": out[0, prompt.shape[1]:][:8].tolist()}


def measure_stream_gbs(repeats: int = 10) -> float:
    """Weight-streaming bandwidth (GB/s): a compiled matrix-vector product over 256 MB of fp32."""
    import mindspore as ms
    import numpy as np
    from mindspore import ops
    w = ms.Tensor(np.random.default_rng(0).standard_normal((16384, 4096), dtype=np.float32))
    x = ms.Tensor(np.ones((1, 4096), np.float32))
    matmul = ops.MatMul(transpose_b=True)  # as the model's Linear: no transposed copy of W

    @ms.jit
    def matvec(a, b):
        return matmul(a, b)

    matvec(x, w).asnumpy()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        matvec(x, w).asnumpy()
        best = min(best, time.perf_counter() - t)
    return w.nbytes / best / 1e9


def decode_weight_bytes(model) -> int:
    """Bytes a batch-1 decode step reads: every parameter but an untied input embedding, whose
    step reads one row."""
    tied = model.config.tie_word_embeddings
    return sum(p.nbytes for p in model.get_parameters() if tied or "embed_tokens" not in p.name)


def peer(python: str, batch: int, script: str) -> dict:
    r = subprocess.run([python, script, "--gen", "--batch", str(batch), "--threads", "2", "--clean-steps", "3"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"peer failed:\n{r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {k: out[k] for k in ("tokens_per_s", "decode_tokens_per_s", "gen_ms", "prefill_plus_1_ms", "first_new_ids")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--shape", default="bench-small", choices=SHAPES)
    ap.add_argument("--layers", type=int, default=0, help="override the shape's depth")
    ap.add_argument("--peer", help="python of a venv with torch + transformers (runs the peer alternately)")
    ap.add_argument("--peer-script", default=PEER_SCRIPT)
    args = ap.parse_args()
    from mindqwen import QwenConfig, QwenForCausalLM
    from mindqwen.generation import generate
    from mindqwen.train.metrics import peak_memory_mb
    import mindspore as ms
    import numpy as np
    ms.set_device("CPU")
    ms.set_seed(0)
    config = QwenConfig(**shape_config(args.shape, args.layers))
    t = time.perf_counter()
    model = QwenForCausalLM(config)
    model.set_train(False)
    build_s = time.perf_counter() - t
    gbs, weight_bytes = measure_stream_gbs(), decode_weight_bytes(model)
    result = {"harness": "mindqwen", "mode": "gen", "dtype": "float32", "shape": args.shape,
              "layers": config.num_hidden_layers, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "build_s": round(build_s, 1), "stream_gb_per_s": round(gbs, 2),
              "decode_weight_mb": round(weight_bytes / 1e6, 1),
              "floor_tokens_per_s": round(gbs * 1e9 / weight_bytes, 1), "versions": {"mindspore": ms.__version__}}
    for b in (int(x) for x in args.batches.split(",")):
        prompt = np.random.default_rng(1234).integers(0, config.vocab_size, (b, args.prompt_len)).astype(np.int32)
        mine = measure(generate, model, prompt, args.new_tokens, args.repeats)
        if args.peer:  # alternate: peer, then mindqwen again; keep mindqwen's median of the two rounds
            theirs = peer(args.peer, b, args.peer_script)
            again = measure(generate, model, prompt, args.new_tokens, args.repeats)
            mine = {**mine, "decode_tokens_per_s": round((mine["decode_tokens_per_s"] + again["decode_tokens_per_s"]) / 2, 1),
                    "tokens_per_s": round((mine["tokens_per_s"] + again["tokens_per_s"]) / 2, 1)}
            mine["peer"] = theirs
            mine["decode_ratio_vs_peer"] = round(mine["decode_tokens_per_s"] / theirs["decode_tokens_per_s"], 2)
            mine["tokens_ratio_vs_peer"] = round(mine["tokens_per_s"] / theirs["tokens_per_s"], 2)
        result[f"batch_{b}"] = mine
    result["decode_tokens_per_s"] = result.get("batch_1", {}).get("decode_tokens_per_s")
    if result["decode_tokens_per_s"]:
        result["decode_of_floor"] = round(result["decode_tokens_per_s"] / result["floor_tokens_per_s"], 3)
    result["peak_rss_mb"] = round(peak_memory_mb())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
