"""Training checkpoints: atomic, pruned, and complete enough to resume exactly.

A checkpoint is a folder ``<output_dir>/checkpoints/step_00000123/`` holding

- ``model.safetensors``: the trainable parameters (the adapter for LoRA, everything for a full
  fine-tune; frozen weights come from the base checkpoint);
- ``optimizer.safetensors``: AdamW moments, its step, and the loss-scaler state;
- ``trainer_state.json``: step, data position, seed, overflow count, last metrics;
- ``recipe.yaml``: the recipe that produced it, when there is one.

It is written under a temporary name, every file fsynced, then renamed in one step: a process
killed mid-write leaves only a ``.tmp`` folder, which is never taken for a checkpoint. Parameters
holding NaN or inf are never written (``NonFiniteParameters``), and a checkpoint damaged after the
fact (truncated, corrupt, non-finite) is skipped by ``resume: auto`` for the one before it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from typing import Dict, List, Optional, Tuple

import mindspore as ms
import numpy as np
from mindspore import nn

from mindqwen.io.jsonfile import read_json
from mindqwen.io.atomic import atomic_folder
from mindqwen.io.safetensors import CheckpointError, SafetensorsFile, check_finite, is_finite, save_file
from mindqwen.models.graph import invalidate_compiled_graphs

_STEP_DIR = re.compile(r"step_(\d{8})$")
STATE_FILE, MODEL_FILE, OPTIM_FILE, RECIPE_FILE = (
    "trainer_state.json", "model.safetensors", "optimizer.safetensors", "recipe.yaml")


class NonFiniteParameters(CheckpointError):
    """The parameters to save hold NaN or inf: the run has diverged."""


def _arrays(params) -> Dict[str, np.ndarray]:
    return {p.name: p.asnumpy() for p in params}


def optimizer_state(optimizer: nn.Optimizer, scaler: ms.amp.DynamicLossScaler) -> List[ms.Parameter]:
    """The optimizer's own Parameters (moments, step; not the model's) and the scaler's."""
    model_params = {id(p) for p in optimizer.parameters}
    own = [p for p in optimizer.get_parameters() if id(p) not in model_params and p.name != "learning_rate"]
    return own + [scaler.scale_value, scaler.counter]


def _scaler_key(p: ms.Parameter, scaler: ms.amp.DynamicLossScaler) -> str:
    return {id(scaler.scale_value): "loss_scaler.scale_value", id(scaler.counter): "loss_scaler.counter"}.get(id(p), p.name)


def save(output_dir: str, step: int, model: nn.Cell, optimizer: nn.Optimizer,
         scaler: ms.amp.DynamicLossScaler, state: dict, recipe_text: Optional[str] = None,
         keep_last: int = 3) -> str:
    """Write checkpoint ``step`` atomically and keep only the newest ``keep_last``; returns its path.

    Raises:
        NonFiniteParameters: naming the first parameter holding NaN or inf (nothing is written).
    """
    params = _arrays(model.trainable_params())
    bad = next((name for name, a in params.items() if not is_finite(a)), None)
    if bad is not None:
        raise NonFiniteParameters(f"step {step}: parameter {bad} holds NaN or inf; checkpoint not written")
    root = os.path.join(output_dir, "checkpoints")
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"step_{step:08d}")
    for stale in os.listdir(root):  # left by a process killed while saving
        if stale.startswith(".step_") and (".tmp-" in stale or ".old-" in stale):
            shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
    with atomic_folder(final) as tmp:  # re-saving a step (the final save after a periodic one) replaces it
        save_file(params, os.path.join(tmp, MODEL_FILE))
        save_file({_scaler_key(p, scaler): p.asnumpy() for p in optimizer_state(optimizer, scaler)},
                  os.path.join(tmp, OPTIM_FILE))
        _write_synced(os.path.join(tmp, STATE_FILE), json.dumps({**state, "step": step}, indent=2))
        if recipe_text is not None:
            _write_synced(os.path.join(tmp, RECIPE_FILE), recipe_text)
    _fsync_dir(root)
    for old in complete_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(output_dir: str) -> List[str]:
    """Complete checkpoint folders, oldest first."""
    root = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if _STEP_DIR.match(n))
    return [os.path.join(root, n) for n in names]


