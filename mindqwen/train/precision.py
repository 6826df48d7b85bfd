"""Mixed precision: mindqwen's own policy (levels O0–O3) and dynamic loss scaling.

MindSpore's ``auto_mixed_precision`` O1 rewrite and ``TrainOneStepWithLossScaleCell`` fail on
CPU, so the policy is applied directly to the model's cells:

| level | matmuls | residual stream | parameters | softmax, norms, rotary, loss |
|-------|---------|-----------------|------------|------------------------------|
| O0    | fp32    | fp32            | fp32       | fp32                         |
| O1    | low     | fp32            | fp32       | fp32                         |
| O2    | low     | low             | fp32 master| fp32                         |
| O3    | low     | low             | low        | fp32                         |

"low" is fp16 or bf16. Attention softmax stays fp32 at every level (fp16 softmax overflows on
Qwen). fp16 gets dynamic loss scaling; bf16 has fp32's range and needs none.
"""
from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
from mindspore import nn

from mindqwen.models.graph import configure

LEVELS = ("O0", "O1", "O2", "O3")
LOW_DTYPES = {"float16": ms.float16, "bfloat16": ms.bfloat16}


@dataclass
class PrecisionConfig:
    """Attributes:
        level: O0 | O1 | O2 | O3 (see the module docstring).
        dtype: the low-precision dtype: float16 | bfloat16.
        loss_scale: initial dynamic loss scale (fp16 only).
        scale_window: steps without overflow before the scale grows by ``scale_factor``.
        scale_factor: growth and back-off factor of the scale.
        max_consecutive_overflows: this many overflowed (skipped) steps in a row stop the run
            with ``TrainingDiverged``, as does an overflow at scale 1, the scaler's floor (from
            the default 2^16 the floor comes first, after 16 halvings).
    """

    level: str = "O0"
    dtype: str = "float16"
    loss_scale: float = 2.0 ** 16
    scale_window: int = 1000
    scale_factor: float = 2.0
    max_consecutive_overflows: int = 20

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"precision.level must be one of {', '.join(LEVELS)}, got {self.level!r}")
        if self.dtype not in LOW_DTYPES:
            raise ValueError(f"precision.dtype must be one of {', '.join(LOW_DTYPES)}, got {self.dtype!r}")
        if self.loss_scale <= 0 or self.scale_factor <= 1 or self.scale_window < 1:
            raise ValueError("precision: loss_scale must be > 0, scale_factor > 1, scale_window >= 1")
        if self.max_consecutive_overflows < 1:
            raise ValueError("precision: max_consecutive_overflows must be >= 1")

    @property
    def uses_loss_scaling(self) -> bool:
        return self.level != "O0" and self.dtype == "float16"


def check_device_support(config: PrecisionConfig, device_target: str) -> None:
    """bf16 has no compute kernels on MindSpore's CPU backend: refuse before compiling."""
    if config.level != "O0" and config.dtype == "bfloat16" and device_target == "CPU":
        raise ValueError(f"precision {config.level} with bfloat16 cannot run on CPU (MindSpore has no "
                         "bf16 CPU kernels): use dtype float16, level O0, or an Ascend device")


def apply_precision(model: nn.Cell, config: PrecisionConfig) -> None:
    """Run ``model``'s matmuls (and, O2/O3, its residual stream) in ``config``'s dtype; O3 also
    casts the fp32 parameters."""
    check_device_support(config, ms.get_context("device_target"))
    low = config.dtype if config.level != "O0" else None
    configure(model, compute_dtype=low, hidden_dtype=low if config.level in ("O2", "O3") else None)
    if config.level == "O3":
        for p in model.get_parameters():
            if p.dtype == ms.float32:
                p.set_data(p.astype(LOW_DTYPES[low]))


def make_loss_scaler(config: PrecisionConfig) -> ms.amp.DynamicLossScaler:
    """The dynamic scaler for fp16, or a fixed scale of 1 (its state is still checkpointed)."""
    scale = config.loss_scale if config.uses_loss_scaling else 1.0
    return ms.amp.DynamicLossScaler(scale_value=scale, scale_factor=int(config.scale_factor),
                                    scale_window=config.scale_window)
