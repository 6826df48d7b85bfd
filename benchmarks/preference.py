"""Preference tuning against SFT on the same tokens, and against TRL + PEFT: one JSON line.

A DPO step (sigmoid, β 0.1, LoRA r 8 / alpha 32 on q_proj, v_proj; the reference: the adapters off,
``reference_view``) on ``--pairs`` pairs of a ``--prompt-len`` prompt and two ``--response-len``
responses, against an SFT step (``CausalLMLoss``) on the same rows as plain token rows (2·pairs ×
(prompt + response), labels = the ids), each in its own process so that each has its own peak RSS;
the modes alternate for ``--rounds`` rounds, and with ``--peer`` TRL's DPOTrainer
(``benchmarks/peers/trl_dpo.py`` in that interpreter) runs beside them in the same rotation. Random
init (seed 0), fp32, data ``default_rng(1234)`` as the peer draws it.

    python benchmarks/preference.py [--shape qwen2.5-0.5b] [--rounds 2] [--steps 8]
                                    [--peer /work/trl/bin/python]
    python benchmarks/preference.py --child dpo|sft ...    # one measurement (what the driver runs)
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(args: argparse.Namespace) -> dict:
    """One process, one mode: build, compile, time ``--steps`` steps."""
    import mindqwen  # noqa: F401  before MindSpore
    import mindspore as ms
    import numpy as np
    from mindqwen import LoraConfig, QwenConfig, QwenForCausalLM, apply_lora
    from mindqwen.preference import PreferenceConfig, PreferenceLoss, reference_view
    from mindqwen.train.metrics import peak_memory_mb
    from mindqwen.train.optim import WarmupSchedule, make_optimizer
    from mindqwen.train.precision import PrecisionConfig, make_loss_scaler
    from mindqwen.train.step import Stepper
    sys.path.insert(0, HERE)
    from train import shape_config
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)
    config = QwenConfig(**shape_config(args.shape))
    model = apply_lora(QwenForCausalLM(config), LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"]))
    model.set_train(True)
    rss_built = peak_memory_mb()
    loss_net = PreferenceLoss(model, PreferenceConfig(), reference_view(model)) if args.child == "dpo" else None
    optimizer = make_optimizer(model.trainable_params(), WarmupSchedule("constant", 1e-4, args.steps))
    stepper = Stepper(model, optimizer, make_loss_scaler(PrecisionConfig()), clip_norm=0.0, loss_net=loss_net)
    rng = np.random.default_rng(1234)
    p, r = args.prompt_len, args.response_len
    times, losses = [], []
    for _ in range(args.steps):
        prompt = rng.integers(0, config.vocab_size, (args.pairs, 1, p))
        responses = rng.integers(0, config.vocab_size, (args.pairs, 2, r))
        ids = np.concatenate([np.repeat(prompt, 2, 1), responses], -1).astype(np.int32)  # (pairs, 2, p + r)
        if args.child == "dpo":
            labels = ids.copy()
            labels[:, :, :p] = -100
            batch = (ms.Tensor(ids), ms.Tensor(labels))
        else:  # the same 2·pairs rows as plain rows
            rows = ms.Tensor(ids.reshape(-1, p + r))
            batch = (rows, rows)
        t = time.perf_counter()
        loss, _, _ = stepper([batch])
        times.append(time.perf_counter() - t)
        losses.append(loss)
    step_s = statistics.median(times[args.warmup:])
    return {"mode": args.child, "step_ms": round(step_s * 1e3, 1), "pairs_per_s": round(args.pairs / step_s, 3),
            "first_step_s": round(times[0], 1), "peak_rss_mb": round(peak_memory_mb()),
            "rss_after_build_mb": round(rss_built), "loss_first": round(losses[0], 5), "loss_last": round(losses[-1], 5),
            **stepper.reported}



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--peer", help="a Python with TRL + PEFT (benchmarks/peers/trl_dpo.py runs in it)")
    ap.add_argument("--child", choices=["dpo", "sft"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    from train import child_json
    common = ["--shape", args.shape, "--pairs", str(args.pairs), "--prompt-len", str(args.prompt_len),
              "--response-len", str(args.response_len), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    runs = {"sft": [], "dpo": [], "trl": []}
    for _ in range(args.rounds):  # alternated, so that a slow stretch of the machine hits every mode
        for mode in ("sft", "dpo"):
            runs[mode].append(child_json([sys.executable, __file__, "--child", mode, *common]))
        if args.peer:
            runs["trl"].append(child_json([args.peer, os.path.join(HERE, "peers", "trl_dpo.py"), *common]))
    best = {mode: min(r, key=lambda x: x["step_ms"]) for mode, r in runs.items() if r}
    out = {"benchmark": "preference", "shape": args.shape, "pairs": args.pairs, "prompt_len": args.prompt_len,
           "response_len": args.response_len, "steps": args.steps, "rounds": args.rounds, "runs": runs,
           "dpo_vs_sft_step": round(best["dpo"]["step_ms"] / best["sft"]["step_ms"], 3),
           "dpo_vs_sft_peak_rss": round(best["dpo"]["peak_rss_mb"] / best["sft"]["peak_rss_mb"], 3)}
    if args.peer:
        out["pairs_per_s_vs_trl"] = round(best["dpo"]["pairs_per_s"] / best["trl"]["pairs_per_s"], 3)
        out["peak_rss_vs_trl"] = round(best["dpo"]["peak_rss_mb"] / best["trl"]["peak_rss_mb"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
