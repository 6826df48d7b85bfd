"""fit(): the training loop, in run order — set-up, resume, steps (eval, save), finish."""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, replace
from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import nn
from tqdm import tqdm

from mindqwen.data.loader import BatchLoader, TokenDataset
from mindqwen.lora import save_adapter
from mindqwen.models.graph import in_mode
from mindqwen.models.qwen import QwenForCausalLM
from mindqwen.train import checkpoint
from mindqwen.train.compile_cache import compile_cache, graph_key
from mindqwen.train.config import TrainerConfig
from mindqwen.train.distributed import ParallelConfig, init_parallel, setup_model_parallel
from mindqwen.train.metrics import (MetricsLog, measure_matmul_peak_gflops, peak_memory_mb,
                                    plot_loss_curve, train_flops_per_token)
from mindqwen.train.optim import WarmupSchedule, make_optimizer
from mindqwen.train.precision import PrecisionConfig, apply_precision, make_loss_scaler
from mindqwen.train.recompute import apply_recompute
from mindqwen.train.step import CausalLMLoss, Stepper, reported_names


class TrainingDiverged(RuntimeError):
    """Training cannot go on: a NaN or inf the loss scaler cannot absorb (see ``divergence``)."""


def fit(model: nn.Cell, train_data: TokenDataset, config: TrainerConfig,
        eval_data: Optional[TokenDataset] = None, recipe_text: Optional[str] = None,
        parallel: Optional[ParallelConfig] = None, loss_net: Optional[nn.Cell] = None) -> dict:
    """Train ``model`` (its trainable parameters: LoRA or all) in graph mode.

    Writes ``metrics.jsonl``, checkpoints (``checkpoints/step_*``), ``loss_curve.png`` and, at
    the end, ``adapter/`` (PEFT format, LoRA) or ``model/`` (HF format, full fine-tune; a model
    without ``save_pretrained`` keeps its checkpoint) into ``config.output_dir``. Returns a
    summary (final loss, eval loss, steps, overflow count). The caller's execution mode (graph
    or PyNative) is restored on return.

    Args:
        loss_net: takes a batch (``TokenDataset.rows``) and returns the loss; default
            ``model(input_ids, None, labels)``, or for preference pairs (``train_data.pairs``)
            ``PreferenceLoss`` with its defaults (sigmoid DPO, β 0.1; the reference: the
            adapters off, or the data's ``reference_logps``). A multimodal model trains with its
            caption loss over (input_ids, labels, pixel_values).

    Raises:
        TrainingDiverged: see ``divergence`` (docs/training.md, "Divergence").
    """
    pipeline = parallel is not None and parallel.pipeline_parallel > 1
    model_config = getattr(model, "config", None)
    if getattr(model_config, "is_hybrid", False) and any(d is not None and d.position_ids is not None
                                                         for d in (train_data, eval_data)):
        raise ValueError(f"{model_config.model_type}: its linear-attention layers carry a state across a row, so "
                         "packed samples (position_ids) would see each other; train one sample per row or "
                         "without data.reset_positions")
    if train_data.pairs:
        from mindqwen.preference import PreferenceLoss, default_preference_loss
        loss_net = loss_net if loss_net is not None else default_preference_loss(model, train_data)
        if isinstance(loss_net, PreferenceLoss):  # refused now, not at the first step or evaluation
            loss_net.check_reference(train_data, eval_data)
    with in_mode(ms.GRAPH_MODE if config.mode == "graph" else ms.PYNATIVE_MODE):
        return _fit(model, train_data, config, eval_data, recipe_text, parallel,
                    loss_net or CausalLMLoss(model, report=not pipeline))


