#!/usr/bin/env python3
"""PEER: HF TRL DPOTrainer (LoRA, sigmoid DPO) train-step throughput on CPU, one JSON line.

The preference-tuning counterpart of ../shared/bench/peer_hf_lora.py (same conventions: random init with
torch seed 0, fp32, AdamW lr 1e-4 with torch defaults otherwise, LoRA r 8 / alpha 32 on q_proj, v_proj,
dropout 0; numpy data; one JSON line on stdout, diagnostics on stderr; per-step CPU-contention monitor).
Run with the TRL virtualenv (torch 2.13.0+cpu, transformers 5.25, peft 0.21.2, trl 1.16.0, numpy<2):

    /work/trl/bin/python benchmarks/peers/trl_dpo.py --shape tiny --steps 5                 # smoke test
    /work/trl/bin/python benchmarks/peers/trl_dpo.py --shape qwen2.5-0.5b --clean-steps 10  # ~10+ s/step

Model: ``torch.manual_seed(0); Qwen2ForCausalLM(config)`` (HF init), fp32, ``--attn`` sdpa (default) or
eager. ``--shape qwen2.5-0.5b``: vocab 151936, hidden 896, intermediate 4864, 24 layers, 14 heads, 2 KV
heads (head_dim 64), tied embeddings, rope_theta 1e6, rms_norm_eps 1e-6, qkv bias, max_position 4096.
``--shape tiny``: vocab 512, hidden 64, intermediate 128, 2 layers, 4 heads, 2 KV heads, otherwise the same.

Trainer: ``trl.DPOTrainer(model=<plain Qwen2ForCausalLM>, peft_config=LoraConfig(...), args=DPOConfig(
loss_type="sigmoid", beta=0.1, bf16=False, gradient_checkpointing=False, use_cpu=True, max_length=None,
disable_dropout=True, ...))``. The adapter is created by the trainer from ``peft_config``, so the reference is
the same model with the adapters disabled (TRL's ``use_adapter(model, None)`` -> ``disable_adapter()``), no
reference copy. (Passing an already-wrapped PeftModel instead would make TRL 1.16 copy the adapter into a
frozen "ref" adapter.) ``--full``: no LoRA, every weight trained, reference = a deep copy of the initial model
passed as ``ref_model``. The trainer's constructor demands a tokenizer and a dataset; a throw-away word-level
tokenizer and a one-row dummy dataset satisfy it and never touch the benchmark batches.

Data (no torch RNG involved; reproducible in any framework):
    rng  = numpy.random.default_rng(1234)
    data = rng.integers(0, vocab, size=(n_steps, pairs, P + 2*R), dtype=np.int64)   # P = --prompt-len, R = --response-len
    step i, pair j: prompt = data[i, j, :P], chosen = data[i, j, P:P+R], rejected = data[i, j, P+R:]
(the first steps do not depend on n_steps, so --clean-steps just continues the stream). Each step's batch is
built OUTSIDE the timed region by TRL's own ``DataCollatorForPreference`` (trainer.data_collator) from
{"prompt_ids", "chosen_ids", "rejected_ids"}: input_ids [2*pairs, P+R] = all chosen rows then all rejected
rows, attention_mask all ones (equal lengths, so no padding), completion_mask 1 on the response positions. No
BOS/EOS/chat template.

Timed region of a step: ``trainer.compute_loss(model, batch)`` (policy forward of chosen+rejected as one batch
of 2*pairs rows through TRL's fused LM head, the reference forward of the same rows under no_grad with the
adapters disabled, sigmoid DPO loss, TRL's metric logging) + ``loss.backward()`` + ``AdamW.step()`` +
``zero_grad(set_to_none=True)``. step_ms = median over the steps after --warmup; pairs_per_s = pairs / step;
tokens_per_s = 2*pairs*(P+R) / step (the sequence tokens of a step, each of which is run through the policy
forward+backward AND the reference forward).

Contention: every timed step records foreign_cores (CPU used by other processes, cpumon.py next to
peer_hf_lora.py). --clean-steps K keeps stepping (waiting for quiet after a contended step) until K timed
steps with foreign_cores < --quiet-threshold exist; step_ms etc. are then medians over those clean steps
(timing_basis="clean"); *_all fields keep the plain median.

Sanity: at step 0 LoRA B = 0, so policy == reference and the loss is ln 2 (loss_first_minus_ln2 against the
float64 ln 2, ~1.9e-9 for float32(ln 2); loss_first_is_f32_ln2 for the exact float32 comparison).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_CPUMON_DIRS = (os.environ.get("PEER_BENCH_DIR", ""), "/work/shared/bench", _HERE)

SHAPES = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                 rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="HF TRL DPOTrainer (LoRA) CPU peer benchmark")
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention implementation")
    ap.add_argument("--steps", type=int, default=10, help="train steps incl. warm-up")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=1, help="preference pairs per step")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=256, help="length of chosen and of rejected")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    ap.add_argument("--full", action="store_true", help="full fine-tune (reference = deep copy) instead of LoRA")
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--lora-alpha", type=float, default=32)
    ap.add_argument("--lora-targets", default="q_proj,v_proj")
    ap.add_argument("--seed", type=int, default=0, help="torch seed for weight init")
    ap.add_argument("--data-seed", type=int, default=1234, help="numpy seed for token ids")
    ap.add_argument("--tag", default="", help="free text copied into the JSON")
    ap.add_argument("--wait-quiet", type=float, default=0.0,
                    help="before timing, wait up to this many seconds for other processes to go idle")
    ap.add_argument("--quiet-threshold", type=float, default=0.15,
                    help="a step counts as 'clean' if other processes used < this many cores during it")
    ap.add_argument("--clean-steps", type=int, default=0,
                    help="keep going past --steps (waiting for quiet after a contended step) until this many "
                         "clean timed steps exist; step_ms etc. then = median over clean ones only")
    ap.add_argument("--max-steps", type=int, default=200, help="cap on steps with --clean-steps")
    ap.add_argument("--max-wall", type=float, default=900, help="cap on seconds with --clean-steps")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.pairs < 1 or a.prompt_len < 1 or a.response_len < 1:
        ap.error("--steps, --pairs, --prompt-len, --response-len must be >= 1")
    return a


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)  # Linux: KiB


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return round(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def import_cpumon():
    for d in _CPUMON_DIRS:
        if d and os.path.isfile(os.path.join(d, "cpumon.py")):
            sys.path.insert(0, d)
            break
    try:
        from cpumon import Sampler, wait_quiet
        return Sampler, wait_quiet
    except ImportError:  # pragma: no cover - monitor unavailable: record nothing, never wait
        log("cpumon.py not found; foreign_cores not recorded")

        class Sampler:
            def delta(self):
                return {"foreign_cores": 0.0}

        def wait_quiet(*_a, **_k):
            return {"waited_s": 0.0, "quiet": None, "last_foreign_cores": None}

        return Sampler, wait_quiet


def make_tokenizer():
    """The word-level tokenizer the trainer's constructor needs (none of the timed batches use it)."""
    return _golden().make_tokenizer()


