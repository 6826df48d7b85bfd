"""Parameter-name maps between HF (= mindqwen) and mindformers' two namings, and the fused layouts.

Data first: each map lists HF template → foreign template once; ``{i}`` is a layer index and
``{p}`` a parameter kind (weight | bias). Reverse maps are derived by inversion. After renaming,
q/k/v and gate/up can be fused into one tensor (``FUSIONS``), contiguously ``[Q; K; V]`` or
interleaved per KV group ``[Q_g0; K_g0; V_g0; Q_g1; …]`` (gate/up: ``[gate; up]`` or alternating
rows). Sources: ../shared/notes/anchors.md §2.4–2.5 (mindformers r1.8 ``convert_weight.py``,
``qwen3/utils.py``, ``TrainModelMixin.concat_qkv_*``).
"""
from __future__ import annotations

import re
from functools import partial
from typing import Dict, List, Mapping, Optional

import numpy as np

from mindqwen.io.safetensors import LazyTensor

LEGACY = {  # mindformers LlamaForCausalLM (research/qwen2_5, use_legacy: True)
    "model.embed_tokens.weight": "model.tok_embeddings.embedding_weight",
    "model.layers.{i}.input_layernorm.weight": "model.layers.{i}.attention_norm.weight",
    "model.layers.{i}.self_attn.q_proj.{p}": "model.layers.{i}.attention.wq.{p}",
    "model.layers.{i}.self_attn.k_proj.{p}": "model.layers.{i}.attention.wk.{p}",
    "model.layers.{i}.self_attn.v_proj.{p}": "model.layers.{i}.attention.wv.{p}",
    "model.layers.{i}.self_attn.o_proj.{p}": "model.layers.{i}.attention.wo.{p}",
    "model.layers.{i}.self_attn.q_norm.weight": "model.layers.{i}.attention.q_norm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "model.layers.{i}.attention.k_norm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "model.layers.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "model.layers.{i}.feed_forward.w1.weight",
    "model.layers.{i}.mlp.down_proj.weight": "model.layers.{i}.feed_forward.w2.weight",
    "model.layers.{i}.mlp.up_proj.weight": "model.layers.{i}.feed_forward.w3.weight",
    "model.norm.weight": "model.norm_out.weight",
    "lm_head.weight": "lm_head.weight",
}
MCORE = {  # mindformers Qwen2/Qwen3 "Mcore" (use_legacy: False), before q/k/v and gate/up fusion
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.layers.{i}.input_layernorm.weight": "decoder.layers.{i}.input_layernorm.weight",
    "model.layers.{i}.self_attn.q_proj.{p}": "decoder.layers.{i}.self_attention.linear_q.{p}",
    "model.layers.{i}.self_attn.k_proj.{p}": "decoder.layers.{i}.self_attention.linear_k.{p}",
    "model.layers.{i}.self_attn.v_proj.{p}": "decoder.layers.{i}.self_attention.linear_v.{p}",
    "model.layers.{i}.self_attn.o_proj.{p}": "decoder.layers.{i}.self_attention.linear_proj.{p}",
    "model.layers.{i}.self_attn.q_norm.weight": "decoder.layers.{i}.self_attention.q_layernorm.weight",
    "model.layers.{i}.self_attn.k_norm.weight": "decoder.layers.{i}.self_attention.k_layernorm.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "decoder.layers.{i}.pre_mlp_layernorm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "decoder.layers.{i}.mlp.gating.weight",
    "model.layers.{i}.mlp.up_proj.weight": "decoder.layers.{i}.mlp.hidden.weight",
    "model.layers.{i}.mlp.down_proj.weight": "decoder.layers.{i}.mlp.linear_fc2.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}
MAPS = {"mindformers": LEGACY, "mindformers-mcore": MCORE}
# format → [(fused template, [part templates], kind)]; kind "qkv" splits by KV group, "mlp" by rows
FUSIONS = {
    "mindformers": [("model.layers.{i}.attention.w_qkv.{p}", ["model.layers.{i}.attention.wq.{p}",
                     "model.layers.{i}.attention.wk.{p}", "model.layers.{i}.attention.wv.{p}"], "qkv"),
                    ("model.layers.{i}.feed_forward.w_gate_hidden.weight", ["model.layers.{i}.feed_forward.w1.weight",
                     "model.layers.{i}.feed_forward.w3.weight"], "mlp")],
    "mindformers-mcore": [("decoder.layers.{i}.self_attention.linear_qkv.{p}", [
                              "decoder.layers.{i}.self_attention.linear_q.{p}", "decoder.layers.{i}.self_attention.linear_k.{p}",
                              "decoder.layers.{i}.self_attention.linear_v.{p}"], "qkv"),
                          ("decoder.layers.{i}.mlp.linear_fc1.weight", ["decoder.layers.{i}.mlp.gating.weight",
                           "decoder.layers.{i}.mlp.hidden.weight"], "mlp")],
}


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


# ---------------------------------------------------------------- fused layouts
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


# ---------------------------------------------------------------- whole state dicts
LAYOUTS = (None, "contiguous", "interleaved")  # None: not fused


def to_format(state: Mapping[str, LazyTensor], fmt: str, num_kv_heads: int, qkv: Optional[str] = None,
              mlp: Optional[str] = None) -> Dict[str, LazyTensor]:
    """HF state → ``fmt`` (mindformers | mindformers-mcore); ``qkv`` / ``mlp`` fuse those
    projections with a layout (contiguous | interleaved), None keeps them apart. Lazy: a fused
    tensor reads its parts only when it is loaded."""
    if fmt not in MAPS:
        raise ValueError(f"unknown checkpoint format {fmt!r}; known: {', '.join(MAPS)}")
    layouts = _layouts(qkv, mlp)
    names = rename(list(state), MAPS[fmt])
    out = {names[k]: v for k, v in state.items()}
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
                qkv: Optional[str] = None, mlp: Optional[str] = None) -> Dict[str, LazyTensor]:
    """``fmt`` state → HF. Fused tensors present are split with their layout; ``rows`` gives the
    parts' row counts (``part_rows``)."""
    if fmt not in MAPS:
        raise ValueError(f"unknown checkpoint format {fmt!r}; known: {', '.join(MAPS)}")
    layouts = _layouts(qkv, mlp)
    out = dict(state)
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
    return {names[k]: v for k, v in out.items()}


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
