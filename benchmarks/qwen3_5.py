"""Qwen3.5 (hybrid Gated DeltaNet + gated attention) LoRA step, prefill and decode, alone or against HF: one JSON line.

``--shape qwen3.5-0.8b`` (default; any Qwen3.5 name in ``mindqwen.presets``): that model's dimensions,
random init (seed 0), fp32, ``--layers N`` to cut its depth (the layer pattern stays: three Gated
DeltaNet layers, then one full-attention layer). Data as the peer draws it:
``default_rng(1234).integers(0, vocab, (steps, batch, seq))``.

``--train`` (default): LoRA r 8 / alpha 32 on ``--targets`` (default the attention projections and
the DeltaNet's in_proj_qkv, in_proj_z, out_proj), AdamW lr 1e-4, labels = input_ids: the compiled
optimizer step of ``benchmarks/train.py`` (``build``, the ``Stepper`` that ``fit`` uses).
``--prefill``: a compiled forward over batch × seq tokens without a cache, returning the last
position's logits (``--all-logits``: every position's), as the model's own forward does for a user:
no weights frozen.
Figures: ``tokens_per_s`` = batch·seq / median step after ``--warmup``; what a user waits for:
``build_s`` (the model's construction), ``first_step_s`` (the first call: graph compile + one step),
``compile_s`` (= first_step_s − the median step), ``wall_to_first_step_s`` (from the script's start
to the end of the first step: imports, build, LoRA, compile, one step); ``peak_rss_mb`` (VmHWM).

``--decode``: greedy ``mindqwen.generation.generate`` (KV cache beside the DeltaNet states) of
``--new-tokens`` (64) after a ``--prompt-len`` (64) prompt ``default_rng(1234).integers(0, vocab,
(batch, prompt_len))``, no EOS (every row makes all its tokens), ``--steps`` calls, the first
``--warmup`` untimed. Each call is timed from its own tokens (``on_token``; the peer: a streamer):
``prefill_s`` = call start → every row's first token (prefill + its choice), the decode = first →
last token, N − 1 steps. Not ``benchmarks/generate.py``'s generate(N) − generate(1): a hybrid
model's prefill compiles per (prompt, cache length) and generate(1) gets a shorter cache, so the
difference would mix two prefill graphs. Figures: ``decode_tokens_per_s`` = batch·(N − 1) / median
decode, ``ms_per_decode_step``, ``tokens_per_s`` = batch·N / median call (prefill included),
``gen_ms``; the first call (prefill and decode graphs compiled): ``first_call_s``, ``first_token_s``
(its prefill), ``compile_s`` (= first_call_s − median call), ``wall_to_first_token_s`` (script start →
the first call's first token); ``build_s``, ``peak_rss_mb``, ``first_new_ids`` (row 0's first 8).

    python benchmarks/qwen3_5.py [--train | --prefill] [--shape qwen3.5-0.8b] [--layers 4]
                                 [--batch 1 --seq 512] [--steps 5 --warmup 1] [--targets ...]
    python benchmarks/qwen3_5.py --decode [--layers 4] [--batch 1 | 8] [--prompt-len 64 --new-tokens 64]
                                 [--steps 5 --warmup 1]
    python benchmarks/qwen3_5.py --compare --peer /path/to/peer-venv/bin/python [--rounds 2]
                                 [--workloads train,prefill,decode] [--layers 4] [--batch 1 --seq 512]
                                 [--prompt-len 64 --new-tokens 64] [--log RUNS.jsonl]

``--compare`` runs this script and the peer (``benchmarks/peers/hf_qwen3_5.py``: HF transformers'
``Qwen3_5ForCausalLM`` + PEFT, eager attention, torch's fallback kernels for the delta rule) in fresh
processes, alternating which goes first each round; medians over the rounds, ratios mindqwen / peer
(tokens/s and decode tokens/s: > 1 is faster; peak RSS and wall to first step / token: < 1 is leaner
or sooner). The default ``--workloads`` is train,prefill: decode is asked for by name. Not part of CI.
"""
import json
import os
import statistics
import sys
import time

