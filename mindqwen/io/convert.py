"""Checkpoint conversion between HF (= mindqwen), MindSpore ``.ckpt`` and mindformers' namings.

    hf | mindqwen       an HF folder (config.json + safetensors, sharded or not)
    ms-ckpt             a MindSpore .ckpt with mindqwen's parameter names (HF's; a mixture of
                        experts' routed experts stacked per layer and projection, io/experts.py)
    mindformers         legacy names (attention.wq, feed_forward.w1, …): .ckpt or safetensors
    mindformers-mcore   Mcore names (self_attention.linear_qkv, mlp.linear_fc1, …): .ckpt or safetensors

Every conversion goes through HF names: read lazily → rename / split fused tensors → check every
key and shape against the model the config describes → rename / fuse → write (staged, renamed).
Safetensors sources stream tensor by tensor; a ``.ckpt`` source is read whole by MindSpore.
"""
from __future__ import annotations

import os
import re
from functools import partial
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np

from mindqwen.config import QwenConfig
from mindqwen.io.hf import DTYPES, open_checkpoint, sanitize, save_tensors
from mindqwen.io.atomic import atomic_file
from mindqwen.io.safetensors import CheckpointError, LazyTensor, SafetensorsFile, check_finite, save_file
from mindqwen.io.experts import stack_experts, unstack_experts
from mindqwen.io.key_maps import FUSIONS, MAPS, MOE_FORMATS

FORMATS = ("hf", "mindqwen", "ms-ckpt", "mindformers", "mindformers-mcore")
DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
                 "float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def read_state(path: str, allow_non_finite: bool = False) -> Dict[str, LazyTensor]:
    """Tensors of an HF folder, a safetensors file or a ``.ckpt``, as lazy fp32/fp16 tensors;
    loading one holding NaN or inf raises ``CheckpointError`` naming it, unless ``allow_non_finite``."""
    if os.path.isdir(path):
        return {k: _from_safetensors(f, k) for k, f in open_checkpoint(path, allow_non_finite).items()}
    if path.endswith(".safetensors"):
        f = SafetensorsFile(path, allow_non_finite)
        return {k: _from_safetensors(f, k) for k in f.keys()}
    if path.endswith(".ckpt"):
        import mindspore as ms
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: checkpoint file not found")
        try:
            params = ms.load_checkpoint(path)
        except (RuntimeError, ValueError) as e:
            raise CheckpointError(f"{path}: not a readable MindSpore checkpoint ({str(e).splitlines()[0]})") from None
        arrays = {k: (p.astype(ms.float32) if p.dtype == ms.bfloat16 else p).asnumpy() for k, p in params.items()}
        if not allow_non_finite:
            for k, a in arrays.items():
                check_finite(a, path, k)
        return {k: LazyTensor(a.shape, a.dtype, partial(lambda x: x, a)) for k, a in arrays.items()}
    raise CheckpointError(f"{path}: expected an HF folder, a .safetensors file or a .ckpt")


def _from_safetensors(f: SafetensorsFile, key: str) -> LazyTensor:
    stored = np.float16 if f.dtype(key) == "F16" else np.float32
    return LazyTensor(f.shape(key), np.dtype(stored), partial(f.get, key, stored))


