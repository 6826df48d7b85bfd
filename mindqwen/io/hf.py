"""HF checkpoint folders ⇄ model parameters (``QwenForCausalLM.from_pretrained`` builds on it).

A folder holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Since mindqwen parameter names equal HF names, loading is the
identity map plus :func:`sanitize` (stale rotary buffers, a stored copy of a tied head); a
mixture of experts' per-expert tensors are stacked into its ``ExpertLinear`` weights and split
back on saving (``mindqwen.io.experts``).
"""
from __future__ import annotations

import json
import os
import re
from contextlib import nullcontext
from functools import partial
from typing import Dict, List, Optional, Tuple

import mindspore as ms
import numpy as np
from tqdm import tqdm

from mindqwen.config import QwenConfig
from mindqwen.io.atomic import staged_files
from mindqwen.io.experts import expert_slice, stack_experts, unfuse_experts, unstack_experts
from mindqwen.io.linear_attention import fuse_projections, unfuse_projections
from mindqwen.io.jsonfile import read_json
from mindqwen.io.safetensors import CheckpointError, LazyTensor, SafetensorsFile, save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": (ms.float32, np.float32), "float16": (ms.float16, np.float16),
          "bfloat16": (ms.bfloat16, np.float32)}
_STALE = re.compile(r".*\.rotary_emb\.inv_freq$")
# A vision-language checkpoint's language model sits under this prefix (Qwen3.5's published folders).
LANGUAGE_MODEL = "model.language_model."
# What a text model has no part for: the vision tower, multi-token-prediction layers.
_NOT_TEXT = re.compile(r"^(model\.visual|visual|mtp)\.")

try:  # skips random init of weights that the checkpoint replaces (one copy of the model in RAM)
    from mindspore.nn.utils import no_init_parameters
except ImportError:  # pragma: no cover - removed in a later MindSpore
    no_init_parameters = nullcontext


