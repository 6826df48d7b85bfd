"""Training metrics: metrics.jsonl per step, a progress bar, throughput, MFU, the loss-curve PNG."""
from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import List, Optional

import mindspore as ms
import numpy as np
from mindspore import ops

from mindqwen.config import QwenConfig
from mindqwen.io.atomic import atomic_file
from mindqwen.io.textfile import iter_lines


def peak_memory_mb() -> float:
    """Peak resident memory of this process (VmHWM), in MB."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train_flops_per_token(config: QwenConfig, seq_len: int, trainable_fraction: float) -> float:
    """Matmul FLOPs of one training token: forward 2·N, backward 2·N for activation gradients
    plus 2·N·(trainable fraction) for weight gradients, and attention's score/value products."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    n = config.num_hidden_layers * per_layer + config.vocab_size * h
    attention = config.num_hidden_layers * 2 * 2 * seq_len * q  # QKᵀ and PV, forward
    return (4 + 2 * trainable_fraction) * n + 3 * attention


@ms.jit
def _matmul(a, b):
    return ops.matmul(a, b)


@functools.lru_cache(maxsize=None)
def measure_matmul_peak_gflops(sizes=(1024, 2048), repeats: int = 8) -> float:
    """Best fp32 matmul rate of this machine through MindSpore (the MFU denominator), measured
    once per process.

    Compiled (``ms.jit``) square matmuls; the best of several sizes and repeats, because a
    shared 2-core machine only shows its ceiling between disturbances.
    """
    matmul = _matmul
    best = 0.0
    for n in sizes:
        a = ms.Tensor(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32))
        matmul(a, a).asnumpy()
        for _ in range(repeats):
            t = time.perf_counter()
            matmul(a, a).asnumpy()
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t) / 1e9)
    return best


class MetricsLog:
    """Appends one JSON object per step to ``metrics.jsonl`` (rank 0 only); with ``tensorboard``
    (a folder) also every numeric metric as a TensorBoard scalar."""

    def __init__(self, output_dir: str, resume_step: int = 0, enabled: bool = True,
                 tensorboard: Optional[str] = None):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.enabled = enabled
        self.tensorboard = None
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            self._truncate_after(resume_step)
            if tensorboard:
                self.open_tensorboard(tensorboard)

    def _truncate_after(self, step: int) -> None:
        """A resumed run rewrites the steps the killed run logged past its checkpoint."""
        kept = [json.dumps(r) + "\n" for r in self.read() if r.get("step", 0) <= step] if step > 0 else []
        if kept or os.path.exists(self.path):
            with atomic_file(self.path) as tmp, open(tmp, "w", encoding="utf-8") as f:
                f.writelines(kept)

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            if self.tensorboard is not None:
                for key, value in record.items():
                    if key != "step" and isinstance(value, (int, float)):
                        self.tensorboard.add_scalar(f"train/{key}", float(value), record["step"])
                self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()  # its writer thread may still hold the last events

    def open_tensorboard(self, log_dir: str) -> None:
        """Also write every numeric metric as a TensorBoard scalar (needs ``tensorboardX``)."""
        if not self.enabled:
            return
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ImportError("trainer.tensorboard=true needs the tensorboardX package: "
                              "pip install tensorboardX") from None
        self.tensorboard = SummaryWriter(log_dir)

    def read(self) -> List[dict]:
        """The records; a line that does not parse (the torn last line of a killed run) is
        dropped with a warning naming it."""
        if not os.path.exists(self.path):
            return []
        records = []
        for n, line, error in iter_lines(self.path):
            if error is None and not line.strip():
                continue
            record = None
            try:
                record = json.loads(line) if error is None else None
            except json.JSONDecodeError as e:
                error = str(e)
            if not isinstance(record, dict):
                print(f"{self.path}:{n}: dropping an unreadable metrics line ({error or 'not an object'})",
                      file=sys.stderr)
                continue
            records.append(record)
        return records


def plot_loss_curve(records: List[dict], path: str) -> Optional[str]:
    """Write the training (and validation) loss curve as a PNG, with the reward accuracy of
    preference tuning; None if matplotlib is absent."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    accuracy = [(r["step"], r["rewards/accuracies"]) for r in records if "rewards/accuracies" in r]
    if accuracy:  # preference tuning: the share of pairs whose chosen reward is the larger, on its own axis
        twin = ax.twinx()
        twin.plot(*zip(*accuracy), color="tab:green", alpha=0.6, label="rewards/accuracies")
        twin.set_ylim(0, 1.05)
        twin.set_ylabel("reward accuracy")
        twin.legend(loc="upper right")
    with atomic_file(path, ".png") as tmp:  # matplotlib picks the format by the suffix
        fig.savefig(tmp, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
