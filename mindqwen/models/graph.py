"""Keeping MindSpore's compiled-graph cache honest after a Cell tree changes."""
import time

from mindspore import nn


def invalidate_compiled_graphs(model: nn.Cell) -> None:
    """Force the next call of ``model`` (or any of its cells) to recompile.

    MindSpore keys a Cell's compiled graph by (phase, create_time, id) and reads Python
    attributes of the tree as compile-time constants: after layer surgery, a merge, or a
    precision change, the cached graph is stale. ``create_time`` is a read-only property over
    ``_create_time`` and there is no public reset, so every cell gets a new stamp.
    """
    stamp = time.time_ns()
    for _, cell in model.cells_and_names():
        if not hasattr(cell, "_create_time"):  # a MindSpore that renamed it would run stale graphs
            raise RuntimeError("this MindSpore has no Cell._create_time: mindqwen cannot invalidate compiled "
                               "graphs after changing a model (tests/test_lora.py checks this hook)")
        object.__setattr__(cell, "_create_time", stamp)
