"""LoRA adapters between PEFT naming and mindformers' two namings.

PEFT: ``base_model.model.<HF module>.lora_A.weight`` [r, in] / ``.lora_B.weight`` [out, r].
mindformers legacy: ``<legacy module>.lora_a`` / ``.lora_b`` (same shapes, no transpose).
mindformers Mcore: ``<mcore module>.lora_A.weight`` / ``.lora_B.weight``; a LoRA on a fused
``linear_qkv`` (or ``linear_fc1``) has one A and one B with the fused rows. It exports exactly to
per-projection PEFT adapters: each projection gets a copy of A and its rows of B (the layout undone),
since (B·A)[rows] = B[rows]·A. The reverse (three independent A's into one) is not exact at rank r.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional

import numpy as np

from mindqwen.io.convert import inverse, rename, unfuse
from mindqwen.io.key_maps import FUSIONS, MAPS

PEFT_PREFIX = "base_model.model."
_SUFFIX = {"mindformers": (".lora_a", ".lora_b"), "mindformers-mcore": (".lora_A.weight", ".lora_B.weight")}


def mindformers_to_peft(state: Dict[str, np.ndarray], fmt: str, num_kv_heads: int, rows: Dict[str, List[int]],
                        qkv: Optional[str] = None, mlp: Optional[str] = None) -> Dict[str, np.ndarray]:
    """A mindformers LoRA state (``fmt``) → PEFT keys; fused A/B are split per projection."""
    if fmt not in _SUFFIX:
        raise ValueError(f"unknown adapter format {fmt!r}; known: {', '.join(_SUFFIX)}")
    suffix_a, suffix_b = _SUFFIX[fmt]
    modules = {}
    for key, value in state.items():
        for side, suffix in (("A", suffix_a), ("B", suffix_b)):
            if key.endswith(suffix):
                modules.setdefault(key[:-len(suffix)], {})[side] = value
                break
        else:
            raise KeyError(f"adapter tensor {key} is not a LoRA A/B ({suffix_a} / {suffix_b})")
    layouts = {"qkv": qkv, "mlp": mlp}
    split = {}  # unfused module → {"A", "B"}
    for module, ab in modules.items():
        for fused, parts, kind in FUSIONS[fmt]:
            m = re.fullmatch(re.escape(fused.replace(".{p}", "")).replace(r"\{i\}", r"(?P<i>\d+)"), module)
            if m:
                if layouts[kind] is None:
                    raise ValueError(f"{module} is fused: give its layout ({kind}=contiguous|interleaved)")
                pieces = unfuse(ab["B"], rows[kind], kind, num_kv_heads, layouts[kind] == "interleaved")
                for part, b in zip(parts, pieces):
                    split[part.replace(".{p}", "").format(**m.groupdict())] = {"A": ab["A"].copy(), "B": b}
                break
        else:
            split[module] = ab
    names = rename([f"{m}.weight" for m in split], inverse(MAPS[fmt]))
    out = {}
    for module, ab in split.items():
        hf = names[f"{module}.weight"][:-len(".weight")]
        out[f"{PEFT_PREFIX}{hf}.lora_A.weight"], out[f"{PEFT_PREFIX}{hf}.lora_B.weight"] = ab["A"], ab["B"]
    return out


def peft_to_mindformers(state: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """PEFT keys → mindformers legacy LoRA keys (``…attention.wq.lora_a``), as its converter expects."""
    out = {}
    for key, value in state.items():
        m = re.fullmatch(re.escape(PEFT_PREFIX) + r"(.+)\.lora_([AB])\.weight", key)
        if not m:
            raise KeyError(f"adapter tensor {key} is not a PEFT LoRA A/B")
        module = rename([f"{m.group(1)}.weight"], MAPS["mindformers"])[f"{m.group(1)}.weight"][:-len(".weight")]
        out[f"{module}.lora_{m.group(2).lower()}"] = value
    return out
