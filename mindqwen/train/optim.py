"""AdamW with parameter groups, and learning-rate schedules as functions of the step Tensor.

The schedule is evaluated inside the compiled step from the optimizer's ``global_step``
Parameter, which is checkpointed, so a resumed run continues the schedule exactly.
"""
from __future__ import annotations

import math
from typing import List

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn, ops

SCHEDULES = ("constant", "linear", "cosine", "wsd")


class WarmupSchedule(nn.learning_rate_schedule.LearningRateSchedule):
    """lr(step): linear warm-up from 0 over ``warmup_steps``, then ``kind``:

    - constant: ``lr``;
    - linear:   ``lr`` → ``min_lr`` linearly at ``total_steps``;
    - cosine:   ``min_lr + (lr − min_lr)·(1 + cos(π·t))/2``, t the post-warm-up progress;
    - wsd:      warm-up, stable at ``lr``, then linear decay to ``min_lr`` over the last
                ``decay_fraction`` of the steps (warmup-stable-decay).
    """

    def __init__(self, kind: str, lr: float, total_steps: int, warmup_steps: int = 0,
                 min_lr: float = 0.0, decay_fraction: float = 0.1):
        super().__init__()
        if kind not in SCHEDULES:
            raise ValueError(f"trainer.schedule must be one of {', '.join(SCHEDULES)}, got {kind!r}")
        if total_steps < 1 or not 0 <= warmup_steps <= total_steps:
            raise ValueError(f"schedule needs 0 <= warmup_steps ({warmup_steps}) <= total_steps ({total_steps})")
        self.kind, self.lr, self.min_lr = kind, float(lr), float(min_lr)
        self.total, self.warmup = float(total_steps), float(warmup_steps)
        self.decay_start = float(max(warmup_steps, total_steps - int(round(decay_fraction * total_steps))))

    def construct(self, global_step):
        step = global_step.astype(ms.float32)
        warm = ops.minimum(step / max(self.warmup, 1.0), 1.0) if self.warmup > 0 else ops.ones((), ms.float32)
        if self.kind == "constant":
            return self.lr * warm
        if self.kind == "wsd":
            start, span = self.decay_start, max(self.total - self.decay_start, 1.0)
        else:
            start, span = self.warmup, max(self.total - self.warmup, 1.0)
        t = ops.clip_by_value((step - start) / span, 0.0, 1.0)
        if self.kind == "cosine":
            decayed = self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + ops.cos(math.pi * t))
        else:  # linear and the decay phase of wsd
            decayed = self.lr + (self.min_lr - self.lr) * t
        return ops.select(step < self.warmup, self.lr * warm, decayed)


def param_groups(params: List[Parameter], weight_decay: float) -> list:
    """Weight decay on matrices only: norms, biases and 1-D vectors (DoRA magnitudes) get none."""
    decay = [p for p in params if len(p.shape) >= 2]
    no_decay = [p for p in params if len(p.shape) < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def make_optimizer(params: List[Parameter], schedule: WarmupSchedule, weight_decay: float = 0.0,
                   betas=(0.9, 0.999), eps: float = 1e-8) -> nn.Optimizer:
    """``nn.AdamWeightDecay`` (decoupled weight decay, as torch AdamW) over ``params``."""
    if not params:
        raise ValueError("no trainable parameters: apply LoRA or unfreeze the model first")
    return nn.AdamWeightDecay(param_groups(params, weight_decay), learning_rate=schedule,
                              beta1=betas[0], beta2=betas[1], eps=eps)


def schedule_values(schedule: WarmupSchedule, steps: int) -> np.ndarray:
    """The schedule evaluated at steps 0..steps-1 (host-side, for plots and tests)."""
    return np.array([float(schedule(ms.Tensor(s, ms.int32)).asnumpy()) for s in range(steps)])
