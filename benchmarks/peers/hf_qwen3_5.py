#!/usr/bin/env python3
"""PEER: HF transformers + PEFT Qwen3.5 (hybrid Gated DeltaNet) LoRA step, prefill or decode on CPU, one JSON line.

The Qwen3.5 counterpart of ``hf_moe.py``: ``Qwen3_5ForCausalLM`` built from a ``Qwen3_5TextConfig`` of
the given dimensions (defaults: qwen3.5-0.8b's, ``mindqwen.presets``), random init (torch seed 0),
fp32, eager attention, ``--threads`` torch threads. Without the flash-linear-attention and causal-conv1d
packages (the CPU case) HF runs its torch fallbacks, ``torch_chunk_gated_delta_rule`` and
``F.conv1d``; ``kernels`` in the output says which ran.

``--train`` (default): PEFT LoRA r 8 / alpha 32 on ``--targets``; AdamW lr 1e-4 (torch defaults
otherwise); data ``default_rng(1234).integers(0, vocab, (steps, batch, seq))``, labels = input_ids;
timed region forward + backward + AdamW step + zero_grad; tokens_per_s = batch·seq / median step
time after ``--warmup`` steps; ``first_step_s`` the first step (eager: no compile).
``--prefill``: no adapter, ``torch.no_grad()``, ``model.eval()``, one forward over batch × seq
tokens without a cache (``use_cache=False``), the logits of the last position only
(``logits_to_keep=1``, what a prefill needs for its first token; ``--all-logits``: every position);
``--steps`` forwards, the first ``--warmup`` untimed.
``--decode``: no adapter, ``model.eval()``, greedy ``model.generate`` under ``torch.inference_mode()``
as ``../shared/bench/peer_hf_lora.py --gen`` calls it (``max_new_tokens = min_new_tokens =
--new-tokens``, ``use_cache=True``, ``do_sample=False``, ``num_beams=1``, ``eos_token_id=None``,
``pad_token_id=0``, an all-ones attention mask) after a ``--prompt-len`` prompt
``default_rng(1234).integers(0, vocab, (batch, prompt_len))``; ``--steps`` calls, the first
``--warmup`` untimed. Each call is split by a streamer's timestamps (``put`` gets the prompt, then
every step's tokens): ``prefill_s`` = call start → first new tokens, decode = first → last new
tokens (N − 1 steps). Figures as ``benchmarks/qwen3_5.py --decode``'s: ``decode_tokens_per_s`` =
batch·(N − 1) / median decode, ``ms_per_decode_step``, ``tokens_per_s`` = batch·N / median call,
``gen_ms``, ``first_call_s``, ``first_token_s``, ``compile_s`` (first call − median call: eager, so
only first-call overheads), ``wall_to_first_token_s``.

    PEER_VENV/bin/python benchmarks/peers/hf_qwen3_5.py [--train | --prefill] [--num-hidden-layers 4]
                         [--batch 1 --seq 512] [--steps 5 --warmup 1] [--targets q_proj,...]
    PEER_VENV/bin/python benchmarks/peers/hf_qwen3_5.py --decode [--num-hidden-layers 4] [--batch 1 | 8]
                         [--prompt-len 64 --new-tokens 64] [--steps 5 --warmup 1]
"""
import argparse
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # last: benchmarks/profile.py is no stdlib profile
from decode_timing import decode_figures  # noqa: E402  (shared with benchmarks/qwen3_5.py)

# qwen3.5-0.8b (mindqwen.presets, the published text_config)
DEFAULTS = (("vocab-size", 248320), ("hidden-size", 1024), ("intermediate-size", 3584), ("num-hidden-layers", 24),
            ("num-attention-heads", 8), ("num-key-value-heads", 2), ("head-dim", 256), ("linear-num-key-heads", 16),
            ("linear-num-value-heads", 16), ("linear-key-head-dim", 128), ("linear-value-head-dim", 128),
            ("linear-conv-kernel-dim", 4), ("full-attention-interval", 4), ("max-position-embeddings", 4096))
TARGETS = "q_proj,k_proj,v_proj,o_proj,in_proj_qkv,in_proj_z,out_proj"