def dummy_dataset():
    """The one-row dataset the trainer's constructor needs."""
    return _golden().dummy_dataset()


def _golden():
    """tests/fixtures/preference/make_trl_golden.py, which builds TRL's trainers the same way."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "preference",
                        "make_trl_golden.py")
    spec = importlib.util.spec_from_file_location("make_trl_golden", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    a = parse_args(argv)
    if a.threads is not None:
        os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    t_import = time.perf_counter()
    import numpy as np
    import torch
    import transformers
    import peft
    import trl
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl import DPOConfig, DPOTrainer

    if a.threads is not None:
        torch.set_num_threads(a.threads)
    Sampler, wait_quiet = import_cpumon()
    import_s = time.perf_counter() - t_import

    shape = dict(SHAPES[a.shape])
    hf_kwargs = dict(shape)
    hf_kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": hf_kwargs.pop("rope_theta")}
    config = Qwen2Config(**hf_kwargs, use_cache=False)  # Qwen2: q/k/v biases always on, o_proj none
    config._attn_implementation = a.attn

    t_build = time.perf_counter()
    torch.manual_seed(a.seed)
    model = Qwen2ForCausalLM(config).float()
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    total_params_base = sum(p.numel() for p in model.parameters())
    ref_model = copy.deepcopy(model) if a.full else None

    tmp = tempfile.mkdtemp(prefix="trl_dpo_bench_")
    try:
        targs = DPOConfig(
            output_dir=tmp,
            loss_type=["sigmoid"],
            beta=a.beta,
            learning_rate=a.lr,  # unused (own optimizer below); recorded for clarity
            bf16=False,  # TRL configs default to bf16=True
            gradient_checkpointing=False,  # TRL configs default to True
            use_cpu=True,
            report_to="none",
            per_device_train_batch_size=a.pairs,
            disable_dropout=True,
            max_length=None,  # no truncation (default 1024)
            pad_to_multiple_of=None,
            seed=a.seed,
        )
        kw = dict(args=targs, train_dataset=dummy_dataset(), processing_class=make_tokenizer())
        with contextlib.redirect_stdout(sys.stderr):
            if a.full:
                trainer = DPOTrainer(model=model, ref_model=ref_model, **kw)
            else:
                lcfg = peft.LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha, lora_dropout=0.0, bias="none",
                                       target_modules=a.lora_targets.split(","), task_type="CAUSAL_LM")
                trainer = DPOTrainer(model=model, peft_config=lcfg, **kw)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tmodel = trainer.model
    if not a.full:
        assert isinstance(tmodel, peft.PeftModel) and trainer.ref_model is None
        assert "ref" not in tmodel.peft_config, "TRL built a 'ref' adapter: reference would not be the base"
    tmodel.train()
    params = [p for p in tmodel.parameters() if p.requires_grad]
    trainable = sum(p.numel() for p in params)
    total_params = sum(p.numel() for p in tmodel.parameters())
    if not a.full:
        n_lora = sum(1 for n, p in tmodel.named_parameters() if p.requires_grad and ".lora_" in n)
        assert trainable == sum(p.numel() for n, p in tmodel.named_parameters() if ".lora_" in n), "non-LoRA trainable"
        assert all(float(p.detach().abs().max()) == 0 for n, p in tmodel.named_parameters() if ".lora_B." in n)
    opt = torch.optim.AdamW(params, lr=a.lr)  # betas (0.9, 0.999), eps 1e-8, weight_decay 0.01 (torch defaults)
    build_s = time.perf_counter() - t_build
    rss_after_build = current_rss_mb()
    peak_after_build = peak_rss_mb()
    log(f"built {a.shape} ({'full' if a.full else 'lora'}, {a.attn}) in {build_s:.1f} s: {total_params} params, "
        f"{trainable} trainable, rss {rss_after_build} MB, torch threads {torch.get_num_threads()}")

    P, R, B = a.prompt_len, a.response_len, a.pairs
    n_data = max(a.steps, a.max_steps) if a.clean_steps else a.steps
    rng = np.random.default_rng(a.data_seed)
    data = rng.integers(0, shape["vocab_size"], size=(n_data, B, P + 2 * R), dtype=np.int64)
    collator = trainer.data_collator

    def make_batch(i):
        feats = [{"prompt_ids": row[:P].tolist(), "chosen_ids": row[P:P + R].tolist(),
                  "rejected_ids": row[P + R:].tolist()} for row in data[i]]
        batch = collator(feats)
        assert tuple(batch["input_ids"].shape) == (2 * B, P + R), batch["input_ids"].shape
        return batch

    b0 = make_batch(0)
    assert int(b0["attention_mask"].sum()) == 2 * B * (P + R)
    assert int(b0["completion_mask"].sum()) == 2 * B * R
    metrics_store = trainer._metrics["train"]

    quiet = wait_quiet(a.wait_quiet) if a.wait_quiet > 0 else None
    waited = 0.0
    times, losses, foreign, trl_metrics = [], [], [], {}
    t_start = time.perf_counter()
    i = 0
    while True:
        n_timed_clean = sum(1 for f in foreign[a.warmup:] if f < a.quiet_threshold)
        if i >= a.steps and (not a.clean_steps or n_timed_clean >= a.clean_steps or i >= n_data
                             or time.perf_counter() - t_start > a.max_wall):
            break
        if a.clean_steps and i > a.warmup and foreign[-1] >= a.quiet_threshold:
            waited += wait_quiet(120, a.quiet_threshold)["waited_s"]
        batch = b0 if i == 0 else make_batch(i)
        for v in metrics_store.values():
            v.clear()
        smp = Sampler()
        t0 = time.perf_counter()
        loss = trainer.compute_loss(tmodel, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        foreign.append(smp.delta()["foreign_cores"])
        times.append(dt)
        losses.append(float(loss.detach()))
        trl_metrics = {k: v[-1] for k, v in metrics_store.items() if v}
        log(f"step {i} loss {losses[-1]:.6f} {dt * 1e3:.0f} ms foreign_cores {foreign[-1]}")
        i += 1

    w = a.warmup if len(times) > a.warmup else 0
    timed, ftimed = times[w:], foreign[w:]
    med_all = statistics.median(timed)
    clean = [t for t, f in zip(timed, ftimed) if f < a.quiet_threshold]
    med_clean = statistics.median(clean) if clean else None
    use_clean = bool(a.clean_steps and clean)
    med = med_clean if use_clean else med_all
    tok_step = 2 * B * (P + R)
    ln2 = math.log(2.0)
    out = dict(
        harness="peer_trl_dpo", mode="full" if a.full else "lora", tag=a.tag, shape=a.shape, config=shape,
        attn_implementation=a.attn, dtype="float32", threads=torch.get_num_threads(),
        threads_requested=a.threads,
        versions=dict(python=platform.python_version(), torch=torch.__version__,
                      transformers=transformers.__version__, peft=peft.__version__, trl=trl.__version__,
                      numpy=np.__version__),
        trainer="trl.DPOTrainer.compute_loss", loss_type="sigmoid", beta=a.beta,
        reference="model with adapters disabled (peft_config path)" if not a.full else "deep copy (ref_model)",
        optimizer="torch.optim.AdamW (torch defaults: betas 0.9/0.999, eps 1e-8, weight_decay 0.01)", lr=a.lr,
        pairs=B, prompt_len=P, response_len=R, rows_per_step=2 * B, tokens_per_step=tok_step,
        steps=len(times), warmup=a.warmup, timing_basis="clean" if use_clean else "all",
        step_ms=round(med * 1e3, 2),
        pairs_per_s=round(B / med, 4),
        tokens_per_s=round(tok_step / med, 1),
        first_step_s=round(times[0], 3),
        step_ms_all_median=round(med_all * 1e3, 2),
        tokens_per_s_all=round(tok_step / med_all, 1),
        step_ms_min=round(min(timed) * 1e3, 2), step_ms_max=round(max(timed) * 1e3, 2),
        step_ms_all=[round(t * 1e3, 1) for t in times],
        foreign_cores_per_step=foreign, foreign_cores_median=statistics.median(ftimed),
        contended=statistics.median(ftimed) >= a.quiet_threshold, wait_quiet=quiet,
        waited_between_steps_s=round(waited, 1), clean_steps=len(clean),
        step_ms_clean=round(med_clean * 1e3, 2) if clean else None,
        tokens_per_s_clean=round(tok_step / med_clean, 1) if clean else None,
        loss_first=round(losses[0], 7), loss_last=round(losses[-1], 7),
        loss_first_minus_ln2=losses[0] - ln2,
        loss_first_is_f32_ln2=bool(np.float32(losses[0]) == np.float32(ln2)),
        losses=[round(x, 6) for x in losses],
        trl_metrics_last={k: round(float(v), 6) for k, v in trl_metrics.items()},
        trainable_params=trainable, total_params=total_params, total_params_base=total_params_base,
        import_s=round(import_s, 2), build_s=round(build_s, 2),
        rss_after_build_mb=rss_after_build, peak_rss_after_build_mb=peak_after_build,
        peak_rss_mb=peak_rss_mb(),
    )
    if not a.full:
        out.update(lora_r=a.lora_r, lora_alpha=a.lora_alpha, lora_targets=a.lora_targets.split(","),
                   lora_tensors=n_lora)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