T_START = time.perf_counter()
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from decode_timing import decode_figures  # noqa: E402
from train import build, child_json, parser, shape_config  # noqa: E402  (no MindSpore imported yet)

PEER_SCRIPT = os.path.join(HERE, "peers", "hf_qwen3_5.py")
TARGETS = "q_proj,k_proj,v_proj,o_proj,in_proj_qkv,in_proj_z,out_proj"
FIGURES = ("tokens_per_s", "step_ms", "peak_rss_mb", "build_s", "first_step_s", "compile_s",
           "wall_to_first_step_s", "total_params", "decode_tokens_per_s", "ms_per_decode_step", "prefill_s",
           "gen_ms", "first_call_s", "first_token_s", "wall_to_first_token_s")
WORKLOADS = ("train", "prefill", "decode")
PEER_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
             "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "full_attention_interval",
             "max_position_embeddings", "rope_theta", "partial_rotary_factor", "rms_norm_eps")


def qwen3_5_shapes() -> list:
    from mindqwen.presets import PRESETS  # plain data, no MindSpore
    return [name for name, p in PRESETS.items() if p.get("model_type") == "qwen3_5"]


def arguments():
    ap = parser(__doc__.split("\n")[0])
    shape = ap._option_string_actions["--shape"]  # train.py's parser, Qwen3.5 shapes instead
    shape.choices = qwen3_5_shapes()
    ap.set_defaults(shape="qwen3.5-0.8b", batch=1, seq=512, steps=5, warmup=1, threads=2, targets=TARGETS)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--train", action="store_true", help="LoRA step (the default)")
    mode.add_argument("--prefill", action="store_true", help="forward over batch × seq tokens, no cache")
    mode.add_argument("--decode", action="store_true", help="greedy generate: prompt, then --new-tokens")
    mode.add_argument("--compare", action="store_true", help="both, against the peer, in fresh processes")
    ap.add_argument("--all-logits", action="store_true", help="prefill: logits of every position")
    ap.add_argument("--prompt-len", type=int, default=64, help="decode: prompt tokens per row")
    ap.add_argument("--new-tokens", type=int, default=64, help="decode: tokens generated per row (>= 2)")
    ap.add_argument("--peer", help="--compare: python of the peer's virtualenv (torch + transformers + peft)")
    ap.add_argument("--peer-script", default=PEER_SCRIPT)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workloads", default="train,prefill")
    ap.add_argument("--peer-first", action="store_true", help="--compare: the peer goes first in odd rounds")
    ap.add_argument("--log", help="--compare: append every run's JSON line to this file as it finishes")
    return ap.parse_args()


def train(args) -> dict:
    """The LoRA step of benchmarks/train.py, timed from its first (compiling) call."""
    args.compile_cache = None
    model, config, stepper, data = build(args)  # imports mindqwen, MindSpore; model, LoRA, Stepper, data
    import mindspore as ms
    times, losses = [], []
    for i in range(args.steps):
        ids = ms.Tensor(data[i])
        t = time.perf_counter()
        loss, _, _ = stepper([(ids, ids)])
        times.append(time.perf_counter() - t)
        losses.append(loss)
        if i == 0:
            wall = time.perf_counter() - T_START
    trainable = sum(p.size for p in model.trainable_params())
    return dict(model=model, config=config, times=times, wall=wall, trainable_params=trainable,
                loss_first=round(float(losses[0]), 4), loss_last=round(float(losses[-1]), 4))


def inference_model(args) -> tuple:
    """Import mindqwen (then MindSpore) and build the model for inference: no adapter, eval mode."""
    from mindqwen import QwenConfig, QwenForCausalLM, backend
    if not args.fusion:
        backend.disable_cpu_fusion()
    import mindspore as ms
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.device_context.cpu.op_tuning.threads_num(args.threads)
    ms.set_seed(0)
    config = QwenConfig(**shape_config(args.shape, args.layers))
    t = time.perf_counter()
    model = QwenForCausalLM(config)
    args.build_s = time.perf_counter() - t
    if args.compile_once != "auto":
        model.model.set_compile_once(args.compile_once == "on")
    model.set_train(False)
    return model, config


