"""MindIR export: a prefill and a decode graph with the KV cache as inputs/outputs, a manifest,
the ``converter_lite`` configs, a stand-alone runner and a parity report.

    folder/
      prefill.mindir     (B, S) prompt, dynamic batch and sequence (converter gears per bucket)
      decode.mindir      (B, 1) next token, dynamic batch
                         (above 1 GB of weights MindSpore writes <name>_graph.mindir and the
                         weights in <name>_variables/; the manifest names the file written)
      manifest.json      inputs, shapes (-1 = dynamic), dtypes, cache layout, tokenizer, generation
      run_exported.py    greedy generation through the graphs: MindSpore (GraphCell) or Lite
      lite/              converter_lite configs + convert.sh for the target (Ascend 310 …)
      tokenizer/         the tokenizer files, when given
      parity.json        exported graphs vs the eager model, run in a fresh process

LoRA is merged into a plain copy of the model (the caller's model is untouched); the copy is
built with hand-written RMSNorm/attention (no Ascend-only fused kernels), so the graph
converts for any Ascend target. In fp16 exports the attention softmax, RMSNorm and rotary
stay fp32 (the model casts them), which is what keeps Qwen's large logits from overflowing.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

from mindqwen.config import ExecutionOptions, QwenConfig
from mindqwen.export import lite
from mindqwen.io.atomic import atomic_folder
from mindqwen.io.hf import no_init_parameters
from mindqwen.io.jsonfile import write_json
from mindqwen.lora import lora_layers
from mindqwen.models.graph import in_mode
from mindqwen.models.kv_cache import (INPUT_NAMES, OUTPUT_NAMES, STATE_NAMES, CachedStep, CacheLayout,
                                      linear_state_shapes)
from mindqwen.models.qwen import QwenForCausalLM

DTYPES = {"float32": ms.float32, "float16": ms.float16}
# Exported graphs vs the same steps run eagerly, per export dtype, and (fp32) vs the full
# forward without a cache: the golden references' fp32 budget for a different summation order.
PARITY_TOLERANCE = {"float32": 1e-5, "float16": 1e-2}
FULL_TOLERANCE = 5e-5
RUNNER = os.path.join(os.path.dirname(__file__), "run_exported.py")


def deploy_copy(model: QwenForCausalLM, dtype: str = "float32", max_seq_len: Optional[int] = None) -> QwenForCausalLM:
    """A plain (LoRA merged in float64, no fused kernels, no float64 op) copy of ``model`` in ``dtype``;
    ``max_seq_len``: its rotary cos/sin come from a table of that many positions, all an
    exported cache holds (``ExecutionOptions.rotary_table``), None: computed per call."""
    merged = {f"{path}.weight": layer.merged_weight_np() for path, layer in lora_layers(model).items()}
    source = {p.name: p for p in model.get_parameters()}
    with no_init_parameters():  # every weight is set below: no random init to pay for
        copy = QwenForCausalLM(model.config, DTYPES[dtype], use_fused_ops=False,
                               options=ExecutionOptions(rotary_table=max_seq_len, float64=False))
    np_dtype = np.dtype(dtype)  # "float32" | "float16": the same names in NumPy
    for p in copy.get_parameters():
        value = merged[p.name] if p.name in merged else source[p.name].float().asnumpy()
        p.set_data(Tensor.from_numpy(np.ascontiguousarray(value, np_dtype)))  # adopted, not copied, at first run
    copy.set_train(False)
    return copy


def default_buckets(max_seq_len: int) -> List[int]:
    """Prompt-length gears: 64, 128, 256, … up to ``max_seq_len``."""
    buckets, n = [], 64
    while n < max_seq_len:
        buckets.append(n)
        n *= 2
    return buckets + [max_seq_len]


def graph_inputs(config: QwenConfig, max_seq_len: int, seq_len: Optional[int], dtype: str) -> List[dict]:
    """Input signature of the step graph; ``seq_len`` None = dynamic (-1). Batch is dynamic.
    A hybrid model's linear-attention states (fp32, fixed size) follow the cache."""
    layout = CacheLayout.of(config, -1, max_seq_len)
    t = -1 if seq_len is None else seq_len
    shapes = ([-1, t], [-1, t], [-1, max_seq_len], [-1, t], list(layout.shape), list(layout.shape))
    dtypes = ("int32",) * 4 + (dtype, dtype)
    inputs = [{"name": n, "shape": s, "dtype": d} for n, s, d in zip(INPUT_NAMES, shapes, dtypes)]
    return inputs + state_specs(config)


def state_specs(config: QwenConfig) -> List[dict]:
    """A hybrid model's linear-attention states as graph inputs/outputs (batch -1); [] for other models."""
    return [{"name": n, "shape": list(s), "dtype": "float32"}
            for n, s in zip(STATE_NAMES, linear_state_shapes(config, -1))]