def _fit(model: nn.Cell, train_data: TokenDataset, config: TrainerConfig, eval_data: Optional[TokenDataset],
         recipe_text: Optional[str], parallel: Optional[ParallelConfig], loss_net: nn.Cell) -> dict:
    # 1. set-up: seed, ranks, precision, recompute, optimizer, step Cells (``fit`` set the mode)
    ms.set_seed(config.seed)
    parallel = parallel or ParallelConfig()
    rank, world = init_parallel(parallel)
    main = rank == 0
    if parallel.model_parallel:  # each rank holds, and saves, its slice of the model
        config = replace(config, output_dir=setup_model_parallel(model, parallel, config.output_dir, rank))
        main, rank, world = True, 0, 1  # every rank reads the whole global batch (full_batch)
    apply_precision(loss_net, config.precision)  # the model, and a reference model beside it
    apply_recompute(model, config.recompute, config.recompute_every)
    schedule = WarmupSchedule(config.schedule, config.lr, config.max_steps, config.warmup_steps, config.min_lr)
    optimizer = make_optimizer(model.trainable_params(), schedule, config.weight_decay,
                               (config.beta1, config.beta2), config.eps)
    scaler = make_loss_scaler(config.precision)
    dynamic = config.precision.uses_loss_scaling
    stepper = Stepper(model, optimizer, scaler, config.gradient_accumulation, config.clip_norm, dynamic, world,
                      parallel, loss_net)
    model.set_train(True)

    # 2. resume
    last_ckpt, state = checkpoint.resume(config.resume, config.output_dir, model, optimizer, scaler)
    state = state or {"overflow_count": 0, "seed": config.seed}
    start = state.get("step", 0)

    # 3. steps
    # Rows per micro-batch this process feeds: micro_batch_size is per device, and under model
    # parallel every rank feeds the whole global micro-batch, which the shard strategies split dp ways.
    mb = config.micro_batch_size * (parallel.data_parallel if parallel.model_parallel else 1)
    loader = BatchLoader(train_data, mb * config.gradient_accumulation, config.seed, config.shuffle, rank, world)
    log = MetricsLog(config.output_dir, start, enabled=main,
                     tensorboard=os.path.join(config.output_dir, "tensorboard") if config.tensorboard else None)
    tokens = mb * config.gradient_accumulation * train_data.tokens_per_example  # per rank and step
    step_flops, peak_flops = _flops(model, train_data, tokens)
    cache = _cache_folder(config, model, train_data, eval_data, world, parallel, loss_net)
    streak = updated = 0  # overflowed steps in a row; steps of this run that updated the model
    scale = float(scaler.scale_value.asnumpy())  # the scale the next step uses (each record has it after)
    with compile_cache(cache):
        record, bar = {}, tqdm(range(start, config.max_steps), initial=start, total=config.max_steps,
                               desc="training", unit="step", disable=not (config.progress and main))
        for step, batch in zip(bar, loader.stream(start, config.max_steps)):
            lr = schedule(optimizer.global_step).asnumpy().item()  # the rate this step uses
            loss, finite, norm, seconds = _timed_step(stepper, batch, mb, config)
            state["overflow_count"] += int(not finite)
            streak, updated = (0, updated + 1) if finite else (streak + 1, updated)
            last = step + 1 == config.max_steps
            record = {"step": step + 1, "loss": loss, "lr": lr,
                      "grad_norm": norm, "loss_scale": float(scaler.scale_value.asnumpy()),
                      "overflow": not finite, "overflow_count": state["overflow_count"],
                      "tokens_per_s": tokens * world / seconds, "step_s": seconds,
                      "mfu": step_flops / seconds / peak_flops if step_flops else None,
                      "peak_memory_mb": peak_memory_mb(), **stepper.reported}
            reason = divergence(loss, finite, norm, scale, streak, updated, last, config.precision, dynamic)
            scale = record["loss_scale"]
            if reason:
                log.write(record)
                raise _diverged(f"step {step + 1}: {reason}", last_ckpt)
            if eval_data is not None and _due(step + 1, config.eval_every, last):
                record["eval_loss"] = evaluate(loss_net, eval_data, mb, config.eval_batches)
                record["eval_ppl"] = math.exp(min(record["eval_loss"], 50.0))
            log.write(record)
            shown = {"acc": f"{record['rewards/accuracies']:.2f}"} if "rewards/accuracies" in record else {}
            bar.set_postfix(loss=f"{loss:.4f}", **shown, lr=f"{lr:.2e}", tok_s=f"{record['tokens_per_s']:.0f}")
            if main and _due(step + 1, config.save_every, last):
                state.update(step=step + 1, data_step=step + 1, metrics=record)
                try:
                    last_ckpt = checkpoint.save(config.output_dir, step + 1, model, optimizer, scaler, state,
                                                recipe_text, config.keep_last)
                except checkpoint.NonFiniteParameters as e:
                    raise _diverged(str(e), last_ckpt) from None

    # 4. finish: final weights in an interchange format, and the loss curve
    log.close()
    outputs = {"checkpoint": last_ckpt, **(_save_final(model, config.output_dir, log) if main else {})}
    return {"steps": config.max_steps, "final_loss": record.get("loss"), "eval_loss": record.get("eval_loss"),
            "overflow_count": state["overflow_count"], "outputs": outputs, "metrics": log.path}


