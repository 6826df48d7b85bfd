"""The peer of benchmarks/optimizer.py: torch.optim.AdamW (its CPU default, and fused) on the same
parameter set; one JSON line each. Needs torch (a virtualenv apart from the project's) and reads
the shapes through mindqwen's config module (plain Python, no MindSpore needed for it)."""
import argparse
import importlib.util
import json
import os
import statistics
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH_SMALL = dict(vocab_size=16384, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)


def shapes(name: str) -> dict:
    """The same shapes as benchmarks/optimizer.py, computed here without mindqwen's package imports."""
    h, i, layers, heads, kv = 512, 1408, 4, 8, 2
    vocab = 16384
    if name != "bench-small":
        raise SystemExit("the peer knows bench-small; pass --shapes-json from benchmarks/optimizer.py for others")
    d = h // heads
    out = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for n in range(layers):
        p = f"model.layers.{n}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
                    p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
                    p + "self_attn.q_proj.bias": (heads * d,), p + "self_attn.k_proj.bias": (kv * d,),
                    p + "self_attn.v_proj.bias": (kv * d,), p + "mlp.gate_proj.weight": (i, h),
                    p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="bench-small")
    parser.add_argument("--shapes-json", help="a JSON file {name: shape} (for shapes other than bench-small)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    named = json.load(open(args.shapes_json)) if args.shapes_json else shapes(args.shape)
    rng = np.random.default_rng(0)
    grads = [torch.tensor(rng.standard_normal(s, dtype=np.float32)) for s in named.values()]
    for fused in (False, True):
        params = [torch.nn.Parameter(torch.tensor(rng.standard_normal(s, dtype=np.float32))) for s in named.values()]
        decay = [p for n, p in zip(named, params) if "norm" not in n and "bias" not in n]
        rest = [p for n, p in zip(named, params) if "norm" in n or "bias" in n]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                                lr=1e-4, fused=fused or None)
        for p, g in zip(params, grads):
            p.grad = g
        times = []
        for _ in range(args.warmup + args.steps):
            t = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t)
        print(json.dumps({"stack": "torch", "optimizer": "AdamW" + (" fused" if fused else ""), "shape": args.shape,
                          "parameters": int(sum(np.prod(s) for s in named.values())),
                          "ms_per_step": round(1e3 * statistics.median(times[args.warmup:]), 2)}))


if __name__ == "__main__":
    main()