def graph_specs(config: QwenConfig, max_seq_len: int, dtype: str, buckets: Sequence[int] = ()) -> Dict[str, dict]:
    """The manifest's ``graphs``: file, inputs and outputs of prefill and decode. Prefill has a
    dynamic sequence axis, except a hybrid model's: its chunked delta rule runs one state update
    per chunk of the prompt, a static count, so it has one prefill graph per bucket (``prefill_<S>``)."""
    layout = CacheLayout.of(config, -1, max_seq_len)
    outputs = [{"name": "logits", "shape": [-1, config.vocab_size], "dtype": "float32"}] + [
        {"name": n, "shape": list(layout.shape), "dtype": dtype} for n in OUTPUT_NAMES[1:]] + state_specs(config)
    prefills = ([(f"prefill_{s}", s) for s in buckets] if "linear_attention" in config.layer_types
                else [("prefill", None)])
    return {name: {"file": f"{name}.mindir", "inputs": graph_inputs(config, max_seq_len, seq_len, dtype),
                   "outputs": outputs} for name, seq_len in prefills + [("decode", 1)]}


def export_mindir(cell: nn.Cell, inputs: List[Tensor], folder: str, name: str) -> str:
    """``ms.export`` ``cell`` as ``folder``/``name``; returns the graph file it wrote:
    ``name.mindir``, or, above 1 GB of weights, ``name_graph.mindir`` with the weights in
    ``name_variables/`` beside it (``ms.load`` and converter_lite read them from there)."""
    ms.export(cell, *inputs, file_name=os.path.join(folder, name), file_format="MINDIR")
    for file in (f"{name}.mindir", f"{name}_graph.mindir"):
        if os.path.isfile(os.path.join(folder, file)):
            return file
    raise RuntimeError(f"ms.export wrote neither {name}.mindir nor {name}_graph.mindir in {folder}")


def placeholders(inputs: List[dict]) -> List[Tensor]:
    return [Tensor(shape=[None if d < 0 else d for d in i["shape"]], dtype=getattr(ms, i["dtype"]))
            for i in inputs]


def export_model(model: QwenForCausalLM, folder: str, batch_sizes: Sequence[int] = (1,),
                 max_seq_len: int = 2048, seq_buckets: Optional[Sequence[int]] = None,
                 dtype: str = "float32", target: str = "Ascend310", precision_mode: Optional[str] = None,
                 tokenizer_files: Sequence[str] = (), generation: Optional[dict] = None,
                 parity: bool = True) -> dict:
    """Export prefill + decode MindIR graphs and everything needed to run them; returns the manifest.

    Written to a temporary folder beside ``folder`` and renamed into place at the end, so an
    error never leaves a half-written export. The parity report (``parity.json``) runs the
    exported graphs in a fresh Python process and compares them with ``model``'s own forward.

    Raises:
        ValueError: bad sizes, dtype or target (before anything is written).
        RuntimeError: the exported graphs disagree with the eager model.
    """
    buckets = sorted(set(seq_buckets or default_buckets(max_seq_len)))
    check_export(model.config, batch_sizes, max_seq_len, buckets, dtype, target, precision_mode, tokenizer_files)
    with atomic_folder(folder) as staging:
        plain = deploy_copy(model, dtype, max_seq_len)
        graphs = graph_specs(plain.config, max_seq_len, dtype, buckets)
        for name, graph in graphs.items():
            graph["file"] = export_mindir(CachedStep(plain), placeholders(graph["inputs"]), staging, name)
        manifest = write_manifest(staging, model.config, graphs, dtype, max_seq_len, list(batch_sizes), buckets,
                                  target, precision_mode, tokenizer_files, generation)
        if parity:
            report = check_parity(model, staging, manifest, exported=plain)
            if not report["passed"]:
                raise RuntimeError(f"exported graphs disagree with the eager model: {json.dumps(report)}")
    return manifest