def _timed_step(stepper: Stepper, batch: tuple, mb: int, config: TrainerConfig) -> tuple:
    """One optimizer step over ``batch`` cut into micro-batches of ``mb`` rows: (loss, finite,
    grad norm, seconds); running out of memory is explained in terms of the config."""
    batches = [tuple(ms.Tensor(a[i:i + mb]) for a in batch) for i in range(0, len(batch[0]), mb)]
    t = time.perf_counter()
    try:
        loss, finite, norm = stepper(batches)
    except RuntimeError as e:
        raise explain_out_of_memory(e, config) from e
    return loss, finite, norm, time.perf_counter() - t


def _due(step: int, every: int, last: bool) -> bool:
    """Whether an every-``every``-steps task (0: only at the end) runs after ``step``."""
    return last or bool(every and step % every == 0)


def _diverged(why: str, last_ckpt: Optional[str]) -> TrainingDiverged:
    return TrainingDiverged(f"{why}; last good checkpoint: {last_ckpt or 'none (nothing to resume from)'}")


def _flops(model: nn.Cell, train_data: TokenDataset, tokens: int) -> tuple:
    """(FLOPs of one step, the matmul peak FLOP/s measured here) for MFU; (None, None) for other
    networks than a causal LM (a fused multimodal model), whose matmuls MFU does not count."""
    if not isinstance(model, QwenForCausalLM):
        return None, None
    trainable = sum(p.size for p in model.trainable_params()) / sum(p.size for p in model.get_parameters())
    step_flops = train_flops_per_token(model.config, train_data.input_ids.shape[-1], trainable) * tokens
    return step_flops, measure_matmul_peak_gflops() * 1e9


def _cache_folder(config: TrainerConfig, model: nn.Cell, train_data: TokenDataset,
                  eval_data: Optional[TokenDataset], world: int, parallel: ParallelConfig,
                  loss_net: nn.Cell) -> Optional[str]:
    """The compile-cache folder of this run's graphs (one per distinct set, see compile_cache.py)."""
    if not config.compile_cache:
        return None
    shapes = {"train": _shapes(train_data), "world": world, "parallel": repr(parallel),
              "eval": None if eval_data is None else _shapes(eval_data), "loss": type(loss_net).__name__}
    return os.path.join(config.compile_cache, graph_key(model, asdict(config), shapes))


def _save_final(model: nn.Cell, output_dir: str, log: MetricsLog) -> dict:
    """The trained weights (``adapter/`` in PEFT format for LoRA, ``model/`` in HF format) and
    ``loss_curve.png``; returns their paths."""
    outputs = {}
    if getattr(model, "lora_config", None) is not None:
        outputs["adapter"] = os.path.join(output_dir, "adapter")
        save_adapter(model, outputs["adapter"])
    elif hasattr(model, "save_pretrained"):
        outputs["model"] = os.path.join(output_dir, "model")
        model.save_pretrained(outputs["model"])
    outputs["loss_curve"] = plot_loss_curve(log.read(), os.path.join(output_dir, "loss_curve.png"))
    return outputs


