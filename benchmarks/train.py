"""Training throughput on bench-small (../shared/bench/README.md): one JSON line.

Qwen2 shapes (vocab 16384, hidden 512, intermediate 1408, 4 layers, 8 heads / 2 KV heads, tied
embeddings), random init (seed 0), fp32, batch 4 × 256, AdamW lr 1e-4, LoRA r 8 / alpha 32 on
q_proj, v_proj (``--full`` for a full fine-tune). Data as the peer script draws it:
``default_rng(1234).integers(0, vocab, (steps, batch, seq))``, labels = input_ids.
The timed region is one compiled optimizer step (the same ``Stepper`` that ``fit`` uses);
``tokens_per_s`` is batch·seq over the median step time after ``--warmup`` steps, ``mfu`` is the
achieved matmul FLOP rate over the fp32 matmul rate measured in the same process.

    python benchmarks/train.py [--full] [--fusion] [--steps 20] [--recompute none|full] [--threads 2]
                               [--compile-cache DIR]

``--fusion`` turns on MindSpore's graph-kernel (AKG) fusion for the CPU with the settings that
docs/performance.md explains; they are environment variables read when MindSpore loads, so they
are set here before the import (AKG's build server also needs ``pip install decorator``).
"""
import argparse
import json
import os
import statistics
import sys
import time

# Read when MindSpore (and libgomp) load: set before `import mindspore`.
CPU_FUSION_ENV = {
    "OMP_WAIT_POLICY": "PASSIVE",  # fused kernels run on libgomp threads: no spinning on 2 cores
    "MS_DEV_GRAPH_KERNEL_FLAGS": "--opt_level=2 --disable_cluster_ops=Exp,Log --composite_op_limit_size=50",
    "AKG_WHITE_LIST_PATH": "/",  # silences AKG's tiling-repository lines on stdout
}

BENCH_SMALL = dict(vocab_size=16384, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                   tie_word_embeddings=True, max_position_embeddings=2048)


def parser(description: str) -> argparse.ArgumentParser:
    """The bench-small options (shared with profile.py)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--full", action="store_true", help="full fine-tune instead of LoRA")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--recompute", default="none", choices=["none", "full", "attention", "mlp"])
    ap.add_argument("--threads", type=int, default=0, help="CPU op threads (0: MindSpore's default)")
    ap.add_argument("--fusion", action="store_true", help="graph-kernel fusion (see the module docstring)")
    return ap


def build(args: argparse.Namespace) -> tuple:
    """Set the environment, import MindSpore, build the model, its ``Stepper`` and the data."""
    if args.fusion:
        os.environ.update(CPU_FUSION_ENV)
    import mindspore as ms
    import numpy as np
    from mindqwen import LoraConfig, QwenConfig, QwenForCausalLM, apply_lora
    from mindqwen.train.optim import WarmupSchedule, make_optimizer
    from mindqwen.train.precision import PrecisionConfig, make_loss_scaler
    from mindqwen.train.recompute import apply_recompute
    from mindqwen.train.step import Stepper
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    if args.threads:
        ms.device_context.cpu.op_tuning.threads_num(args.threads)
    ms.set_seed(0)
    config = QwenConfig(**{**BENCH_SMALL, "num_hidden_layers": args.layers})
    model = QwenForCausalLM(config)
    if not args.full:
        apply_lora(model, LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"]))
    apply_recompute(model, args.recompute)
    model.set_train(True)
    optimizer = make_optimizer(model.trainable_params(), WarmupSchedule("constant", 1e-4, args.steps))
    stepper = Stepper(model, optimizer, make_loss_scaler(PrecisionConfig()), clip_norm=0.0)
    data = np.random.default_rng(1234).integers(0, config.vocab_size, (args.steps, args.batch, args.seq))
    return model, config, stepper, data.astype(np.int32)


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--compile-cache", help="a compile-cache root (a second run loads the graph)")
    args = ap.parse_args()
    model, config, stepper, data = build(args)
    import mindspore as ms
    from mindqwen.train.compile_cache import compile_cache, graph_key
    from mindqwen.train.metrics import measure_matmul_peak_gflops, peak_memory_mb, train_flops_per_token
    rss_built = peak_memory_mb()
    cache = args.compile_cache and os.path.join(args.compile_cache, graph_key(model, vars(args), {}))
    times, losses = [], []
    with compile_cache(cache):
        for i in range(args.steps):
            ids = ms.Tensor(data[i])
            t = time.perf_counter()
            loss, _, _ = stepper([(ids, ids)])
            times.append(time.perf_counter() - t)
            losses.append(loss)
    step_s = statistics.median(times[args.warmup:])
    tokens = args.batch * args.seq
    trainable = sum(p.size for p in model.trainable_params()) / sum(p.size for p in model.get_parameters())
    flops = train_flops_per_token(config, args.seq, trainable) * tokens
    peak = measure_matmul_peak_gflops()
    print(json.dumps({
        "benchmark": "train", "framework": "mindqwen (MindSpore %s, graph mode)" % ms.__version__,
        "mode": "full" if args.full else "lora", "fusion": args.fusion, "config": "bench-small", "layers": args.layers,
        "batch": args.batch, "seq": args.seq, "recompute": args.recompute, "steps": args.steps,
        "compile_cache": bool(args.compile_cache),
        "tokens_per_s": round(tokens / step_s, 1), "step_ms": round(step_s * 1e3, 1),
        "compile_s": round(times[0] - step_s, 2), "peak_rss_mb": round(peak_memory_mb()),
        "rss_after_build_mb": round(rss_built), "achieved_gflops": round(flops / step_s / 1e9, 1),
        "matmul_peak_gflops": round(peak, 1), "mfu": round(flops / step_s / 1e9 / peak, 3),
        "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
        "python": sys.version.split()[0], "pid": os.getpid()}))


if __name__ == "__main__":
    main()