def check_export(config: QwenConfig, batch_sizes: Sequence[int], max_seq_len: int, buckets: List[int], dtype: str,
                 target: str, precision_mode: Optional[str], tokenizer_files: Sequence[str]) -> None:
    """Every argument of an export of a model with ``config`` checked before anything is written
    (and by ``mindqwen validate`` before training): ``ValueError`` naming it (``FileNotFoundError``
    for a tokenizer file)."""
    if dtype not in DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not batch_sizes or any(not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes must be positive integers, got {list(batch_sizes)}")
    limit = config.context_length
    if not 1 < max_seq_len <= limit:
        raise ValueError(f"max_seq_len must be in 2..{limit} ({config.context_rule}), got {max_seq_len}")
    if buckets[0] < 1 or buckets[-1] > max_seq_len:
        raise ValueError(f"seq_buckets must lie in 1..max_seq_len ({max_seq_len}), got {buckets}")
    if len(batch_sizes) * len(buckets) > lite.MAX_GEARS:
        raise ValueError(f"{len(batch_sizes)} batch sizes × {len(buckets)} buckets exceed the "
                         f"{lite.MAX_GEARS} gears converter_lite accepts")
    lite.check_target(target, precision_mode)
    for path in tokenizer_files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: tokenizer file not found")


def write_manifest(folder: str, config: QwenConfig, graphs: Dict[str, dict], dtype: str, max_seq_len: int,
                   batch_sizes: List[int], buckets: List[int], target: str, precision_mode: Optional[str],
                   tokenizer_files: Sequence[str] = (), generation: Optional[dict] = None,
                   image: Optional[dict] = None) -> dict:
    """Beside the graphs in ``folder``: manifest.json, the runner, lite/ and tokenizer/; returns
    the manifest. ``image``: how an image-conditioned export takes its image."""
    c = config
    manifest = {
        "format": "mindqwen-export/1",
        "model": {k: getattr(c, k) for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                                             "num_attention_heads", "num_key_value_heads", "head_dim",
                                             "layer_types")},
        "dtype": dtype, "max_seq_len": max_seq_len, "batch_sizes": batch_sizes, "seq_buckets": buckets,
        "cache": {"layout": "attention layers, batch, kv_heads, slot, head_dim", "dtype": dtype,
                  "shape": list(CacheLayout.of(c, -1, max_seq_len).shape),
                  "padding": "left: the prompt fills slots 0..S-1, decode step i writes slot S+i"},
        # A hybrid model's linear-attention layers carry these instead of a cache: zeros before prefill,
        # then each call's outputs go into the next; fixed size, whatever the sequence length.
        "states": state_specs(c),
        "graphs": graphs, "tokenizer": copy_tokenizer(tokenizer_files, folder),
        "generation": {"eos_token_id": c.eos_token_id, **(generation or {})},
    }
    if image is not None:
        manifest["image"] = image
    manifest["lite"] = lite.write_configs(manifest, folder, target, precision_mode)
    shutil.copy(RUNNER, os.path.join(folder, "run_exported.py"))
    write_json(os.path.join(folder, "manifest.json"), manifest)
    return manifest


def copy_tokenizer(files: Sequence[str], folder: str) -> Optional[dict]:
    if not files:
        return None
    os.makedirs(os.path.join(folder, "tokenizer"))
    names = []
    for path in files:
        shutil.copy(path, os.path.join(folder, "tokenizer", os.path.basename(path)))
        names.append(f"tokenizer/{os.path.basename(path)}")
    return {"files": names}


def check_parity(model: QwenForCausalLM, folder: str, manifest: dict, new_tokens: int = 6,
                 exported: Optional[QwenForCausalLM] = None) -> dict:
    """The LM export's parity report (``parity_report``): the eager steps run on the exported
    weights; the full forward is ``model`` with LoRA merged in fp32 and, for a LoRA model,
    ``model`` itself (``unmerged_lora``). ``exported``: the deploy copy the graphs were exported
    from, if the caller still holds it (else it is built again)."""
    prompts = parity_prompts(manifest, new_tokens, model.config.vocab_size)
    excess = len(prompts[0]) + new_tokens - model.config.max_position_embeddings
    if (model.config.rope_scaling or {}).get("rope_type") == "dynamic" and excess > 0:
        # Past max_position_embeddings dynamic rope's frequencies follow the length: a cached key
        # keeps those of the step that wrote it, a full forward gives every key the last length's.
        prompts = [p[:max(1, len(p) - excess)] for p in prompts]
    if exported is None:
        exported = deploy_copy(model, manifest["dtype"], manifest["max_seq_len"])
    full = exported if manifest["dtype"] == "float32" else deploy_copy(model, "float32")
    step = CachedStep(exported)
    forwards = {"full_recompute": full}
    if lora_layers(model):  # W + s·B·A rounds differently from the two-branch sum (PEFT: 1.6e-5)
        forwards["unmerged_lora"] = model
    return parity_report(folder, manifest, dict.fromkeys(manifest["graphs"], step), forwards, prompts, new_tokens)


def parity_prompts(manifest: dict, new_tokens: int, vocab_size: int, shortest: int = 1) -> List[List[int]]:
    """Random prompts for the largest batch, each row 3 tokens shorter than the one before:
    left padding on every row but the first."""
    rng = np.random.default_rng(0)
    longest = min(manifest["seq_buckets"][0], manifest["max_seq_len"] - new_tokens)
    return [rng.integers(0, vocab_size, max(shortest, longest - 3 * i)).tolist()
            for i in range(max(manifest["batch_sizes"]))]