def divergence(loss: float, finite: bool, norm: float, scale: float, streak: int, updated: int, last: bool,
               precision: PrecisionConfig, dynamic: bool) -> Optional[str]:
    """Why the run must stop after this step, or None. The policy (docs/training.md):

    - without loss scaling (fp32, bf16), a NaN or inf loss or gradient: nothing can absorb it;
    - with fp16 loss scaling, an overflow at scale 1 (the floor: the gradients themselves
      overflow), or ``max_consecutive_overflows`` skipped steps in a row;
    - at the last step, a NaN or inf loss, or a run none of whose steps updated the model:
      ending there would report an untrained or non-finite result as a success.
    """
    if not dynamic and not (finite and math.isfinite(loss)):
        dtype = "fp32" if precision.level == "O0" else precision.dtype
        return (f"loss is {loss} (gradient norm {norm}) in {precision.level} ({dtype}), "
                "without loss scaling to absorb a NaN or inf")
    if not finite and scale <= 1.0:
        return f"gradients overflow at loss scale {scale:g}, the scaler's floor (loss {loss})"
    if streak >= precision.max_consecutive_overflows:
        return (f"{streak} consecutive steps overflowed and were skipped (trainer.precision."
                f"max_consecutive_overflows={precision.max_consecutive_overflows}); loss {loss}")
    if last and not math.isfinite(loss):
        return f"the last step's loss is {loss}"
    if last and updated == 0:
        return "no step of this run updated the model: every one overflowed and was skipped"
    return None


def evaluate(model: nn.Cell, data: TokenDataset, batch_size: int, max_batches: int = 0) -> float:
    """Mean validation loss over ``data`` (in order, no shuffle); ``model`` is a causal LM or a
    loss network (``fit``'s ``loss_net``)."""
    loss_net = CausalLMLoss(model) if isinstance(model, QwenForCausalLM) else model
    loader = BatchLoader(data, batch_size, shuffle=False)
    n = loader.steps_per_epoch if max_batches <= 0 else min(max_batches, loader.steps_per_epoch)
    loss_net.set_train(False)
    reports = bool(reported_names(loss_net))
    prepare = getattr(loss_net, "prepare", lambda batch: batch)  # inputs the loss adds (see Stepper)
    losses = [float((out[0] if reports else out).asnumpy())
              for out in (loss_net(*prepare(tuple(map(ms.Tensor, batch)))) for batch in loader.iterate(0, n))]
    loss_net.set_train(True)
    return float(np.mean(losses))


def _shapes(data: TokenDataset) -> list:
    return [list(a.shape[1:]) for a in data.rows(np.arange(1))]


def explain_out_of_memory(error: RuntimeError, config: TrainerConfig) -> RuntimeError:
    """Turn an allocation failure into the knobs that shrink memory; other errors pass through."""
    text = str(error).lower()
    if "memory" not in text or not any(k in text for k in ("malloc", "not enough", "isn't enough", "out of")):
        return error
    mb = config.micro_batch_size
    return MemoryError(
        "out of memory during the training step. Activations scale with micro_batch_size × seq_len:\n"
        f"  trainer.micro_batch_size={max(mb // 2, 1)} with trainer.gradient_accumulation="
        f"{config.gradient_accumulation * 2 if mb > 1 else config.gradient_accumulation} "
        "(same global batch): ~½ the activation memory\n"
        "  trainer.recompute=full: keeps one layer's activations instead of all layers' (~1/num_layers)\n"
        "  trainer.precision.level=O2 (Ascend: bf16/fp16): ~½ activations and gradients\n"
        "  LoRA instead of full fine-tuning: no gradients or AdamW moments for frozen weights (~3× weights less)")
