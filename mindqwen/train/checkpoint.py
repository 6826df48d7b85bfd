"""Training checkpoints: atomic, pruned, and complete enough to resume exactly.

A checkpoint is a folder ``<output_dir>/checkpoints/step_00000123/`` holding

- ``model.safetensors``: the trainable parameters (the adapter for LoRA, everything for a full
  fine-tune; frozen weights come from the base checkpoint);
- ``optimizer.safetensors``: AdamW moments, its step, and the loss-scaler state;
- ``trainer_state.json``: step, data position, seed, overflow count, last metrics;
- ``recipe.yaml``: the recipe that produced it, when there is one.

It is written under a temporary name, every file fsynced, then renamed in one step: a process
killed mid-write leaves only a ``.tmp`` folder, which is never taken for a checkpoint.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Dict, List, Optional

import mindspore as ms
import numpy as np
from mindspore import nn

from mindqwen.io.jsonfile import read_json
from mindqwen.io.safetensors import CheckpointError, SafetensorsFile, save_file

_STEP_DIR = re.compile(r"step_(\d{8})$")
STATE_FILE, MODEL_FILE, OPTIM_FILE, RECIPE_FILE = (
    "trainer_state.json", "model.safetensors", "optimizer.safetensors", "recipe.yaml")


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
    """Write checkpoint ``step`` atomically and keep only the newest ``keep_last``; returns its path."""
    root = os.path.join(output_dir, "checkpoints")
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"step_{step:08d}")
    for stale in os.listdir(root):  # left by a process killed while saving
        if stale.startswith(".step_") and ".tmp-" in stale:
            shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
    tmp = os.path.join(root, f".step_{step:08d}.tmp-{os.getpid()}")
    os.makedirs(tmp)
    save_file(_arrays(model.trainable_params()), os.path.join(tmp, MODEL_FILE))
    save_file({_scaler_key(p, scaler): p.asnumpy() for p in optimizer_state(optimizer, scaler)},
              os.path.join(tmp, OPTIM_FILE))
    _write_synced(os.path.join(tmp, STATE_FILE), json.dumps({**state, "step": step}, indent=2))
    if recipe_text is not None:
        _write_synced(os.path.join(tmp, RECIPE_FILE), recipe_text)
    if os.path.exists(final):  # re-saving a step (e.g. the final save after a periodic one)
        shutil.rmtree(final)
    os.rename(tmp, final)
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


def load(path: str, model: nn.Cell, optimizer: nn.Optimizer, scaler: ms.amp.DynamicLossScaler) -> dict:
    """Restore parameters, optimizer and scaler state in place; returns the trainer state."""
    state = read_json(os.path.join(path, STATE_FILE), CheckpointError, "trainer state")
    _restore(SafetensorsFile(os.path.join(path, MODEL_FILE)), {p.name: p for p in model.trainable_params()})
    _restore(SafetensorsFile(os.path.join(path, OPTIM_FILE)),
             {_scaler_key(p, scaler): p for p in optimizer_state(optimizer, scaler)})
    return state


def _restore(f: SafetensorsFile, params: Dict[str, ms.Parameter]) -> None:
    missing = sorted(set(params) - set(f.keys()))
    if missing:
        raise CheckpointError(f"{f.path}: missing tensors {', '.join(missing[:6])} (a checkpoint of "
                              "another model or LoRA setting?)")
    for name, p in params.items():
        if tuple(f.shape(name)) != tuple(p.shape):
            raise CheckpointError(f"{f.path}: tensor {name} has shape {list(f.shape(name))}, expected {list(p.shape)}")
        p.set_data(ms.Tensor(f.raw(name).copy()).astype(p.dtype))


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
