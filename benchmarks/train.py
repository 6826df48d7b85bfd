"""Training throughput on bench-small (../shared/bench/README.md) or a real shape: one JSON line.

``--shape bench-small`` (default): Qwen2 shapes (vocab 16384, hidden 512, intermediate 1408,
4 layers, 8 heads / 2 KV heads, tied embeddings), batch 4 × 256; ``bench-small-moe``: the same
as a Qwen3-MoE (8 experts of width 352, 2 per token, q/k-norm). ``--shape qwen2.5-0.5b`` (and
the other names in ``mindqwen.presets``): that model's dimensions, random init. Always fp32,
AdamW lr 1e-4, LoRA r 8 / alpha 32 on q_proj, v_proj (``--full`` for a full fine-tune), random
init (seed 0); ``--targets`` other LoRA targets. ``qwen3-30b-a3b-narrow``: Qwen3-30B-A3B's
depth, experts and heads at narrow widths (its compile time). Data as the peer script draws it:
``default_rng(1234).integers(0, vocab, (steps, batch, seq))``, labels = input_ids.
The timed region is one compiled optimizer step (the same ``Stepper`` that ``fit`` uses);
``tokens_per_s`` is batch·seq over the median step time after ``--warmup`` steps, ``mfu`` is the
achieved matmul FLOP rate over the fp32 matmul rate measured in the same process.

    python benchmarks/train.py [--shape qwen2.5-0.5b] [--batch 1 --seq 512] [--full] [--no-fusion]
                               [--steps 20] [--recompute none|full|attention|mlp] [--recompute-every K]
                               [--threads 2] [--compile-cache DIR] [--moe-capacity-factor F]

mindqwen's defaults are what is measured (CPU graph-kernel fusion on, see ``mindqwen.backend``);
``--no-fusion`` turns fusion off, as it was before it became the default.
"""
import argparse
import json
import os
import statistics
import sys
import time

BENCH_SMALL = dict(vocab_size=16384, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
                   tie_word_embeddings=True, max_position_embeddings=2048)
# bench-small as a Qwen3 mixture of experts: 8 experts of a quarter of the MLP width, 2 per token.
BENCH_SMALL_MOE = dict(BENCH_SMALL, model_type="qwen3_moe", qkv_bias=False, qk_norm=True, head_dim=64,
                       num_experts=8, num_experts_per_tok=2, moe_intermediate_size=352, norm_topk_prob=True)
# Qwen3-30B-A3B's structure (48 layers of 128 experts, 8 per token; 32 heads, 4 KV heads) at narrow
# widths: what the graph compiler sees of the real model, in a CPU's memory.
QWEN3_30B_A3B_NARROW = dict(model_type="qwen3_moe", vocab_size=1024, hidden_size=256, intermediate_size=512,
                            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=8,
                            qkv_bias=False, qk_norm=True, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False,
                            max_position_embeddings=2048)
SHAPES = ("bench-small", "bench-small-moe", "qwen3-30b-a3b-narrow", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-0.6b")


def child_json(cmd: list) -> dict:
    """Run a benchmark's child process (MindSpore at errors only) and return the JSON of its last
    stdout line; a failure raises with the end of its stderr."""
    import subprocess
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "GLOG_v": "3"})
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def shape_config(name: str, layers: int = 0) -> dict:
    """QwenConfig keyword arguments of a benchmark shape (``layers`` > 0 overrides the depth)."""
    from mindqwen.presets import PRESETS
    bench = {"bench-small": BENCH_SMALL, "bench-small-moe": BENCH_SMALL_MOE, "qwen3-30b-a3b-narrow": QWEN3_30B_A3B_NARROW}
    config = dict(bench[name]) if name in bench else dict(PRESETS[name], max_position_embeddings=4096)
    if layers:
        config["num_hidden_layers"] = layers
    return config


