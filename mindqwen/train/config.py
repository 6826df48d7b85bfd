"""TrainerConfig: every knob of ``fit()`` (plain data; recipes fill it from YAML)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mindqwen.train.optim import SCHEDULES
from mindqwen.train.precision import PrecisionConfig

RECOMPUTE_MODES = ("none", "full", "attention", "mlp")


@dataclass
class TrainerConfig:
    """Attributes:
        max_steps: optimizer steps to run.
        micro_batch_size: examples per micro-batch on each rank.
        gradient_accumulation: micro-batches per optimizer step.
        lr, schedule, warmup_steps, min_lr: learning rate and its schedule
            (constant | linear | cosine | wsd, linear warm-up from 0).
        weight_decay, beta1, beta2, eps: AdamW (no decay on norms, biases, 1-D vectors).
        clip_norm: global gradient-norm clip; 0 disables.
        precision: O0–O3 and loss scaling (``PrecisionConfig``).
        recompute: activation recompute: none | full (whole decoder layers) | attention | mlp.
        recompute_every: with recompute, only every k-th layer (1 = all).
        eval_every: validation every N steps (0: only at the end, if eval data is given).
        eval_batches: batches per validation (0: the whole validation set).
        save_every: checkpoint every N steps (0: only at the end).
        keep_last: complete checkpoints kept (older ones are deleted).
        resume: None, "auto" (the latest checkpoint in ``output_dir``) or a checkpoint path.
        seed: model-init, dropout and shuffle seed.
        shuffle: reshuffle the training set every epoch.
        output_dir: where checkpoints, metrics.jsonl, the loss curve and the adapter go.
        progress: show a tqdm progress bar.
        tensorboard: also write metrics as TensorBoard scalars to ``output_dir/tensorboard``
            (needs ``pip install tensorboardX``).
        mode: graph (compiled, the default) | pynative (eager, for debugging).
        compile_cache: a folder for MindSpore's compile cache (None: off). A later run with the
            same model, settings and shapes loads its graphs instead of compiling them; each
            distinct set of graphs gets its own subfolder.
    """

    max_steps: int = 100
    micro_batch_size: int = 4
    gradient_accumulation: int = 1
    lr: float = 2e-4
    schedule: str = "cosine"
    warmup_steps: int = 0
    min_lr: float = 0.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    clip_norm: float = 1.0
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    recompute: str = "none"
    recompute_every: int = 1
    eval_every: int = 0
    eval_batches: int = 0
    save_every: int = 0
    keep_last: int = 3
    resume: Optional[str] = None
    seed: int = 0
    shuffle: bool = True
    output_dir: str = "outputs/run"
    progress: bool = True
    tensorboard: bool = False
    mode: str = "graph"
    compile_cache: Optional[str] = None

    def __post_init__(self) -> None:
        if isinstance(self.precision, dict):
            self.precision = PrecisionConfig(**self.precision)
        for name in ("max_steps", "micro_batch_size", "gradient_accumulation", "recompute_every", "keep_last"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"trainer.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"trainer.recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {self.recompute!r}")
        if not 0 <= self.warmup_steps <= self.max_steps:
            raise ValueError(f"trainer.warmup_steps={self.warmup_steps} must be in [0, max_steps={self.max_steps}]")
        if self.mode not in ("graph", "pynative"):
            raise ValueError(f"trainer.mode must be graph or pynative, got {self.mode!r}")
        if self.lr <= 0 or self.clip_norm < 0 or self.weight_decay < 0:
            raise ValueError("trainer: lr must be > 0, clip_norm and weight_decay >= 0")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"trainer.min_lr={self.min_lr} must be in [0, lr={self.lr}]")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and self.eps > 0):
            raise ValueError("trainer: beta1 and beta2 must be in [0, 1), eps > 0")
        for name in ("eval_every", "eval_batches", "save_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"trainer.{name} must be >= 0 (0: off), got {getattr(self, name)}")
        if not 0 <= self.seed < 2 ** 32:
            raise ValueError(f"trainer.seed must be in [0, 2^32), got {self.seed}")
