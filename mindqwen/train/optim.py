"""AdamW as torch defines it, with parameter groups, and learning-rate schedules as functions of the step Tensor.

The schedule is evaluated inside the compiled step from the optimizer's ``global_step``
Parameter, which is checkpointed, so a resumed run continues the schedule exactly.
"""
from __future__ import annotations

import math
import re
from typing import List

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn, ops

_hyper_map = ops.HyperMap()

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


# Names that take no weight decay: biases and every norm's weight (``input_layernorm``,
# ``q_norm``, ``model.norm``), as the common trainers group them. Everything else decays,
# embeddings and a DoRA magnitude vector included.
NO_DECAY_PATTERNS = tuple(re.compile(p) for p in (
    r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"))


def decays(name: str) -> bool:
    """Whether the parameter called ``name`` takes weight decay."""
    return not any(p.search(name.lower()) for p in NO_DECAY_PATTERNS)


def param_groups(params: List[Parameter], weight_decay: float) -> list:
    """Two groups: ``weight_decay`` on the parameters that ``decays``, none on the rest."""
    decay = [p for p in params if decays(p.name)]
    no_decay = [p for p in params if not decays(p.name)]
    groups = [{"params": decay, "weight_decay": weight_decay}] if decay else []
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


class AdamW(nn.Optimizer):
    """Adam with decoupled weight decay, step for step the update of ``torch.optim.AdamW``.

    At step t = 1, 2, … (the optimizer's ``global_step`` + 1), for each parameter p with
    gradient g, learning rate lr (the schedule at ``global_step``) and weight decay λ::

        p ← p · (1 − lr·λ)
        m ← m + (1 − β1)·(g − m)
        v ← β2·v + (1 − β2)·g²
        p ← p − lr / (1 − β1ᵗ) · m / (√v / √(1 − β2ᵗ) + ε)

    in fp32. It runs as the framework's fused ``AdamWeightDecay`` kernel (one kernel per
    parameter: 3× faster than the same update written element-wise on the CPU, and compiled in ~1 s
    instead of ~25 s for a full fine-tune), which has no bias correction: the step folds it into
    the kernel's rate, ε and decay, each a scalar per step::

        lr_k = lr·√c2 / c1      ε_k = ε·√c2      λ_k = λ·c1 / √c2

    so that lr_k · m / (√v + ε_k) + lr_k·λ_k·p is the update above. c1, c2 are the bias
    corrections 1 − βᵗ, computed in float64 where the device has it (CPU; in fp32, 1 − 0.999ᵗ loses
    ~2e-5 of its value), each times the factor by which the kernel's moment differs from the one
    above: it weighs g by 1 − β formed from the fp32-rounded β (1 − 0.999 in fp32 is 1.3e-5 short
    of 0.001), so its v is that much smaller throughout. The moments (``adam_m.*``,
    ``adam_v.*``) and ``global_step`` are Parameters: a checkpoint holds the whole optimizer state
    and a resumed run continues bit for bit.

    Args:
        params: Parameters, or groups (dicts with ``params`` and ``weight_decay``; see ``param_groups``).
        learning_rate: a float or a schedule of the step (``WarmupSchedule``).
        betas: (β1, β2).
        eps: ε, added to the bias-corrected √v.
        weight_decay: λ of the parameters not in a group.
    """

    def __init__(self, params, learning_rate, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(learning_rate, params, weight_decay)
        if self.is_group_lr:
            raise ValueError("AdamW takes one learning rate (schedule) for every group")
        beta1, beta2 = (np.float32(b) for b in betas)
        self.beta1, self.beta2 = ms.Tensor(beta1), ms.Tensor(beta2)
        self.eps = float(eps)
        # The kernel's moments over the update's: it weighs g by 1 − β32 (β32 = fp32(β)), the
        # update by fp32(1 − β); worked out in float64.
        self.moment_factors = tuple(float((1.0 - np.float64(np.float32(b))) / np.float64(np.float32(1.0 - b)))
                                    for b in (float(betas[0]), float(betas[1])))
        self.powers = (float(betas[0]), float(betas[1]))  # β of the bias corrections, unrounded
        self.moments1 = self._parameters.clone(prefix="adam_m", init="zeros")
        self.moments2 = self._parameters.clone(prefix="adam_v", init="zeros")
        decay = self.weight_decay if self.is_group else (self.weight_decay,) * len(self._parameters)
        self.runs = _runs(tuple(float(d) for d in decay))  # (start, stop, λ) of equal λ, as constants
        self.fused = ops.AdamWeightDecay()
        self.float64 = ms.get_context("device_target") != "Ascend"

    def construct(self, gradients):
        lr = self.get_lr()  # the schedule at the step before this one is counted
        self.assignadd(self.global_step, self.global_step_increase_tensor)
        c1 = self._correction(self.powers[0], self.moment_factors[0])
        c2_sqrt = ops.sqrt(self._correction(self.powers[1], self.moment_factors[1]))
        lr_k = lr * c2_sqrt / c1
        eps_k = self.eps * c2_sqrt
        decay_factor = c1 / c2_sqrt  # λ_k = λ · decay_factor
        done = True
        for start, stop, decay in self.runs:  # one λ_k per run of parameters (a group), not per parameter
            update = ops.partial(_fused_adamw, self.fused, lr_k, self.beta1, self.beta2, eps_k, decay_factor * decay)
            done = ops.depend(done, _hyper_map(update, self._parameters[start:stop], self.moments1[start:stop],
                                               self.moments2[start:stop], gradients[start:stop]))
        return done

    def _correction(self, beta: float, factor: float):
        """(1 − βᵗ) · factor, t = ``global_step`` (already counted), as an fp32 scalar."""
        dtype = ms.float64 if self.float64 else ms.float32
        t = self.global_step.reshape(()).astype(dtype)
        return ((1.0 - ops.pow(ms.Tensor(beta, dtype), t)) * factor).astype(ms.float32)


def _fused_adamw(kernel, lr, beta1, beta2, eps, decay, param, m, v, grad):
    """One parameter's update by the fused kernel (see ``AdamW``)."""
    return kernel(param, m, v, lr, beta1, beta2, eps, decay, grad.astype(param.dtype))


def _runs(decays: tuple) -> tuple:
    """(start, stop, λ) of each run of equal weight decays in parameter order."""
    runs, start = [], 0
    for i in range(1, len(decays) + 1):
        if i == len(decays) or decays[i] != decays[start]:
            runs.append((start, i, decays[start]))
            start = i
    return tuple(runs)


def make_optimizer(params: List[Parameter], schedule: WarmupSchedule, weight_decay: float = 0.0,
                   betas=(0.9, 0.999), eps: float = 1e-8) -> AdamW:
    """``AdamW`` over ``params``, weight decay grouped by ``param_groups``."""
    if not params:
        raise ValueError("no trainable parameters: apply LoRA or unfreeze the model first")
    return AdamW(param_groups(params, weight_decay), schedule, betas, eps)


def schedule_values(schedule: WarmupSchedule, steps: int) -> np.ndarray:
    """The schedule evaluated at steps 0..steps-1 (host-side, for plots and tests)."""
    return np.array([float(schedule(ms.Tensor(s, ms.int32)).asnumpy()) for s in range(steps)])