def resolve(resume: Optional[str], output_dir: str) -> Optional[str]:
    """``None`` → None; ``"auto"`` → the newest complete checkpoint or None; a path → itself."""
    if resume is None:
        return None
    if resume == "auto":
        found = complete_checkpoints(output_dir)
        return found[-1] if found else None
    if not os.path.isfile(os.path.join(resume, STATE_FILE)):
        raise CheckpointError(f"{resume}: not a complete mindqwen checkpoint (no {STATE_FILE})")
    return resume


def resume(resume: Optional[str], output_dir: str, model: nn.Cell, optimizer: nn.Optimizer,
           scaler: ms.amp.DynamicLossScaler) -> Tuple[Optional[str], dict]:
    """Load the checkpoint ``resume`` names; returns (its path, trainer state), (None, {}) if none.

    With ``"auto"``, a checkpoint that does not load (truncated, corrupt, NaN or inf) is skipped
    for the one before it, saying which and why on stderr; if none loads, ``CheckpointError``
    lists them all. A checkpoint named by path must load.
    """
    if resume is None:
        return None, {}
    candidates = complete_checkpoints(output_dir)[::-1] if resume == "auto" else [resolve(resume, output_dir)]
    problems = []
    for path in candidates:
        try:
            return path, load(path, model, optimizer, scaler)
        except CheckpointError as e:
            if resume != "auto":
                raise
            problems.append(str(e))
            print(f"resume: skipping {os.path.basename(path)}: {e}", file=sys.stderr)
    if problems:
        raise CheckpointError(f"{output_dir}: no checkpoint loads ({'; '.join(problems)})")
    return None, {}


def load(path: str, model: nn.Cell, optimizer: nn.Optimizer, scaler: ms.amp.DynamicLossScaler) -> dict:
    """Restore parameters, optimizer and scaler state in place; returns the trainer state.

    Every file is checked (present, complete, shapes, finite) before anything is set: a
    checkpoint that fails leaves the model and optimizer as they were. Two passes over the
    tensors, one in memory at a time (a full fine-tune's optimizer state is twice the model).
    """
    state = read_json(os.path.join(path, STATE_FILE), CheckpointError, "trainer state")
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{os.path.join(path, STATE_FILE)}: no step number (not a trainer state)")
    parts = [(SafetensorsFile(os.path.join(path, MODEL_FILE)), {p.name: p for p in model.trainable_params()}),
             (SafetensorsFile(os.path.join(path, OPTIM_FILE)),
              {_scaler_key(p, scaler): p for p in optimizer_state(optimizer, scaler)})]
    for f, params in parts:
        _check(f, params)
    for f, params in parts:
        for name, p in params.items():
            p.set_data(ms.Tensor(f.raw(name).copy()).astype(p.dtype))
    # A graph compiled before (an evaluation before training) keeps reading the old values through
    # the layers compiled once (no_inline), whatever set_data wrote: compile them again.
    invalidate_compiled_graphs(model)
    return state


def _check(f: SafetensorsFile, params: Dict[str, ms.Parameter]) -> None:
    missing = sorted(set(params) - set(f.keys()))
    if missing:
        raise CheckpointError(f"{f.path}: missing tensors {', '.join(missing[:6])} (a checkpoint of "
                              "another model or LoRA setting?)")
    for name, p in params.items():
        if tuple(f.shape(name)) != tuple(p.shape):
            raise CheckpointError(f"{f.path}: tensor {name} has shape {list(f.shape(name))}, expected {list(p.shape)}")
    for name in params:
        check_finite(f.raw(name), f.path, name)


def _write_synced(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
