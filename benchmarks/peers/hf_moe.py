#!/usr/bin/env python3
"""PEER: HF transformers + PEFT Qwen3-MoE LoRA / full fine-tune on CPU, one JSON line.

The mixture-of-experts counterpart of ../shared/bench/peer_hf_lora.py (which builds Qwen2 only),
with its conventions: random init (torch seed 0), fp32, AdamW lr 1e-4 (torch defaults otherwise),
LoRA r 8 / alpha 32 on q_proj, v_proj; data ``default_rng(1234).integers(0, vocab, (steps,
batch, seq))``, labels = input_ids; timed region forward + backward + AdamW step + zero_grad;
tokens_per_s = batch·seq / median step time after ``--warmup`` steps. The loss is HF's default
(cross-entropy; ``--aux`` adds the load-balancing loss as mindqwen trains).

    PEER_VENV/bin/python benchmarks/peers/hf_moe.py --hidden-size 512 ... [--full] [--aux]
"""
import argparse
import json
import os
import platform
import resource
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    for name, default in (("vocab-size", 16384), ("hidden-size", 512), ("intermediate-size", 1408),
                          ("num-hidden-layers", 4), ("num-attention-heads", 8), ("num-key-value-heads", 2),
                          ("head-dim", 64), ("num-experts", 8), ("num-experts-per-tok", 2),
                          ("moe-intermediate-size", 352), ("max-position-embeddings", 2048)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--rope-theta", type=float, default=1e6)
    ap.add_argument("--rms-norm-eps", type=float, default=1e-6)
    ap.add_argument("--no-tie-word-embeddings", action="store_true")
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--aux", action="store_true", help="add the load-balancing loss (output_router_logits)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    import numpy as np
    import torch
    import transformers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.set_num_threads(a.threads)
    config = Qwen3MoeConfig(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_hidden_layers, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads, head_dim=a.head_dim, num_experts=a.num_experts,
        num_experts_per_tok=a.num_experts_per_tok, moe_intermediate_size=a.moe_intermediate_size,
        norm_topk_prob=True, max_position_embeddings=a.max_position_embeddings, rms_norm_eps=a.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta}, output_router_logits=a.aux,
        tie_word_embeddings=not a.no_tie_word_embeddings, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).float()
    out = dict(harness="peer_hf_moe", mode="full" if a.full else "lora", threads=a.threads, aux=a.aux,
               versions=dict(python=platform.python_version(), torch=torch.__version__,
                             transformers=transformers.__version__))
    if not a.full:
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0, bias="none",
                                                           target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        out["versions"]["peft"] = peft.__version__
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    data = torch.from_numpy(np.random.default_rng(1234).integers(0, a.vocab_size, (a.steps, a.batch, a.seq)))
    times, losses = [], []
    for i in range(a.steps):
        t0 = time.perf_counter()
        loss = model(input_ids=data[i], labels=data[i]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    med = statistics.median(times[a.warmup:])
    out.update(batch=a.batch, seq=a.seq, steps=a.steps, tokens_per_s=round(a.batch * a.seq / med, 2),
               step_ms=round(med * 1e3, 2), first_loss=losses[0], last_loss=losses[-1],
               trainable_params=sum(p.numel() for p in params),
               total_params=sum(p.numel() for p in model.parameters()),
               peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