def parity_report(folder: str, manifest: dict, steps: Dict[str, nn.Cell], forwards: Dict[str, nn.Cell],
                  prompts: List[List[int]], new_tokens: int, pixels: Optional[np.ndarray] = None) -> dict:
    """Greedy generation through the exported graphs in a fresh process (no mindqwen import),
    compared with (1) the same steps run eagerly (PyNative): ``steps`` maps each graph of the
    manifest to its Cell; and (2) each of ``forwards``, a model's full forward without a cache
    over every prefix the graphs saw (``forwards["full_recompute"]`` must agree within
    ``FULL_TOLERANCE`` for an fp32 export to pass). ``pixels``: one image per prompt, for an
    image-conditioned export. Writes and returns ``parity.json``."""
    from mindqwen.export import run_exported
    tokens, logits = run_exported_process(folder, prompts, new_tokens, pixels)
    with in_mode(ms.PYNATIVE_MODE):
        eager_tokens, eager_logits = run_exported.generate(
            lambda name, arrays: [o.asnumpy() for o in steps[name](*map(Tensor, arrays))], manifest, prompts,
            new_tokens, pixels)
        compared = {name: _compare(net, prompts, pixels, tokens, logits) for name, net in forwards.items()}
    dtype = manifest["dtype"]
    eager = {"tokens_identical": bool(np.array_equal(eager_tokens, tokens)),
             "max_abs_logit_diff": float(np.abs(eager_logits - logits).max()) if eager_logits.shape == logits.shape
             else float("inf")}
    full = compared["full_recompute"]
    report = {"eager_same_steps": eager, **compared, "tokens": tokens.tolist(),
              "tolerance": PARITY_TOLERANCE[dtype], "full_tolerance": FULL_TOLERANCE, "batch_size": len(prompts),
              "prompt_lengths": [len(p) for p in prompts], "new_tokens": new_tokens, "dtype": dtype}
    # Without a cache the sums run in another order: ~1e-5 on logits of |x| ≈ 10 is fp32 noise.
    report["passed"] = bool(eager["tokens_identical"] and eager["max_abs_logit_diff"] <= report["tolerance"]
                            and (dtype != "float32" or (full["tokens_identical"]
                                                        and full["max_abs_logit_diff"] <= FULL_TOLERANCE)))
    write_json(os.path.join(folder, "parity.json"), report)
    return report


def run_exported_process(folder: str, prompts: List[List[int]], new_tokens: int,
                         pixels: Optional[np.ndarray] = None):
    """The export's own runner in a fresh process: tokens (B, N), logits (N, B, V). ``pixels``:
    one image per prompt, for an image-conditioned export."""
    with tempfile.TemporaryDirectory() as tmp:
        request, dump = os.path.join(tmp, "prompts.json"), os.path.join(tmp, "out.npz")
        with open(request, "w") as f:
            json.dump(prompts, f)
        cmd = [sys.executable, os.path.join(folder, "run_exported.py"), folder, "--backend", "mindspore",
               "--prompts", request, "--max-new-tokens", str(new_tokens), "--dump", dump]
        if pixels is not None:
            np.save(os.path.join(tmp, "pixels.npy"), pixels)
            cmd += ["--pixels", os.path.join(tmp, "pixels.npy")]
        # Unfused, as the eager steps it is compared with (PyNative) and as Lite runs the graphs:
        # CPU graph-kernel fusion reorders the sums (measured 4e-5 on the demo's logits).
        env = {**os.environ, "GLOG_v": "3", "MS_DEV_GRAPH_KERNEL_FLAGS": "--opt_level=0"}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"running the exported graphs failed:\n{r.stderr[-2000:]}")
        out = np.load(dump)
        return out["tokens"], out["logits"]


def _compare(model: nn.Cell, prompts, pixels, tokens, logits) -> Dict[str, object]:
    """``model``'s full forward, no cache (``pixels`` passed after the ids for a fused
    multimodal model), over each prefix the exported graphs saw."""
    model.set_train(False)
    s = max(len(p) for p in prompts)
    image = () if pixels is None else (Tensor(pixels[:len(prompts)]),)
    diff, same = 0.0, True
    for i in range(tokens.shape[1]):
        ids = np.zeros((len(prompts), s + i), np.int32)
        mask = np.zeros_like(ids)
        for r, p in enumerate(prompts):
            ids[r, s - len(p):], mask[r, s - len(p):] = list(p) + tokens[r, :i].tolist(), 1
        eager = model(Tensor(ids), *image, Tensor(mask)).asnumpy()[:, -1].astype(np.float32)
        diff = max(diff, float(np.abs(eager - logits[i]).max()))
        same = same and bool((eager.argmax(-1) == tokens[:, i]).all())
    return {"tokens_identical": same, "max_abs_logit_diff": diff}