def open_checkpoint(folder: str, allow_non_finite: bool = False) -> Dict[str, SafetensorsFile]:
    """Map every tensor key of an HF folder to its opened (lazily read) safetensors file
    (whose ``get`` refuses NaN or inf unless ``allow_non_finite``)."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"{folder}: checkpoint folder not found")
    index_path, single_path = os.path.join(folder, INDEX_FILE), os.path.join(folder, SINGLE_FILE)
    if os.path.isfile(index_path):
        weight_map = read_json(index_path, CheckpointError, "safetensors index")
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: not a safetensors index (no weight_map)")
        files = {name: SafetensorsFile(os.path.join(folder, name), allow_non_finite)
                 for name in sorted(set(weight_map.values()))}
        for key, name in weight_map.items():
            if key not in files[name]:
                raise CheckpointError(f"{os.path.join(folder, name)}: tensor {key} listed in "
                                      f"{INDEX_FILE} is not in the file")
        return {key: files[name] for key, name in weight_map.items()}
    if os.path.isfile(single_path):
        f = SafetensorsFile(single_path, allow_non_finite)
        return {key: f for key in f.keys()}
    others = [n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".ckpt"))]
    hint = f" (found {', '.join(sorted(others))}: convert it to safetensors first)" if others else ""
    raise CheckpointError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")


def sanitize(keys: List[str], config: QwenConfig) -> Dict[str, str]:
    """Checkpoint key → model parameter name, dropping keys the model rightly does not have.

    Drops stale ``rotary_emb.inv_freq`` buffers (old checkpoints) and, for tied models, a stored
    ``lm_head.weight`` (Qwen3 tied checkpoints store both; the embedding is authoritative). A
    vision-language folder's language model (``model.language_model.*``) is the text model's
    ``model.*``; its vision tower and multi-token-prediction layers are not part of it
    (``text_only_note`` says so).
    """
    return {k: "model." + k[len(LANGUAGE_MODEL):] if k.startswith(LANGUAGE_MODEL) else k for k in keys
            if not _STALE.match(k) and not _NOT_TEXT.match(k)
            and not (config.tie_word_embeddings and k == "lm_head.weight")}


def text_only_note(keys: List[str], folder: str) -> Optional[str]:
    """One line on the tensors of ``folder`` a text model leaves out (a vision tower, multi-token
    prediction), or None: they are not loaded, and saving the model writes the text model only."""
    left = sorted({k.split(".")[1] if k.startswith("model.") else k.split(".")[0] for k in keys if _NOT_TEXT.match(k)})
    if not left:
        return None
    count = sum(1 for k in keys if _NOT_TEXT.match(k))
    return (f"{folder}: loading the language model only; {count} tensors of {', '.join(left)} stay in the folder "
            f"(saving this model writes a text checkpoint without them)")


def load_weights(model: ms.nn.Cell, folder: str, strict: bool = True,
                 allow_non_finite: bool = False) -> Tuple[List[str], List[str]]:
    """Load an HF folder's tensors into ``model`` by name, checking keys and shapes.

    Args:
        model: a ``QwenForCausalLM`` (or a Cell whose parameter names are HF names).
        folder: HF checkpoint folder.
        strict: raise on missing or unexpected keys (else return them).
        allow_non_finite: load tensors holding NaN or inf (else ``CheckpointError`` naming them).

    Returns:
        (missing, unexpected) key lists (empty when ``strict``).

    Raises:
        CheckpointError: naming the file and the key(s).
    """
    files = open_checkpoint(folder, allow_non_finite)
    config: QwenConfig = model.config
    fused = unfuse_experts({k: tuple(f.shape(k)) for k, f in files.items()}, lambda k: files[k].get(k, np.float32))
    sources = {source for source, _ in fused.values()}
    names = sanitize([k for k in files if k not in sources] + list(fused), config)
    note = text_only_note(list(files), folder)
    if note:
        print(note)
    expected = {name: t.shape for name, t in model_state(model).items()}  # HF name → shape
    missing = sorted(set(expected) - set(names.values()))
    unexpected = sorted(k for k, n in names.items() if n not in expected)
    if strict and (missing or unexpected):
        parts = [f"missing keys {_short(missing)}" if missing else "",
                 f"unexpected keys {_short(unexpected)}" if unexpected else ""]
        raise CheckpointError(f"{folder}: checkpoint does not match the "
                              f"{config.model_type} config: " + "; ".join(p for p in parts if p))
    params = {p.name: p for p in model.get_parameters()}
    state = {}
    for key, name in names.items():
        if name not in expected:
            continue
        source, sliced = fused.get(key, (key, None))  # a fused expert tensor's slice, or the key's own
        f = files[source]
        shape = sliced.shape if sliced is not None else tuple(f.shape(key))
        if shape != tuple(expected[name]):
            raise CheckpointError(f"{f.path}: tensor {key} has shape {list(shape)}, "
                                  f"the model expects {list(expected[name])}")
        target = params.get((expert_slice(name) or (name,))[0])  # None: a fused projection (unfuse_projections)
        np_dtype = np.dtype(np.float16 if target is not None and target.dtype == ms.float16 else np.float32)
        state[name] = sliced if sliced is not None else LazyTensor(shape, np_dtype, partial(f.get, key, np_dtype))
    state = unfuse_projections(state, config)  # Qwen3-Next's fused linear-attention projections
    # HF's per-expert tensors → the model's stacked ones; a projection missing some experts
    # (strict=False) gets the present ones slice by slice
    state.update(stack_experts(state, "stacked", getattr(config, "num_experts", 0)))
    slices: Dict[str, Dict[int, LazyTensor]] = {}
    for name, t in tqdm(sorted(state.items()), desc="loading", unit="tensor", leave=False, disable=len(state) < 64):
        if name in params:
            params[name].set_data(ms.Tensor.from_numpy(t.load()).astype(params[name].dtype))
        else:
            stacked, e = expert_slice(name)
            slices.setdefault(stacked, {})[e] = t
    for stacked, present in slices.items():  # one copy of the stacked tensor each
        whole = params[stacked].asnumpy()
        for e, t in present.items():
            whole[e] = t.load()
        params[stacked].set_data(ms.Tensor.from_numpy(whole).astype(params[stacked].dtype))
    return missing, unexpected


def check_dtype(dtype: Optional[str], device_target: Optional[str] = None) -> None:
    """A parameter dtype name this device computes in (bf16 has no CPU kernels)."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "bfloat16" and device_target == "CPU":
        raise ValueError("dtype='bfloat16' cannot compute on CPU (MindSpore has no bf16 CPU "
                         "kernels); load with dtype='float32'")


