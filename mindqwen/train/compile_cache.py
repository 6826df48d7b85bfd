"""MindSpore's compile cache, made safe to share between runs.

MindSpore (``MS_COMPILER_CACHE_ENABLE``) saves compiled graphs and, in a later process, loads
them by compile order, checking only a hash of the Python sources. It does not notice a changed
network: a full fine-tune started on a LoRA run's cache loads the LoRA graph and trains NaNs
(measured). So each run gets its own folder under the cache root, named by a digest of
everything a graph is built from: model config and parameters (names, shapes, dtypes, which are
trained), trainer settings, input shapes, versions and the MindSpore environment.

MindSpore also fixes the folder at its first use in a process and numbers graphs by the order
they compile in (measured). So only the first folder a process asks for is used; a later
``fit`` with other graphs (a recipe's LoRA stage after its pre-training stage) compiles them
without the cache, instead of adding them to the first folder where another run could load them.

Loaded graphs match compiled ones to ~1e-6 per step, not bit for bit (tests/test_trainer.py).

A process that compiles with CPU graph-kernel fusion cannot use the cache: its first fused
compile fixes the cache folder (to the fused-kernel folder), and MindSpore 2.10 fails to compile
fused graphs with the cache on ("the node output kernel object types size just 0"). So the cache
is refused, with a warning, once fusion is on; ``mindqwen train`` with ``trainer.compile_cache``
turns fusion off before it builds the model (``mindqwen.backend.disable_cpu_fusion``), trading
fusion's memory saving for the shorter start.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import warnings
from typing import Iterator, Optional

import mindspore as ms
from mindspore import nn

import mindqwen
from mindqwen import backend

# Settings that never reach a graph: excluded so that resumed and re-run jobs share a cache.
_HOST_ONLY = ("output_dir", "resume", "progress", "tensorboard", "compile_cache", "save_every", "keep_last")
_process_folder: Optional[str] = None  # the folder MindSpore has fixed for this process


def graph_key(model: nn.Cell, settings: dict, shapes: dict) -> str:
    """A 16-hex digest of what the training graphs are compiled from.

    Args:
        model: the network as it will be trained (LoRA applied, precision and recompute set).
        settings: the trainer's settings (``dataclasses.asdict(TrainerConfig)``); host-only
            ones (output folder, resume, progress, …) are left out.
        shapes: input shapes and anything else the graphs depend on (world size, layout).
    """
    trainer = {k: v for k, v in settings.items() if k not in _HOST_ONLY}
    params = [(p.name, tuple(p.shape), str(p.dtype), p.requires_grad) for p in model.get_parameters()]
    config = getattr(model, "config", None)
    sources = hashlib.sha256()
    package = os.path.dirname(mindqwen.__file__)
    for root, _, files in sorted(os.walk(package)):
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(root, name), "rb") as f:
                sources.update(f.read())
    blob = json.dumps({
        "model": type(model).__name__, "params": params, "trainer": trainer, "shapes": shapes,
        "config": dataclasses.asdict(config) if dataclasses.is_dataclass(config) else repr(config),
        "mindspore": ms.__version__, "sources": sources.hexdigest(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("MS_DEV_", "MS_ENABLE"))},
    }, sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@contextlib.contextmanager
def compile_cache(path: Optional[str]) -> Iterator[None]:
    """Within the block, graphs compile into (or load from) ``path``; ``None`` does nothing.

    MindSpore reads ``MS_COMPILER_CACHE_ENABLE`` whenever it compiles, so the block bounds the
    graphs cached (generation and export graphs compiled later in the process are not). A block
    asking for another folder than the process's first compiles without the cache, with a warning.
    """
    global _process_folder
    if path is not None and backend.fusion_enabled():
        warnings.warn(f"compile cache: this process compiles with CPU graph-kernel fusion, which MindSpore cannot "
                      f"cache, so these graphs compile without the cache ({path}); call "
                      "mindqwen.backend.disable_cpu_fusion() before building the model to use it", stacklevel=3)
        path = None
    if path is not None and _process_folder not in (None, path):
        warnings.warn(f"compile cache: this process already caches into {_process_folder} and MindSpore cannot "
                      f"switch folders, so these graphs compile without the cache ({path})", stacklevel=3)
        path = None
    if path is None:
        yield
        return
    _process_folder = path
    with backend.environment(MS_COMPILER_CACHE_ENABLE="1", MS_COMPILER_CACHE_PATH=path):
        yield