def parser(description: str) -> argparse.ArgumentParser:
    """The bench-small options (shared with profile.py)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--shape", default="bench-small", choices=SHAPES)
    ap.add_argument("--full", action="store_true", help="full fine-tune instead of LoRA")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--layers", type=int, default=0, help="override the shape's depth")
    ap.add_argument("--recompute", default="none", choices=["none", "full", "attention", "mlp"])
    ap.add_argument("--recompute-every", type=int, default=1, help="recompute only every K-th layer")
    ap.add_argument("--threads", type=int, default=0, help="CPU op threads (0: MindSpore's default)")
    ap.add_argument("--targets", default="q_proj,v_proj", help="LoRA target_modules, comma-separated")
    ap.add_argument("--moe-capacity-factor", type=float, default=None,
                    help="bench-small-moe: QwenConfig.moe_capacity_factor (default: exact, every expert on every token)")
    ap.add_argument("--no-fusion", dest="fusion", action="store_false",
                    help="turn off CPU graph-kernel fusion (mindqwen's default)")
    ap.add_argument("--compile-once", default="auto", choices=["auto", "on", "off"],
                    help="equal decoder layers compiled once (QwenModel.set_compile_once): auto (the "
                         "default: LoRA's layers), on (every layer, the KV-cache step too), off")
    return ap


def build(args: argparse.Namespace) -> tuple:
    """Import mindqwen (then MindSpore), build the model, its ``Stepper`` and the data."""
    from mindqwen import LoraConfig, QwenConfig, QwenForCausalLM, apply_lora
    from mindqwen import backend
    if not args.fusion or getattr(args, "compile_cache", None):  # the compile cache excludes fusion
        backend.disable_cpu_fusion()
    import mindspore as ms
    import numpy as np
    from mindqwen.train.optim import WarmupSchedule, make_optimizer
    from mindqwen.train.precision import PrecisionConfig, make_loss_scaler
    from mindqwen.train.recompute import apply_recompute
    from mindqwen.train.step import Stepper
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    if args.threads:
        ms.device_context.cpu.op_tuning.threads_num(args.threads)
    ms.set_seed(0)
    extra = {} if args.moe_capacity_factor is None else {"moe_capacity_factor": args.moe_capacity_factor}
    config = QwenConfig(**shape_config(args.shape, args.layers), **extra)
    t = time.perf_counter()
    model = QwenForCausalLM(config)
    args.build_s = time.perf_counter() - t
    if not args.full:
        apply_lora(model, LoraConfig(r=8, lora_alpha=32, target_modules=args.targets.split(",")))
    apply_recompute(model, args.recompute, args.recompute_every)
    mode = getattr(args, "compile_once", "auto")
    if mode != "auto":
        model.model.set_compile_once(mode == "on")
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
    from mindqwen import backend
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
        "mode": "full" if args.full else "lora", "fusion": backend.fusion_enabled(), "shape": args.shape,
        "layers": config.num_hidden_layers, "targets": args.targets,
        "compiled_once": sum(layer.compiled_once is not None for layer in model.model.layers), "batch": args.batch, "seq": args.seq, "recompute": args.recompute,
        "recompute_every": args.recompute_every, "steps": args.steps, "build_s": round(args.build_s, 1),
        "compile_cache": bool(args.compile_cache), "moe_capacity_factor": args.moe_capacity_factor,
        "tokens_per_s": round(tokens / step_s, 1), "step_ms": round(step_s * 1e3, 1),
        "compile_s": round(times[0] - step_s, 2), "peak_rss_mb": round(peak_memory_mb()),
        "rss_after_build_mb": round(rss_built), "achieved_gflops": round(flops / step_s / 1e9, 1),
        "matmul_peak_gflops": round(peak, 1), "mfu": round(flops / step_s / 1e9 / peak, 3),
        "loss_first": round(losses[0], 4), "loss_last": round(losses[-1], 4),
        "python": sys.version.split()[0], "pid": os.getpid()}))


if __name__ == "__main__":
    main()
