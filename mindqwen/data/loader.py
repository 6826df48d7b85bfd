"""Fixed-shape batches from token arrays: seeded shuffle, rank sharding, exact resume.

The order is a pure function of (seed, epoch, rank): epoch e shuffles with
``default_rng([seed, e]).permutation``, each rank takes every ``world``-th example of that order,
and consecutive groups of ``batch_size`` form batches (a ragged tail is dropped, so every batch
has the same shape and graph mode compiles once). Resuming at step k is index arithmetic —
nothing is read and thrown away.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import numpy as np


@dataclass
class TokenDataset:
    """Token rows of one length. ``labels`` default to ``input_ids`` (the model shifts them).

    A batch is the tuple (input_ids, labels) or, with ``position_ids`` (packed rows that keep
    their samples apart), (input_ids, labels, position_ids); with ``pixel_values`` (image-text
    rows for a multimodal model), (input_ids, labels, pixel_values): the order the loss network
    takes them. Preference pairs hold two rows per example, (N, 2, S): the chosen, then the
    rejected; with ``reference_logps`` a batch is (input_ids, labels, reference_logps).
    """

    input_ids: np.ndarray  # (N, S) int, or (N, 2, S) for preference pairs
    labels: Optional[np.ndarray] = None  # as input_ids, -100 = no loss
    pixel_values: Optional[np.ndarray] = None  # (N, 3, H, W) or (N, T, 3, H, W) float32
    reference_logps: Optional[np.ndarray] = None  # (N, 2) float32: a pair's reference log-probs
    # (N, S) int: each token's position in its sample, 0 where a sample starts (``sample_positions``)
    position_ids: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        self.input_ids = np.asarray(self.input_ids)
        if self.input_ids.ndim not in (2, 3) or not np.issubdtype(self.input_ids.dtype, np.integer) or (
                self.input_ids.ndim == 3 and self.input_ids.shape[1] != 2):
            raise ValueError(f"input_ids must be an integer array [examples, seq_len] (or [pairs, 2, seq_len]), "
                             f"got {self.input_ids.dtype} {self.input_ids.shape}")
        if self.labels is None:
            self.labels = self.input_ids
        self.labels = np.asarray(self.labels)
        if self.labels.shape != self.input_ids.shape:
            raise ValueError(f"labels shape {self.labels.shape} != input_ids shape {self.input_ids.shape}")
        if self.position_ids is not None and np.shape(self.position_ids) != self.input_ids.shape:
            raise ValueError(f"position_ids shape {np.shape(self.position_ids)} != input_ids shape "
                             f"{self.input_ids.shape}")
        if self.pixel_values is not None and len(self.pixel_values) != len(self.input_ids):
            raise ValueError(f"{len(self.pixel_values)} pixel_values rows for {len(self.input_ids)} token rows")
        if self.reference_logps is not None and np.shape(self.reference_logps) != (len(self.input_ids), 2):
            raise ValueError(f"reference_logps must be [pairs, 2], got {np.shape(self.reference_logps)} for "
                             f"{len(self.input_ids)} pairs")

    @property
    def pairs(self) -> bool:
        """Whether the examples are preference pairs (chosen, rejected)."""
        return self.input_ids.ndim == 3

    @property
    def tokens_per_example(self) -> int:
        return int(np.prod(self.input_ids.shape[1:]))

    @property
    def columns(self) -> List[str]:
        """Names of a batch's arrays, in order."""
        extra = [name for name in ("position_ids", "pixel_values", "reference_logps") if getattr(self, name) is not None]
        return ["input_ids", "labels"] + extra

    def rows(self, index: np.ndarray) -> Tuple[np.ndarray, ...]:
        """The examples at ``index`` as a batch: int32 token arrays (and positions, float32 pixels,
        reference log-probs)."""
        batch = (self.input_ids[index].astype(np.int32), self.labels[index].astype(np.int32))
        if self.position_ids is not None:
            batch = batch + (self.position_ids[index].astype(np.int32),)
        for extra in (self.pixel_values, self.reference_logps):
            if extra is not None:
                batch = batch + (np.asarray(extra[index], np.float32),)
        return batch

    def __len__(self) -> int:
        return len(self.input_ids)


def sample_positions(starts: np.ndarray) -> np.ndarray:
    """starts (..., S) bool, True where a sample begins → each token's position in its sample
    (..., S) int32: 0 at every start, counting up to the next. The model keeps a token's attention
    inside its sample from these alone (a sample starts where its position is 0), so every row
    must start one: a sample cut at a row's end starts again at 0 in the next row."""
    flat = starts.reshape(-1, starts.shape[-1])  # (R, S)
    idx = np.broadcast_to(np.arange(flat.shape[1]), flat.shape)
    last_start = np.maximum.accumulate(np.where(flat, idx, 0), axis=1)  # (R, S)
    return (idx - last_start).astype(np.int32).reshape(starts.shape)


