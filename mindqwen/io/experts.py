"""A mixture of experts' routed-expert tensors: HF's one per expert ⇄ one per layer, stacked.

HF checkpoints store ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`` [out, in]
per expert. mindqwen's parameters (``models/moe.py`` ``ExpertLinear``) and its ``.ckpt`` stack
each projection [E, out, in] (layout "own"); mindformers stacks them transposed [E, in, out]
("stack") or flattened [E·in, out] ("flat"), gate and up concatenated (``key_maps.EXPERTS``).
Both directions are lazy: a stacked tensor is built when it is loaded, and a split one is read
once for all its experts and released after the last.
"""
from __future__ import annotations

import re
from functools import partial
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from mindqwen.io.key_maps import EXPERTS
from mindqwen.io.safetensors import LazyTensor

EXPERT = "model.layers.{i}.mlp.experts.{e}.{proj}.weight"
_EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")
# Any per-expert name (a weight, or a LoRA factor: ``…mlp.experts.3.up_proj.lora_a``) and any
# stacked one (``…mlp.experts.up_proj.lora_a``; a module path without a suffix too).
_PER_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.([a-z_]+(?:\.weight|\.lora_a|\.lora_b))")
_STACKED = re.compile(r"(.*\.experts)\.([a-z_]+)((?:\.weight|\.lora_a|\.lora_b)?)")


def stack_experts(state: Dict[str, LazyTensor], fmt: str, num_experts: int = 0) -> Dict[str, LazyTensor]:
    """Pop the per-expert HF tensors of ``state``; return them stacked as ``fmt`` stores them.

    ``num_experts`` (default: as many as the keys number) experts make a layer; a projection
    with any of them absent (a partial checkpoint) is left unstacked in ``state``.
    """
    counts: Dict[str, int] = {}
    for key in state:
        m = _EXPERT_KEY.match(key)
        if m:
            counts[m.group(1)] = num_experts or max(counts.get(m.group(1), 0), int(m.group(2)) + 1)
    out = {}
    for i, num in counts.items():
        for foreign, projs, layout in EXPERTS[fmt]:
            keys = [[EXPERT.format(i=i, e=e, proj=p) for p in projs] for e in range(num)]
            if not all(k in state for parts in keys for k in parts):
                continue
            members = [[state.pop(k) for k in parts] for parts in keys]
            rows, cols = sum(m.shape[0] for m in members[0]), members[0][0].shape[1]
            shape = {"own": (num, rows, cols), "stack": (num, cols, rows), "flat": (num * cols, rows)}[layout]
            out[foreign.format(i=i)] = LazyTensor(shape, members[0][0].dtype, partial(
                _stack, members, layout == "own", shape))
    return out


def _stack(members: List[List[LazyTensor]], own: bool, shape: tuple) -> np.ndarray:
    experts = [np.concatenate([m.load() for m in parts], 0) for parts in members]  # E × [out, in]
    return np.stack(experts if own else [w.T for w in experts]).reshape(shape)


def unstack_experts(state: Dict[str, LazyTensor], fmt: str, num_experts: int) -> Dict[str, LazyTensor]:
    """Inverse of ``stack_experts``: pop the stacked tensors, return HF per-expert tensors."""
    out = {}
    for foreign, projs, layout in EXPERTS[fmt]:
        pattern = re.compile(re.escape(foreign).replace(r"\{i\}", r"(?P<i>\d+)") + "$")
        for name in [k for k in state if pattern.match(k)]:
            i = pattern.match(name).group("i")
            whole = state.pop(name)
            wrong = not num_experts or (len(whole.shape) != 3 or whole.shape[0] != num_experts if layout == "own"
                                        else len(whole.shape) not in (2, 3) or whole.shape[0] % num_experts)
            if wrong:
                raise ValueError(f"{name} has shape {list(whole.shape)}: not {num_experts} stacked experts")
            split = _Split(whole, num_experts, len(projs), layout == "own")
            if layout == "own":
                rows, cols = whole.shape[1] // len(projs), whole.shape[2]
            else:
                rows = whole.shape[-1] // len(projs)
                cols = whole.shape[-2] if len(whole.shape) == 3 else whole.shape[0] // num_experts
            for e in range(num_experts):
                for j, proj in enumerate(projs):
                    out[EXPERT.format(i=i, e=e, proj=proj)] = LazyTensor((rows, cols), whole.dtype,
                                                                         partial(split.take, e, j))
    return out


# Fused routed experts, as some checkpoints keep them (Qwen3.5-MoE's published folders): per layer one
# ``…mlp.experts.gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up rows) and one
# ``…mlp.experts.down_proj`` [E, H, I], without a ``.weight`` suffix.
_FUSED_EXPERTS = re.compile(r"(.*\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def unfuse_experts(shapes: Dict[str, tuple], read: Callable[[str], np.ndarray]) -> Dict[str, Tuple[str, LazyTensor]]:
    """A checkpoint's fused expert tensors (``shapes``: key → shape; ``read(key)`` its fp32 array) as HF's
    per-expert names: {``…experts.{e}.{gate,up,down}_proj.weight``: (the fused key, a lazy [out, in] slice)}.
    Each fused tensor is read once, when its first slice is loaded, and released after its last."""
    out = {}
    for key, shape in shapes.items():
        m = _FUSED_EXPERTS.match(key)
        if m is None or len(shape) != 3:
            continue
        projs = ("gate_proj", "up_proj") if m.group(2) == "gate_up_proj" else ("down_proj",)
        num, rows, cols = shape
        split = _Split(LazyTensor(tuple(shape), np.dtype(np.float32), partial(read, key)), num, len(projs), True)
        for e in range(num):
            for part, proj in enumerate(projs):
                out[f"{m.group(1)}.{e}.{proj}.weight"] = (key, LazyTensor((rows // len(projs), cols), np.dtype(np.float32),
                                                                          partial(split.take, e, part)))
    return out


def expert_slice(name: str) -> Optional[Tuple[str, int]]:
    """A per-expert name → (the model's stacked name, the expert's index); else None."""
    m = _PER_EXPERT.fullmatch(name)
    return (f"{m.group(1)}.{m.group(3)}", int(m.group(2))) if m else None


def is_stacked(name: str) -> bool:
    """Whether ``name`` is a stacked expert tensor or module of the model."""
    return _STACKED.fullmatch(name) is not None


def per_expert_names(name: str, num_experts: int) -> List[str]:
    """A stacked name → its experts' names, in order (inverse of ``expert_slice``)."""
    m = _STACKED.fullmatch(name)
    return [f"{m.group(1)}.{e}.{m.group(2)}{m.group(3)}" for e in range(num_experts)]


class _Split:
    """The parts of one stacked expert tensor, computed on first use and dropped after the last."""

    def __init__(self, whole: LazyTensor, num_experts: int, num_parts: int, own: bool):
        self.whole, self.num_experts, self.num_parts, self.own = whole, num_experts, num_parts, own
        self.parts, self.left = None, 0

    def take(self, expert: int, part: int) -> np.ndarray:
        if self.parts is None:
            w = self.whole.load()
            w = w.reshape(self.num_experts, -1, w.shape[-1])  # (E, out, in) own, else (E, in, out)
            self.parts = [np.split(np.ascontiguousarray(w[e] if self.own else w[e].T), self.num_parts, 0)
                          for e in range(self.num_experts)]
            self.left = self.num_experts * self.num_parts
        a = self.parts[expert][part]
        self.left -= 1
        if self.left == 0:
            self.parts = None
        return a