def prefill(args) -> dict:
    """A compiled forward over the prompt (no cache), last-position logits."""
    model, config = inference_model(args)
    import mindspore as ms
    import numpy as np
    from mindspore import nn

    class Prefill(nn.Cell):
        def __init__(self, lm, all_logits: bool):
            super().__init__()
            self.lm, self.all_logits = lm, all_logits

        def construct(self, input_ids):
            if self.all_logits:
                return self.lm(input_ids)
            return self.lm.last_logits(self.lm.model(input_ids))

    step = Prefill(model, args.all_logits)
    step.set_train(False)
    data = np.random.default_rng(1234).integers(0, config.vocab_size, (args.steps, args.batch, args.seq))
    times = []
    for i in range(args.steps):
        ids = ms.Tensor(data[i].astype(np.int32))
        t = time.perf_counter()
        logits = step(ids).asnumpy()
        times.append(time.perf_counter() - t)
        if i == 0:
            wall = time.perf_counter() - T_START
    return dict(model=model, config=config, times=times, wall=wall,
                logits_shape=list(logits.shape), logit_std=round(float(logits.std()), 4))


def decode(args) -> dict:
    """Greedy generate calls, each split into prefill and decode by its tokens' arrival times."""
    if args.new_tokens < 2 or args.steps <= args.warmup:
        sys.exit("--decode needs --new-tokens >= 2 and --steps > --warmup")
    model, config = inference_model(args)
    import numpy as np
    from mindqwen.generation import generate
    b, n = args.batch, args.new_tokens
    prompt = np.random.default_rng(1234).integers(0, config.vocab_size, (b, args.prompt_len)).astype(np.int32)
    calls = []  # (call, prefill, decode) seconds
    for i in range(args.steps):
        stamps = []  # one per (row, token): rows choose in order, so [b - 1] is the last row's first token
        t = time.perf_counter()
        ids = generate(model, prompt, max_new_tokens=n, on_token=lambda *_: stamps.append(time.perf_counter()))
        end = time.perf_counter()
        assert len(stamps) == b * n and ids.shape == (b, args.prompt_len + n), (len(stamps), ids.shape)
        calls.append((end - t, stamps[b - 1] - t, stamps[-1] - stamps[b - 1]))
        if i == 0:
            wall = stamps[b - 1] - T_START
    new_ids = ids[0, args.prompt_len:args.prompt_len + 8].tolist()
    return dict(model=model, config=config, **decode_figures(calls, b, n, args.warmup),
                wall_to_first_token_s=round(wall, 2), first_new_ids=new_ids)