class BatchLoader:
    """Batches (``TokenDataset.rows``: input_ids, labels int32 [batch_size, S], …) for one data-parallel rank.

    Args:
        data: the examples.
        batch_size: examples per batch on this rank.
        seed: shuffle seed (same on every rank).
        shuffle: reshuffle every epoch; False keeps the stored order.
        rank, world: this rank's slice of every epoch.
    """

    def __init__(self, data: TokenDataset, batch_size: int, seed: int = 0, shuffle: bool = True,
                 rank: int = 0, world: int = 1):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, {world})")
        self.data, self.batch_size, self.seed, self.shuffle = data, batch_size, seed, shuffle
        self.rank, self.world = rank, world
        self.steps_per_epoch = len(data) // world // batch_size
        self._cached = (-1, None)
        if self.steps_per_epoch == 0:
            raise ValueError(f"{len(data)} examples cannot fill one batch of {batch_size} on each of "
                             f"{world} rank(s)")

    def order(self, epoch: int) -> np.ndarray:
        """This rank's example indices for ``epoch``, batch-aligned."""
        if self._cached[0] == epoch:
            return self._cached[1]
        n = len(self.data)
        perm = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        mine = perm[self.rank::self.world][:self.steps_per_epoch * self.batch_size]
        self._cached = (epoch, mine)
        return mine

    def batch(self, step: int) -> Tuple[np.ndarray, ...]:
        """The batch of global step ``step`` (epochs follow one another)."""
        epoch, i = divmod(step, self.steps_per_epoch)
        return self.data.rows(self.order(epoch)[i * self.batch_size:(i + 1) * self.batch_size])

    def iterate(self, start_step: int = 0, stop_step: Optional[int] = None) -> Iterator[Tuple[np.ndarray, ...]]:
        """Batches for steps [start_step, stop_step): a resumed run continues exactly."""
        step = start_step
        while stop_step is None or step < stop_step:
            yield self.batch(step)
            step += 1


    def stream(self, start_step: int, stop_step: int) -> Iterator[Tuple[np.ndarray, ...]]:
        """``iterate``, or, when the pixel values stay on disk (``MediaColumn``), the same
        batches through ``mindspore_dataset``'s parallel pipeline."""
        if not hasattr(self.data.pixel_values, "load"):
            return self.iterate(start_step, stop_step)
        dataset = mindspore_dataset(self, stop_step, start_step)
        return dataset.create_tuple_iterator(output_numpy=True, num_epochs=1, do_copy=False)


class _StepSource:
    """Random-access source for ``GeneratorDataset``: item ``i`` is the batch of step ``i``."""

    def __init__(self, loader: BatchLoader, steps: int):
        self.loader, self.steps = loader, steps

    def __getitem__(self, step: int) -> Tuple[np.ndarray, ...]:
        return self.loader.batch(step)

    def __len__(self) -> int:
        return self.steps


class _RowSource:
    """Random-access source of single rows: item ``k`` is row ``k % batch_size`` of step
    ``k // batch_size``'s batch, its pixels decoded (``MediaColumn.load``) but not transformed."""

    def __init__(self, loader: BatchLoader, steps: int):
        self.loader, self.steps = loader, steps

    def __getitem__(self, k: int) -> Tuple[np.ndarray, ...]:
        loader, data = self.loader, self.loader.data
        step, j = divmod(int(k), loader.batch_size)
        epoch, i = divmod(step, loader.steps_per_epoch)
        row = loader.order(epoch)[i * loader.batch_size + j]
        return data.input_ids[row].astype(np.int32), data.labels[row].astype(np.int32), data.pixel_values.load(row)

    def __len__(self) -> int:
        return self.steps * self.loader.batch_size


def mindspore_dataset(loader: BatchLoader, steps: int, start_step: int = 0, workers: int = 1):
    """The loader's batches for steps [start_step, steps) as a MindSpore dataset
    (``input_ids``, ``labels``: int32 [batch, seq], and ``pixel_values``), fixed shapes for graph mode.

    Rows whose pixels stay on disk (a ``MediaColumn``) go row by row: the column's ``read_workers``
    read and decode, its transforms (resize, crop, normalise) are mapped in its ``workers``
    threads, then ``batch`` (``workers`` here is for token batches). Resuming is ``set_init_step``: batches are computed by index, so nothing before
    ``start_step`` is read, and step k's batch is the same whatever the start or worker count.
    """
    import mindspore.dataset as msd
    if not 0 <= start_step <= steps:
        raise ValueError(f"start_step={start_step} must be in [0, steps={steps}]")
    column = loader.data.pixel_values
    if not hasattr(column, "load"):
        dataset = msd.GeneratorDataset(_StepSource(loader, steps), loader.data.columns, shuffle=False,
                                       num_parallel_workers=workers, python_multiprocessing=False)
    else:
        dataset = msd.GeneratorDataset(_RowSource(loader, steps), loader.data.columns, shuffle=False,
                                       num_parallel_workers=column.read_workers,
                                       python_multiprocessing=column.read_workers > 1)
        dataset = dataset.map(column.transforms, input_columns="pixel_values", num_parallel_workers=column.workers)
        dataset = dataset.batch(loader.batch_size, drop_remainder=True)
    dataset.set_init_step(start_step)
    return dataset