def convert(source: str, target: str, src_fmt: str, dst_fmt: str, config: Optional[str] = None,
            dtype: Optional[str] = None, qkv: Optional[str] = None, mlp: Optional[str] = None,
            max_shard_size: str = "5GB", allow_non_finite: bool = False) -> None:
    """Convert ``source`` (``src_fmt``) into ``target`` (``dst_fmt``).

    Args:
        config: HF folder or config.json describing the model (default: ``source`` when it is an
            HF folder).
        dtype: stored dtype: fp32 | fp16 | bf16 (default: as read).
        qkv, mlp: fused layout of q/k/v and gate/up in a mindformers format, on either side:
            contiguous | interleaved | None (not fused).
        allow_non_finite: convert tensors holding NaN or inf (else ``CheckpointError`` naming them).
    """
    for name, fmt in (("--from", src_fmt), ("--to", dst_fmt)):
        if fmt not in FORMATS:
            raise ValueError(f"{name} {fmt!r}: unknown format; known: {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPE_ALIASES:
        raise ValueError(f"--dtype must be fp32, fp16 or bf16, got {dtype!r}")
    cfg, state = read_checkpoint(source, src_fmt, config, qkv, mlp, allow_non_finite)
    _check_moe_format(cfg, dst_fmt)
    store = DTYPE_ALIASES[dtype] if dtype else None
    if store:
        state = {k: _cast(t, store) for k, t in state.items()}
    if dst_fmt in ("hf", "mindqwen"):
        save_tensors(target, own_layout(state, cfg), cfg.to_hf(), store, max_shard_size)
        return
    if dst_fmt in MAPS:
        state = to_format(state, dst_fmt, cfg.num_key_value_heads, qkv, mlp)
    else:  # ms-ckpt: the model's own parameters, loadable by mindspore.load_param_into_net
        state = dict(state)
        state.update(stack_experts(state, "stacked"))
    write_file(target, state, store == "bfloat16")


def _config(path: str) -> QwenConfig:
    if path.endswith(".json") or os.path.isfile(os.path.join(path, "config.json")):
        return QwenConfig.from_hf(path)
    raise ValueError(f"{path}: no config.json; give --config <HF folder or config.json>")


def check_against_config(state: Dict[str, LazyTensor], cfg: QwenConfig, source: str) -> None:
    """Every parameter of the model ``cfg`` describes is present with its shape, and nothing else."""
    expected = cfg.tensor_shapes()
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise CheckpointError(f"{source}: missing {missing[:6]}{' …' if len(missing) > 6 else ''}; "
                              f"unexpected {extra[:6]}{' …' if len(extra) > 6 else ''}")
    for k, shape in expected.items():
        if tuple(state[k].shape) != shape:
            raise CheckpointError(f"{source}: tensor {k} has shape {list(state[k].shape)}, the config implies {list(shape)}")


def _cast(t: LazyTensor, store: str) -> LazyTensor:
    np_dtype = np.dtype(DTYPES[store][1])  # bf16 is written from fp32 (rounded to nearest even)
    return LazyTensor(t.shape, np_dtype, lambda: t.load().astype(np_dtype, copy=False))


def write_file(path: str, state: Dict[str, LazyTensor], bf16: bool) -> None:
    """A .safetensors file (streamed) or a MindSpore .ckpt, written to a temp name and renamed."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".safetensors"):
        save_file(state, path, bf16=bf16)
        return
    if not path.endswith(".ckpt"):
        raise ValueError(f"{path}: write a .ckpt or .safetensors file (or use --to hf for a folder)")
    import mindspore as ms
    with atomic_file(path, ".ckpt") as tmp:  # MindSpore appends .ckpt to a name without it
        tensors = [{"name": k, "data": ms.Tensor(t.load())} for k, t in state.items()]
        if bf16:
            tensors = [{"name": d["name"], "data": d["data"].astype(ms.bfloat16)} for d in tensors]
        ms.save_checkpoint(tensors, tmp)


def read_checkpoint(source: str, fmt: str = "hf", config: Optional[str] = None, qkv: Optional[str] = None,
                    mlp: Optional[str] = None, allow_non_finite: bool = False) -> Tuple[QwenConfig, Dict[str, LazyTensor]]:
    """The config and the HF-named lazy tensors of a checkpoint in any supported format, checked
    like ``convert`` (``QwenForCausalLM.from_checkpoint`` builds the model from them)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(FORMATS)}")
    cfg = _config(source if config is None else config)
    _check_moe_format(cfg, fmt)
    state = read_state(source, allow_non_finite)
    state.update(unstack_experts(state, "stacked", cfg.num_experts))  # a mindqwen .ckpt's stacked experts
    if cfg.model_type == "qwen" and fmt in ("hf", "mindqwen"):  # its own layout: fused c_attn
        fmt, qkv, mlp = "qwen", "contiguous", None
    if fmt in MAPS:
        rows = part_rows(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
        state = from_format(state, fmt, cfg.num_key_value_heads, rows, qkv, mlp, cfg.num_experts)
    state = {k: state[k] for k in sanitize(list(state), cfg)}
    check_against_config(state, cfg, source)
    return cfg, state


def own_layout(state: Dict[str, LazyTensor], cfg: QwenConfig) -> Dict[str, LazyTensor]:
    """HF-named tensors in the layout of the model's own HF folder: the original Qwen's
    (``transformer.h.{i}.attn.c_attn`` …), every other family's unchanged."""
    if cfg.model_type != "qwen":
        return state
    return to_format(state, "qwen", cfg.num_key_value_heads, "contiguous", None)


def _check_moe_format(cfg: QwenConfig, fmt: str) -> None:
    """A mixture of experts converts to the mindformers naming that has a model for it."""
    if fmt in MAPS and cfg.model_type in MOE_FORMATS and fmt != MOE_FORMATS[cfg.model_type]:
        raise ValueError(f"mindformers has no {cfg.model_type} model in the {fmt!r} naming; "
                         f"use {MOE_FORMATS[cfg.model_type]!r}")


# ---------------------------------------------------------------- renaming and fused layouts
def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)") + "$")