def measure(args) -> None:
    kind = "prefill" if args.prefill else "decode" if args.decode else "train"
    got = {"train": train, "prefill": prefill, "decode": decode}[kind](args)
    import mindspore as ms
    from mindqwen import backend
    from mindqwen.train.metrics import peak_memory_mb
    model, config = got.pop("model"), got.pop("config")
    types = config.layer_types
    head = {
        "benchmark": f"qwen3_5_{kind}", "framework": "mindqwen (MindSpore %s, graph mode)" % ms.__version__,
        "fusion": backend.fusion_enabled(), "shape": args.shape, "layers": config.num_hidden_layers,
        "layer_types": {"linear": types.count("linear_attention"), "full": types.count("full_attention")},
        "targets": args.targets if kind == "train" else None,
        "compiled_once": sum(layer.compiled_once is not None for layer in model.model.layers),
        "batch": args.batch, "steps": args.steps, "warmup": args.warmup, "threads": args.threads}
    if kind == "decode":  # its figures come whole from decode()
        figures = {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    else:
        times, wall = got.pop("times"), got.pop("wall")
        step_s = statistics.median(times[args.warmup:])
        figures = {"seq": args.seq, "tokens_per_s": round(args.batch * args.seq / step_s, 1),
                   "step_ms": round(step_s * 1e3, 1), "step_ms_all": [round(t * 1e3) for t in times],
                   "first_step_s": round(times[0], 2), "compile_s": round(times[0] - step_s, 2),
                   "wall_to_first_step_s": round(wall, 2)}
    print(json.dumps({
        **head, **figures, "build_s": round(args.build_s, 2),
        "peak_rss_mb": round(peak_memory_mb()), "total_params": sum(p.size for p in model.get_parameters()),
        **got, "python": sys.version.split()[0], "pid": os.getpid()}))


def peer_flags(args) -> list:
    config = shape_config(args.shape, args.layers)
    flags = [f"--{k.replace('_', '-')}={config[k]}" for k in PEER_KEYS]
    return flags + ([] if config["tie_word_embeddings"] else ["--no-tie-word-embeddings"])


def compare(args) -> None:
    if not args.peer:
        sys.exit("--compare needs --peer PYTHON (a virtualenv with torch, transformers, peft)")
    common = ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
              "--warmup", str(args.warmup), "--threads", str(args.threads), "--targets", args.targets,
              "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
              *(["--all-logits"] if args.all_logits else [])]
    workloads = args.workloads.split(",")
    for workload in workloads:  # before any run: a typo should not cost a train round
        if workload not in WORKLOADS:
            sys.exit(f"unknown workload {workload!r}: one of {', '.join(WORKLOADS)}")
    out = {"benchmark": "qwen3_5_compare", "shape": args.shape, "layers": args.layers or None,
           "rounds": args.rounds, "batch": args.batch, "seq": args.seq, "steps": args.steps,
           "warmup": args.warmup, "targets": args.targets,
           **({"prompt_len": args.prompt_len, "new_tokens": args.new_tokens} if "decode" in workloads else {})}
    for workload in workloads:
        rate = "decode_tokens_per_s" if workload == "decode" else "tokens_per_s"
        first = "first_call_s" if workload == "decode" else "first_step_s"
        wall = "wall_to_first_token_s" if workload == "decode" else "wall_to_first_step_s"
        mine = [sys.executable, os.path.abspath(__file__), f"--{workload}", "--shape", args.shape,
                *(["--layers", str(args.layers)] if args.layers else []), "--compile-once", args.compile_once,
                *([] if args.fusion else ["--no-fusion"]), *common]
        cmds = {"mindqwen": mine, "peer": [args.peer, args.peer_script, f"--{workload}", *peer_flags(args), *common]}
        seen = {"mindqwen": [], "peer": []}
        for i in range(args.rounds):
            for who in (("mindqwen", "peer") if (i + args.peer_first) % 2 == 0 else ("peer", "mindqwen")):
                seen[who].append(child_json(cmds[who]))
                if args.log:
                    with open(args.log, "a") as f:
                        f.write(json.dumps({"workload": workload, "round": i + 1, "who": who, **seen[who][-1]}) + "\n")
                print(f"{workload} round {i + 1}/{args.rounds} {who}: {seen[who][-1][rate]} {rate}, "
                      f"{first} {seen[who][-1][first]} s, peak {seen[who][-1]['peak_rss_mb']} MB",
                      file=sys.stderr, flush=True)
        result = {who: {k: statistics.median(o[k] for o in outs) for k in FIGURES if all(k in o for o in outs)}
                  for who, outs in seen.items()}
        result["peer"]["kernels"] = seen["peer"][-1].get("kernels")
        result["runs"] = {who: [o[rate] for o in outs] for who, outs in seen.items()}
        m, p = result["mindqwen"], result["peer"]
        if workload == "decode":  # decode alone, then the whole call (prefill included)
            result["decode_tokens_per_s_ratio"] = round(m["decode_tokens_per_s"] / p["decode_tokens_per_s"], 3)
            result["prefill_s_ratio"] = round(m["prefill_s"] / p["prefill_s"], 3)
        result["tokens_per_s_ratio"] = round(m["tokens_per_s"] / p["tokens_per_s"], 3)
        result["peak_rss_ratio"] = round(m["peak_rss_mb"] / p["peak_rss_mb"], 3)
        result[wall[:-2] + "_ratio"] = round(m[wall] / p[wall], 3)
        result["same_params"] = m.get("total_params") == p.get("total_params")
        out[workload] = result
    print(json.dumps(out))


def main() -> None:
    args = arguments()
    if args.compare:
        compare(args)
    else:
        measure(args)


if __name__ == "__main__":
    main()
