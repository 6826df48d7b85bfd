"""Qwen3-Next's fused Gated DeltaNet projections, in and out of the model's own four.

A Qwen3-Next checkpoint stores ``linear_attn.in_proj_qkvz`` and ``linear_attn.in_proj_ba``, grouped by key
head: for each of the Hk key heads, its query (dk rows), key (dk), the r = Hv / Hk value heads it serves (r·dv)
and their output gates z (r·dv); then, in ``in_proj_ba``, those value heads' β gates (r rows) and decay inputs
a (r). The model keeps Qwen3.5's layout: ``in_proj_qkv`` (every query, then every key, then every value),
``in_proj_z``, ``in_proj_b``, ``in_proj_a``, value heads in the same order (key head g serves g·r … g·r + r − 1).
"""
from __future__ import annotations

import re
from typing import Dict

import numpy as np

from mindqwen.config import QwenConfig
from mindqwen.io.safetensors import LazyTensor

FUSED_TYPES = ("qwen3_next",)
_LAYER = re.compile(r"(.*\.linear_attn)\.(in_proj_qkvz|in_proj_ba)\.weight$")
_OWN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def _sizes(config: QwenConfig):
    hk, dk, dv = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
    r = config.linear_num_value_heads // hk
    return hk, dk, r * dv, r


def unfuse_projections(state: Dict[str, LazyTensor], config: QwenConfig) -> Dict[str, LazyTensor]:
    """``state`` (HF names) with each layer's ``in_proj_qkvz`` / ``in_proj_ba`` as the model's four projections."""
    if config.model_type not in FUSED_TYPES:
        return state
    hk, dk, rv, r = _sizes(config)
    out = {}
    for name, t in state.items():
        m = _LAYER.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        cols = t.shape[-1]
        if m.group(2) == "in_proj_qkvz":
            groups = lambda t=t: t.load().reshape(hk, 2 * dk + 2 * rv, cols)  # noqa: E731  (read when loaded)
            out[f"{m.group(1)}.in_proj_qkv.weight"] = LazyTensor(
                (hk * (2 * dk + rv), cols), t.dtype, lambda g=groups: np.concatenate(
                    [w.reshape(-1, w.shape[-1]) for w in np.split(g()[:, :2 * dk + rv], [dk, 2 * dk], 1)]))
            out[f"{m.group(1)}.in_proj_z.weight"] = LazyTensor(
                (hk * rv, cols), t.dtype, lambda g=groups: np.ascontiguousarray(g()[:, 2 * dk + rv:].reshape(-1, cols)))
        else:
            groups = lambda t=t: t.load().reshape(hk, 2 * r, cols)  # noqa: E731
            for part, own in enumerate(("in_proj_b", "in_proj_a")):
                out[f"{m.group(1)}.{own}.weight"] = LazyTensor(
                    (hk * r, cols), t.dtype,
                    lambda g=groups, p=part: np.ascontiguousarray(g()[:, p * r:(p + 1) * r].reshape(-1, cols)))
    return out


def fuse_projections(state: Dict[str, LazyTensor], config: QwenConfig) -> Dict[str, LazyTensor]:
    """The inverse of ``unfuse_projections``: the model's four projections (HF names) as the checkpoint's two."""
    if config.model_type not in FUSED_TYPES:
        return state
    hk, dk, rv, r = _sizes(config)
    out = {}
    for name, t in state.items():
        prefix, _, proj = name.rpartition(".linear_attn.")
        proj = proj.removesuffix(".weight")
        if proj not in _OWN or not name.endswith(".weight"):
            out[name] = t
            continue
        if proj not in ("in_proj_qkv", "in_proj_b"):
            continue  # written with its partner
        base = f"{prefix}.linear_attn."
        cols = t.shape[-1]
        if proj == "in_proj_qkv":
            qkv, z = t, state[base + "in_proj_z.weight"]

            def qkvz(qkv=qkv, z=z):
                q, k, v = np.split(qkv.load(), [hk * dk, 2 * hk * dk])
                return np.concatenate([q.reshape(hk, dk, cols), k.reshape(hk, dk, cols), v.reshape(hk, rv, cols),
                                       z.load().reshape(hk, rv, cols)], 1).reshape(-1, cols)
            out[base + "in_proj_qkvz.weight"] = LazyTensor((hk * (2 * dk + 2 * rv), cols), t.dtype, qkvz)
        else:
            b, a = t, state[base + "in_proj_a.weight"]
            out[base + "in_proj_ba.weight"] = LazyTensor(
                (hk * 2 * r, cols), t.dtype,
                lambda b=b, a=a: np.concatenate([b.load().reshape(hk, r, cols), a.load().reshape(hk, r, cols)],
                                                1).reshape(-1, cols))
    return out