def rename(keys: List[str], mapping: Dict[str, str]) -> Dict[str, str]:
    """key → renamed key under ``mapping`` (templates); raises naming the keys no template matches."""
    compiled = [(_pattern(src), dst) for src, dst in mapping.items()]
    out, unmatched = {}, []
    for key in keys:
        for pattern, dst in compiled:
            m = pattern.match(key)
            if m:
                out[key] = dst.format(**m.groupdict())
                break
        else:
            unmatched.append(key)
    if unmatched:
        raise KeyError(f"{len(unmatched)} key(s) match no name map entry: {', '.join(unmatched[:6])}")
    return out


def inverse(mapping: Dict[str, str]) -> Dict[str, str]:
    return {dst: src for src, dst in mapping.items()}


def fuse(parts: List[np.ndarray], kind: str, groups: int, interleaved: bool) -> np.ndarray:
    """Concatenate along rows: contiguous, or interleaved per group (q/k/v: KV heads; gate/up: rows)."""
    if not interleaved:
        return np.concatenate(parts, 0)
    if kind == "mlp":
        groups = parts[0].shape[0]
    split = [p.reshape((groups, -1) + p.shape[1:]) for p in parts]  # (G, rows per group, …)
    return np.concatenate(split, 1).reshape((-1,) + parts[0].shape[1:])


