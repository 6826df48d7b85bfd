"""Compiled graphs: keeping MindSpore's cache honest after a Cell tree changes, and running a
block in a given execution mode."""
import contextlib
import time
from typing import Iterator

import mindspore as ms
from mindspore import nn


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


def invalidate_compiled_graphs(model: nn.Cell) -> None:
    """Force the next call of ``model`` (or any of its cells) to recompile.

    MindSpore keys a Cell's compiled graph by (phase, create_time, id) and reads Python
    attributes of the tree as compile-time constants: after layer surgery, a merge, or a
    precision change, the cached graph is stale. ``create_time`` is a read-only property over
    ``_create_time`` and there is no public reset, so every cell gets a new stamp. Decoder
    layers that changed get the compiled-once graph of their new signature
    (``sync_with_weights``).
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
