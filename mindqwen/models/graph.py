"""Compiled graphs: how a model executes (``configure``), keeping MindSpore's cache honest after a
Cell tree changes, and running a block in a given execution mode."""
import contextlib
import dataclasses
import time
from typing import Callable, Iterator, Optional, TypeVar

import mindspore as ms
from mindspore import nn

from mindqwen.config import ExecutionOptions

T = TypeVar("T")


def configure(model: nn.Cell, **changes) -> ExecutionOptions:
    """Change how ``model`` executes (fields of ``ExecutionOptions``): the one writer of those
    settings. The new options are checked, handed to every cell that reads one, and the compiled
    graphs invalidated once.

    The options of a tree are those of the models in it (``QwenForCausalLM.options``; a fused
    multimodal model's are its LM's); all of them take the new ones.

    Raises:
        ConfigError: a value out of range (naming the option); TypeError: an unknown option.
    """
    holders = [cell for _, cell in model.cells_and_names() if isinstance(getattr(cell, "options", None),
                                                                         ExecutionOptions)]
    options = dataclasses.replace(holders[0].options if holders else ExecutionOptions(), **changes)
    for holder in holders:
        holder.options = options
    apply_options(model, options)
    invalidate_compiled_graphs(model)
    return options


def apply_options(model: nn.Cell, options: ExecutionOptions) -> None:
    """Hand ``options`` to every cell of ``model`` that reads one (its ``apply_options``)."""
    for _, cell in model.cells_and_names():
        if hasattr(cell, "apply_options"):
            cell.apply_options(options)


def low_dtype(name: Optional[str]):
    """An ``ExecutionOptions`` dtype name → the MindSpore dtype (None stays None)."""
    return None if name is None else getattr(ms, name)


@contextlib.contextmanager
def in_mode(mode: int) -> Iterator[None]:
    """Run the block in ``mode`` (``ms.GRAPH_MODE`` / ``ms.PYNATIVE_MODE``); the caller's mode
    comes back, whatever the block raises."""
    previous = ms.get_context("mode")
    ms.set_context(mode=mode)
    try:
        yield
    finally:
        ms.set_context(mode=previous)


def kept_on_model(model: nn.Cell, key: str, build: Callable[[], T]) -> T:
    """``build()``, kept on ``model`` under ``key`` and built anew once any of its cells has a
    newer stamp (surgery re-stamps what it touches, ``invalidate_compiled_graphs``; a new cell has
    a new stamp): Cells made over a model (generation steps, scoring graphs) keep their compiled
    graphs across the objects that use them, and never outlive a change of the model."""
    stamp = max(cell.create_time for _, cell in model.cells_and_names())
    kept_stamp, kept = model.__dict__.get(key, (None, None))
    if kept is None or kept_stamp != stamp:
        kept = build()
        # A plain attribute: as a Cell attribute the kept Cells (which hold the model) would be its children.
        object.__setattr__(model, key, (stamp, kept))
    return kept


def invalidate_compiled_graphs(model: nn.Cell) -> None:
    """Force the next call of ``model`` (or any of its cells) to recompile.

    MindSpore keys a Cell's compiled graph by (phase, create_time, id) and reads Python
    attributes of the tree as compile-time constants: after layer surgery, a merge, or an
    option change (``configure``), the cached graph is stale. This is mindqwen's one write to a
    private MindSpore attribute, and why: ``create_time`` is a read-only property over
    ``_create_time``, MindSpore 2.10 has no public way to drop a Cell's compiled graphs, and the
    public alternatives fail the user: a new Cell would leave the caller's reference (a notebook's
    ``model``) running the stale graph, and keying graphs on the options would not cover surgery.
    So every cell gets a new stamp. Decoder layers that changed get the compiled-once graph of
    their new signature (``sync_with_weights``).
    """
    stamp = time.time_ns()
    for _, cell in model.cells_and_names():
        if not hasattr(cell, "_create_time"):  # a MindSpore that renamed it would run stale graphs
            raise RuntimeError("this MindSpore has no Cell._create_time: mindqwen cannot invalidate compiled "
                               "graphs after changing a model (tests/test_lora.py checks this hook)")
        object.__setattr__(cell, "_create_time", stamp)
    sync_with_weights(model)


def sync_with_weights(model: nn.Cell) -> bool:
    """Let every cell of ``model`` that compiles by which weights train (or by its layers'
    settings) catch up with them: decoder layers whose signature changed (a weight frozen or
    thawed, an adapter, a precision) get the compiled-once graph of their new one, the loss
    forms the head's gradient only if the head trains. Returns whether anything changed: graphs
    compiled before then are stale, and callers that find a change invalidate them."""
    changed = [cell.sync_with_weights() for _, cell in model.cells_and_names() if hasattr(cell, "sync_with_weights")]
    return any(changed)