def save_pretrained(model: ms.nn.Cell, folder: str, dtype: Optional[str] = None,
                    max_shard_size: str = "5GB", layout=None) -> None:
    """Write ``model`` as an HF folder: config.json and safetensors, sharded above the limit.

    Files are staged in a temporary folder and moved into place, the index last, so an
    interrupted save never leaves a folder that loads as complete but is not.

    Args:
        dtype: stored dtype ("float32", "float16", "bfloat16"); default: the parameters' dtype.
        max_shard_size: e.g. "5GB", "200MB" or a byte count.
        layout: maps the HF-named tensors to the folder's layout (the original Qwen's own).
    """
    check_dtype(dtype)
    lora = [p.name for p in model.get_parameters() if ".lora_" in p.name]
    if lora:  # an HF folder has no place for them: transformers would load the base model silently
        raise ValueError(f"the model has LoRA adapters ({lora[0]}, …): save_adapter(model, folder) writes them "
                         "in PEFT format; merge_and_unload(model).save_pretrained(folder) writes the merged weights")
    tensors = model_state(model, dtype)
    save_tensors(folder, layout(tensors) if layout else tensors, model.config.to_hf(), dtype, max_shard_size)


def save_tensors(folder: str, tensors: Dict[str, LazyTensor], hf_config: dict, dtype: Optional[str] = None,
                 max_shard_size: str = "5GB") -> None:
    """Write lazy tensors (HF names) and ``hf_config`` as an HF folder, staged and moved into
    place; tensors are read one at a time, so peak memory stays near the largest one."""
    limit = parse_size(max_shard_size)
    shards: List[Dict[str, LazyTensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = int(np.prod(t.shape)) * (2 if dtype == "bfloat16" else t.dtype.itemsize)
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    with staged_files(folder) as (stage, written):
        hf_config = dict(hf_config, torch_dtype=dtype or _dtype_name(next(iter(tensors.values())).dtype))
        _write_json(os.path.join(stage, "config.json"), hf_config)
        names = ([SINGLE_FILE] if len(shards) == 1 else
                 [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
        for name, shard in tqdm(list(zip(names, shards)), desc="saving", unit="shard",
                                disable=len(shards) == 1):
            save_file(shard, os.path.join(stage, name), bf16=dtype == "bfloat16")
        if len(shards) > 1:
            total = sum(int(np.prod(t.shape)) * t.dtype.itemsize for t in tensors.values())
            weight_map = {k: n for n, shard in zip(names, shards) for k in shard}
            _write_json(os.path.join(stage, INDEX_FILE),
                        {"metadata": {"total_size": total}, "weight_map": weight_map})
        written += names + ["config.json"] + ([INDEX_FILE] if len(shards) > 1 else [])  # the index lands last
        stale = [SINGLE_FILE, INDEX_FILE] + [n for n in os.listdir(folder)
                                             if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", n)]
        for name in stale:  # a previous save in another layout must not shadow this one
            if os.path.exists(os.path.join(folder, name)) and name not in written:
                os.remove(os.path.join(folder, name))


def model_state(model: ms.nn.Cell, dtype: Optional[str] = None) -> Dict[str, LazyTensor]:
    """HF name → lazy tensor (in ``dtype``, default the parameter's) of every parameter of
    ``model``: its own names, a mixture of experts' stacked experts split into HF's per-expert
    tensors, Qwen3-Next's linear-attention projections fused as its checkpoints store them."""
    state = {p.name: _lazy(p, dtype) for p in model.get_parameters()}
    state.update(unstack_experts(state, "stacked", getattr(model.config, "num_experts", 0)))
    return fuse_projections(state, model.config)


def _lazy(p: ms.Parameter, dtype: Optional[str]) -> LazyTensor:
    np_dtype = np.dtype(DTYPES[dtype][1] if dtype else
                        (np.float16 if p.dtype == ms.float16 else np.float32))

    def load() -> np.ndarray:
        return p.astype(ms.float32).asnumpy().astype(np_dtype)
    return LazyTensor(tuple(p.shape), np_dtype, load)


def _dtype_name(dtype: np.dtype) -> str:
    return {np.dtype(np.float16): "float16"}.get(np.dtype(dtype), "float32")


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def parse_size(size) -> int:
    """'5GB' / '200MB' / '10KB' / int → bytes (decimal units, as HF uses)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B)\s*", str(size).upper())
    if not m:
        raise ValueError(f"max_shard_size must look like '5GB', '200MB' or a byte count, got {size!r}")
    return int(float(m.group(1)) * {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}[m.group(2)])


def _short(keys: List[str], n: int = 6) -> str:
    more = f" … (+{len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more