def unfuse(fused: np.ndarray, sizes: List[int], kind: str, groups: int, interleaved: bool) -> List[np.ndarray]:
    """Inverse of ``fuse``; ``sizes`` are the parts' row counts."""
    if not interleaved:
        return np.split(fused, np.cumsum(sizes)[:-1], 0)
    if kind == "mlp":
        groups = sizes[0]
    grouped = fused.reshape((groups, -1) + fused.shape[1:])
    per_group = [s // groups for s in sizes]
    pieces = np.split(grouped, np.cumsum(per_group)[:-1], 1)
    return [p.reshape((-1,) + fused.shape[1:]) for p in pieces]


LAYOUTS = (None, "contiguous", "interleaved")  # None: not fused


def to_format(state: Mapping[str, LazyTensor], fmt: str, num_kv_heads: int, qkv: Optional[str] = None,
              mlp: Optional[str] = None) -> Dict[str, LazyTensor]:
    """HF state → ``fmt`` (mindformers | mindformers-mcore); ``qkv`` / ``mlp`` fuse those
    projections with a layout (contiguous | interleaved), None keeps them apart. Lazy: a fused
    tensor reads its parts only when it is loaded."""
    if fmt not in MAPS:
        raise ValueError(f"unknown checkpoint format {fmt!r}; known: {', '.join(MAPS)}")
    layouts = _layouts(qkv, mlp)
    state = dict(state)
    stacked = stack_experts(state, fmt)  # pops the per-expert tensors
    names = rename(list(state), MAPS[fmt])
    out = {names[k]: v for k, v in state.items()}
    out.update(stacked)
    for fused, parts, kind in FUSIONS[fmt]:
        if layouts[kind] is None:
            continue
        for match in _instances(out, parts[0]):
            members = [out.pop(p.format(**match)) for p in parts]
            shape = (sum(m.shape[0] for m in members),) + tuple(members[0].shape[1:])
            out[fused.format(**match)] = LazyTensor(shape, members[0].dtype, partial(
                lambda ms_, k, il: fuse([m.load() for m in ms_], k, num_kv_heads, il),
                members, kind, layouts[kind] == "interleaved"))
    return out


def from_format(state: Mapping[str, LazyTensor], fmt: str, num_kv_heads: int, rows: Dict[str, List[int]],
                qkv: Optional[str] = None, mlp: Optional[str] = None, num_experts: int = 0) -> Dict[str, LazyTensor]:
    """``fmt`` state → HF. Fused tensors present are split with their layout; ``rows`` gives the
    parts' row counts (``part_rows``); stacked experts are split into ``num_experts``."""
    if fmt not in MAPS:
        raise ValueError(f"unknown checkpoint format {fmt!r}; known: {', '.join(MAPS)}")
    layouts = _layouts(qkv, mlp)
    out = dict(state)
    experts = unstack_experts(out, fmt, num_experts)  # pops the stacked tensors
    for fused, parts, kind in FUSIONS[fmt]:
        for match in _instances(out, fused):
            if layouts[kind] is None:
                raise ValueError(f"{fused.format(**match)} is fused: give its layout ({kind}=contiguous|interleaved)")
            whole = out.pop(fused.format(**match))
            if whole.shape[0] != sum(rows[kind]):
                raise ValueError(f"{fused.format(**match)} has {whole.shape[0]} rows, the config implies {sum(rows[kind])}")
            for j, p in enumerate(parts):
                out[p.format(**match)] = LazyTensor((rows[kind][j],) + tuple(whole.shape[1:]), whole.dtype, partial(
                    lambda t, k, il, j_: unfuse(t.load(), rows[k], k, num_kv_heads, il)[j_],
                    whole, kind, layouts[kind] == "interleaved", j))
    names = rename(list(out), inverse(MAPS[fmt]))
    return {**{names[k]: v for k, v in out.items()}, **experts}


def lazy(arrays: Mapping[str, np.ndarray]) -> Dict[str, LazyTensor]:
    """In-memory arrays as lazy tensors."""
    return {k: LazyTensor(tuple(a.shape), a.dtype, partial(lambda x: x, a)) for k, a in arrays.items()}


def _layouts(qkv: Optional[str], mlp: Optional[str]) -> Dict[str, Optional[str]]:
    for name, value in (("qkv", qkv), ("mlp", mlp)):
        if value not in LAYOUTS:
            raise ValueError(f"{name} layout must be contiguous, interleaved or None, got {value!r}")
    return {"qkv": qkv, "mlp": mlp}


def _instances(state: Dict[str, np.ndarray], template: str) -> List[Dict[str, str]]:
    pattern = _pattern(template)
    return [m.groupdict() for m in (pattern.match(k) for k in list(state)) if m]


def part_rows(num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int) -> Dict[str, List[int]]:
    return {"qkv": [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            "mlp": [intermediate, intermediate]}
