"""Forward-time overhead of unmerged LoRA (r=8 on q_proj, v_proj) against the plain model.

bench-small shapes from ../shared/bench/README.md (Qwen2, vocab 16384, hidden 512, 4 layers,
8 heads / 2 KV heads, tied embeddings), batch 4 × 256, fp32, GRAPH_MODE, CPU. The three
variants run interleaved in one process, so machine drift hits them alike. Prints one JSON line.

    python benchmarks/lora_overhead.py [--repeats 10] [--batch 4] [--seq 256]
"""
import argparse
import json
import statistics
import time

import mindspore as ms
import numpy as np

from mindqwen import LoraConfig, QwenConfig, QwenForCausalLM, apply_lora, merge_lora
from mindqwen.lora import lora_layers

BENCH_SMALL = dict(vocab_size=16384, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                   tie_word_embeddings=True, max_position_embeddings=4096)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args()
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)
    config = QwenConfig(**BENCH_SMALL)
    plain = QwenForCausalLM(config)
    lora = apply_lora(QwenForCausalLM(config), LoraConfig(r=8, lora_alpha=32))
    for layer in lora_layers(lora).values():  # a trained adapter: B != 0
        layer.lora_b.set_data(ms.Tensor(np.full(layer.lora_b.shape, 0.01, np.float32)))
    merged = apply_lora(QwenForCausalLM(config), LoraConfig(r=8, lora_alpha=32))
    merge_lora(merged)
    ids = ms.Tensor(np.random.default_rng(1234).integers(0, config.vocab_size, (args.batch, args.seq)), ms.int32)
    models = {"plain": plain, "lora_unmerged": lora, "lora_merged": merged}
    compile_s = {}
    for name, m in models.items():
        t = time.perf_counter()
        m(ids).asnumpy()
        compile_s[name] = round(time.perf_counter() - t, 2)
    times = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, m in models.items():
            t = time.perf_counter()
            m(ids).asnumpy()
            times[name].append(time.perf_counter() - t)
    ms_ = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    print(json.dumps({
        "benchmark": "lora_forward_overhead", "config": "bench-small", "batch": args.batch, "seq": args.seq,
        "repeats": args.repeats, "forward_ms": {k: round(v, 1) for k, v in ms_.items()},
        "unmerged_overhead_pct": round(100 * (ms_["lora_unmerged"] / ms_["plain"] - 1), 1),
        "merged_overhead_pct": round(100 * (ms_["lora_merged"] / ms_["plain"] - 1), 1),
        "first_call_s": compile_s}))


if __name__ == "__main__":
    main()