def peak_rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    for name, default in DEFAULTS:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--rope-theta", type=float, default=1e7)
    ap.add_argument("--partial-rotary-factor", type=float, default=0.25)
    ap.add_argument("--rms-norm-eps", type=float, default=1e-6)
    ap.add_argument("--no-tie-word-embeddings", action="store_true")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--train", action="store_true", help="LoRA step (the default)")
    mode.add_argument("--prefill", action="store_true", help="no-grad forward, no cache")
    mode.add_argument("--decode", action="store_true", help="greedy generate: prompt, then --new-tokens")
    ap.add_argument("--all-logits", action="store_true", help="prefill: logits of every position")
    ap.add_argument("--targets", default=TARGETS, help="LoRA target_modules, comma-separated (or all-linear)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=64, help="decode: prompt tokens per row")
    ap.add_argument("--new-tokens", type=int, default=64, help="decode: tokens generated per row (>= 2)")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    t_start = time.perf_counter()
    import numpy as np
    import torch
    import transformers
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.set_num_threads(a.threads)
    t_import = time.perf_counter()
    config = Qwen3_5TextConfig(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_hidden_layers, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads, head_dim=a.head_dim,
        linear_num_key_heads=a.linear_num_key_heads, linear_num_value_heads=a.linear_num_value_heads,
        linear_key_head_dim=a.linear_key_head_dim, linear_value_head_dim=a.linear_value_head_dim,
        linear_conv_kernel_dim=a.linear_conv_kernel_dim, full_attention_interval=a.full_attention_interval,
        max_position_embeddings=a.max_position_embeddings, rms_norm_eps=a.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": a.rope_theta,
                         "partial_rotary_factor": a.partial_rotary_factor},
        tie_word_embeddings=not a.no_tie_word_embeddings, use_cache=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).float()
    kind = "prefill" if a.prefill else "decode" if a.decode else "train"
    fla = importlib.util.find_spec("fla") is not None
    conv = importlib.util.find_spec("causal_conv1d") is not None
    out = dict(harness="peer_hf_qwen3_5", benchmark=kind, threads=a.threads, attn="eager",
               kernels=("flash-linear-attention (fla)" if fla else
                        "torch fallback: torch_chunk_gated_delta_rule (no flash-linear-attention)")
               + ("; causal-conv1d" if conv else "; F.conv1d (no causal-conv1d)"),
               layers=config.num_hidden_layers, layer_types=dict(
                   linear=config.layer_types.count("linear_attention"),
                   full=config.layer_types.count("full_attention")),
               versions=dict(python=platform.python_version(), torch=torch.__version__,
                             transformers=transformers.__version__))
    if kind == "train":
        import peft
        targets = a.targets if a.targets == "all-linear" else a.targets.split(",")
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0, bias="none",
                                                           target_modules=targets, task_type="CAUSAL_LM"))
        out["versions"]["peft"] = peft.__version__
        out["targets"] = a.targets
    out["build_s"] = round(time.perf_counter() - t_import, 2)
    out["import_s"] = round(t_import - t_start, 2)
    if kind == "decode":
        out.update(decode(model, a, t_start), total_params=sum(p.numel() for p in model.parameters()),
                   peak_rss_mb=round(peak_rss_mb()), pid=os.getpid())
        print(json.dumps(out))
        return
    data = torch.from_numpy(np.random.default_rng(1234).integers(0, a.vocab_size, (a.steps, a.batch, a.seq)))
    times, losses = [], []
    if kind == "train":
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)
        for i in range(a.steps):
            t0 = time.perf_counter()
            loss = model(input_ids=data[i], labels=data[i]).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
            if i == 0:
                wall = time.perf_counter() - t_start
        out.update(loss_first=round(losses[0], 4), loss_last=round(losses[-1], 4),
                   trainable_params=sum(p.numel() for p in params))
    else:
        model.eval()
        keep = 0 if a.all_logits else 1
        with torch.no_grad():
            for i in range(a.steps):
                t0 = time.perf_counter()
                logits = model(input_ids=data[i], use_cache=False, logits_to_keep=keep).logits
                times.append(time.perf_counter() - t0)
                if i == 0:
                    wall = time.perf_counter() - t_start
        out.update(logits_shape=list(logits.shape), logit_std=round(float(logits.float().std()), 4))
    med = statistics.median(times[a.warmup:])
    out.update(batch=a.batch, seq=a.seq, steps=a.steps, warmup=a.warmup,
               tokens_per_s=round(a.batch * a.seq / med, 1), step_ms=round(med * 1e3, 1),
               first_step_s=round(times[0], 2), compile_s=0.0,
               total_params=sum(p.numel() for p in model.parameters()), peak_rss_mb=round(peak_rss_mb()),
               wall_to_first_step_s=round(wall, 2), pid=os.getpid())
    print(json.dumps(out))


def decode(model, a, t_start: float) -> dict:
    """Greedy generate calls, each split into prefill and decode by a streamer's timestamps."""
    import numpy as np
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        """Arrival times of what generate streams: the prompt, then each step's new tokens."""

        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    if a.new_tokens < 2 or a.steps <= a.warmup:
        raise SystemExit("--decode needs --new-tokens >= 2 and --steps > --warmup")
    model.eval()
    prompt = torch.from_numpy(np.random.default_rng(1234).integers(0, a.vocab_size, (a.batch, a.prompt_len)))
    common = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                  do_sample=False, use_cache=True, num_beams=1, eos_token_id=None, pad_token_id=0)
    calls = []  # (call, prefill, decode) seconds
    for i in range(a.steps):
        stamps = Stamps()
        t0 = time.perf_counter()
        with torch.inference_mode():
            ids = model.generate(prompt, streamer=stamps, **common)
        end = time.perf_counter()
        first, last = stamps.times[1], stamps.times[-1]  # [0] is the prompt
        assert len(stamps.times) == a.new_tokens + 1 and ids.shape == (a.batch, a.prompt_len + a.new_tokens)
        calls.append((end - t0, first - t0, last - first))
        if i == 0:
            wall = first - t_start
    return dict(batch=a.batch, prompt_len=a.prompt_len, new_tokens=a.new_tokens, steps=a.steps, warmup=a.warmup,
                **decode_figures(calls, a.batch, a.new_tokens, a.warmup), wall_to_first_token_s=round(wall, 2),
                first_new_ids=ids[0, a.prompt_len:a.prompt_len + 8].tolist())


if __name__ == "__main__":
    main()
