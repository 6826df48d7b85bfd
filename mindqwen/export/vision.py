"""Export of a fused multimodal model (``mindqwen.multimodal.fusion.MultimodalQwen``):

    export/
      lm/            the language model, LoRA merged: prefill + decode MindIR, manifest, lite/,
                     parity.json — exactly what ``mindqwen.export.export_model`` writes
      vision.mindir  the vision tower (ViT + projector, LoRA merged): pixel_values
                     (B, 3, S, S) — or (B, T, 3, S, S) for video — float32 → vision tokens (B, Nv, H);
                     B is dynamic
      vision.json    its input/output shapes, the image transforms and its parity figures
      image/         image-conditioned generation (float32; converter_lite may lower it to fp16):
        image_kv.mindir  pixel_values → every cross-attention block's keys and values
                         (image_k_cache, image_v_cache: C, B, heads, Nv, D), once per image
        prefill.mindir, decode.mindir  the LM's step graphs with the cross-attention blocks, taking
                         image_k_cache, image_v_cache and vision_mask (B, T, 1) after the KV cache
        manifest.json (with "image": token id, pixel shape, transforms), run_exported.py, lite/,
        tokenizer/, parity.json (a fresh process without mindqwen vs the eager steps and the
        full forward of the fused model)
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

from mindqwen.config import ExecutionOptions
from mindqwen.export.mindir import (check_export, default_buckets, export_mindir, export_model, graph_specs,
                                   parity_prompts, parity_report, placeholders, write_manifest)
from mindqwen.io.atomic import atomic_folder
from mindqwen.io.hf import no_init_parameters
from mindqwen.io.jsonfile import read_json, write_json
from mindqwen.lora import lora_layers
from mindqwen.models.kv_cache import ImageCachedStep, ImageKeysValues
from mindqwen.models.qwen import QwenForCausalLM
from mindqwen.multimodal.data import IMAGENET_MEAN, IMAGENET_STD
from mindqwen.multimodal.fusion import MultimodalQwen
from mindqwen.multimodal.vision import Projector, VisionEncoder

VISION_TOLERANCE = 1e-4  # merged W + s·B·A vs the two-branch sum, on tokens of |x| ≈ 1–10


class VisionTower(nn.Cell):
    """pixel_values → projector(vision(pixel_values)): the vision half of the fused model."""

    def __init__(self, vision: VisionEncoder, projector: Projector):
        super().__init__()
        self.vision, self.projector = vision, projector

    def construct(self, pixel_values):
        return self.projector(self.vision(pixel_values))


def plain_tower(model) -> VisionTower:
    """A LoRA-free copy of ``model``'s vision tower with LoRA merged in float64."""
    merged = {f"{path}.weight": layer.merged_weight_np() for path, layer in lora_layers(model).items()}
    source = {p.name: p for p in model.get_parameters()}
    tower = VisionTower(VisionEncoder(model.vision_config), Projector(model.vision_config.hidden_size,
                                                                      model.config.hidden_size))
    for p in tower.get_parameters():  # the same names: vision.*, projector.*
        value = merged[p.name] if p.name in merged else source[p.name].float().asnumpy()
        p.set_data(Tensor(value.astype(np.float32)))
    tower.set_train(False)
    return tower


def pixel_shape(config) -> list:
    """(-1 for the dynamic batch, [T,] 3, S, S)."""
    frames = [config.num_frames] if config.num_frames > 1 else []
    return [-1] + frames + [config.num_channels, config.image_size, config.image_size]


def transforms(config) -> dict:
    """The image transforms of training (``mindqwen.multimodal.data.image_transforms``), as data."""
    return {"resize": round(config.image_size * 256 / 224), "center_crop": config.image_size,
            "rescale": 1 / 255, "mean": IMAGENET_MEAN, "std": IMAGENET_STD, "layout": "CHW"}


def export_vision(model, folder: str) -> dict:
    """Write ``vision.mindir`` and ``vision.json`` into ``folder``; returns the JSON's content.

    Raises:
        RuntimeError: the exported graph disagrees with the eager tower.
    """
    c = model.vision_config
    tower = plain_tower(model)
    shape = pixel_shape(c)
    file = export_mindir(tower, [Tensor(shape=[None] + shape[1:], dtype=ms.float32)], folder, "vision")
    pixels = np.random.default_rng(0).normal(0, 1, [2] + shape[1:]).astype(np.float32)
    graph = nn.GraphCell(ms.load(os.path.join(folder, file)))
    exported = graph(Tensor(pixels)).asnumpy()
    was = model.training
    model.set_train(False)
    eager = model.projector(model.vision(Tensor(pixels))).asnumpy()  # the model as trained (LoRA unmerged)
    model.set_train(was)
    same = tower(Tensor(pixels)).asnumpy()
    parity = {"vs_same_weights": float(np.abs(exported - same).max()),
              "vs_unmerged_model": float(np.abs(exported - eager).max()), "tolerance": VISION_TOLERANCE}
    parity["passed"] = parity["vs_unmerged_model"] <= VISION_TOLERANCE
    info = {"file": file, "inputs": [{"name": "pixel_values", "shape": shape, "dtype": "float32"}],
            "outputs": [{"name": "vision_tokens", "shape": [-1, exported.shape[1], exported.shape[2]],
                         "dtype": "float32"}],
            "transforms": transforms(c),
            "cross_layers": list(model.cross_layers), "image_token_id": model.image_token_id, "parity": parity}
    write_json(os.path.join(folder, "vision.json"), info)
    if not parity["passed"]:
        raise RuntimeError(f"exported vision graph disagrees with the eager model: {parity}")
    return info


def export_multimodal(model, folder: str, batch_sizes: Sequence[int] = (1,), max_seq_len: int = 2048,
                      seq_buckets: Optional[Sequence[int]] = None, dtype: str = "float32",
                      target: str = "Ascend310", precision_mode: Optional[str] = None,
                      tokenizer_files: Sequence[str] = ()) -> dict:
    """``folder``/lm (the LM export, with its parity report), ``folder``/vision.mindir and
    ``folder``/image (image-conditioned generation); staged beside ``folder`` and renamed into
    place, so a failure leaves any earlier export as it was."""
    with atomic_folder(folder) as staging:
        export_model(model.lm, os.path.join(staging, "lm"), batch_sizes, max_seq_len, seq_buckets, dtype, target,
                     precision_mode, tokenizer_files)
        vision = export_vision(model, staging)
        image = export_image_graphs(model, os.path.join(staging, "image"), batch_sizes, max_seq_len, seq_buckets,
                                    target, precision_mode, tokenizer_files)
    lm_parity = read_json(os.path.join(folder, "lm", "parity.json"), RuntimeError, "LM parity report")
    print(f"exported {folder}: lm/ (prefill + decode MindIR, lite/), vision.mindir, image/; vision graph vs "
          f"eager: {vision['parity']['vs_unmerged_model']:.1e}; image-conditioned steps vs the full forward: "
          f"{image['full_recompute']['max_abs_logit_diff']:.1e}", flush=True)
    return {"folder": folder, "vision_parity": vision["parity"],
            "lm_parity": {k: lm_parity[k] for k in ("eager_same_steps", "full_recompute", "passed")},
            "image_parity": {k: image[k] for k in ("eager_same_steps", "full_recompute", "passed")}}


def plain_fused(model: MultimodalQwen, max_seq_len: Optional[int] = None) -> MultimodalQwen:
    """A LoRA-free float32 copy of the fused model (LoRA merged in float64, no fused kernels);
    ``max_seq_len``: rotary cos/sin from a table of that many positions (``deploy_copy``)."""
    merged = {layer.weight.name: layer.merged_weight_np() for layer in lora_layers(model).values()}
    source = {p.name: p for p in model.get_parameters()}
    with no_init_parameters():  # every weight is set below
        lm = QwenForCausalLM(model.config, ms.float32, use_fused_ops=False,
                             options=ExecutionOptions(rotary_table=max_seq_len))
        copy = MultimodalQwen(lm, model.vision_config, model.cross_layers, model.image_token_id)
    for p in copy.get_parameters():
        value = merged[p.name] if p.name in merged else source[p.name].float().asnumpy()
        p.set_data(Tensor(np.ascontiguousarray(value, np.float32)))
    copy.set_train(False)
    return copy


def image_graph_specs(model: MultimodalQwen, max_seq_len: int) -> dict:
    """The manifest's ``graphs`` of the image-conditioned export: the LM's step graphs with the
    image keys/values and the vision mask after the KV cache, and ``image_kv``."""
    c, image = model.config, model.cross_kv_shape(-1)
    graphs = graph_specs(c, max_seq_len, "float32")
    for name, graph in graphs.items():
        t = graph["inputs"][0]["shape"][1]
        graph["inputs"] += [{"name": "image_k_cache", "shape": image, "dtype": "float32"},
                            {"name": "image_v_cache", "shape": image, "dtype": "float32"},
                            {"name": "vision_mask", "shape": [-1, t, 1], "dtype": "float32"}]
    graphs["image_kv"] = {"file": "image_kv.mindir",
                          "inputs": [{"name": "pixel_values", "shape": pixel_shape(model.vision_config),
                                      "dtype": "float32"}],
                          "outputs": [{"name": "image_k_cache", "shape": image, "dtype": "float32"},
                                      {"name": "image_v_cache", "shape": image, "dtype": "float32"}]}
    return graphs


def export_image_graphs(model: MultimodalQwen, folder: str, batch_sizes: Sequence[int], max_seq_len: int,
                        seq_buckets: Optional[Sequence[int]], target: str, precision_mode: Optional[str],
                        tokenizer_files: Sequence[str] = ()) -> dict:
    """Write ``folder`` (image_kv, prefill and decode MindIR, manifest, runner, lite/, tokenizer/)
    and check it in a fresh process; returns the parity report.

    Raises:
        ValueError: bad sizes or target (before anything is written).
        RuntimeError: the exported graphs disagree with the eager model.
    """
    buckets = sorted(set(seq_buckets or default_buckets(max_seq_len)))
    check_export(model.config, batch_sizes, max_seq_len, buckets, "float32", target, precision_mode, tokenizer_files)
    plain = plain_fused(model, max_seq_len)
    graphs = image_graph_specs(plain, max_seq_len)
    os.makedirs(folder)
    steps = {"image_kv": ImageKeysValues(plain), "prefill": ImageCachedStep(plain), "decode": ImageCachedStep(plain)}
    for name, step in steps.items():
        graphs[name]["file"] = export_mindir(step, placeholders(graphs[name]["inputs"]), folder, name)
    v = model.vision_config
    image = {"token_id": model.image_token_id, "cross_layers": list(model.cross_layers),
             "pixel_shape": pixel_shape(v), "transforms": transforms(v)}
    manifest = write_manifest(folder, model.config, graphs, "float32", max_seq_len, list(batch_sizes), buckets,
                              target, precision_mode, tokenizer_files, image=image)
    report = image_parity(model, plain, steps, folder, manifest)
    if not report["passed"]:
        raise RuntimeError(f"exported image-conditioned graphs disagree with the eager model: {report}")
    return report


def image_parity(model: MultimodalQwen, plain: MultimodalQwen, steps: dict, folder: str, manifest: dict,
                 new_tokens: int = 6) -> dict:
    """``parity_report`` on a left-padded batch, each row with its own image between text: the
    eager steps run on the exported weights (``plain``, with its ``steps``); the full forward is
    ``plain`` and, for a LoRA model, the model as trained (``unmerged_lora``)."""
    prompts = parity_prompts(manifest, new_tokens, model.image_token_id, shortest=2)
    for p in prompts:
        p[len(p) // 2] = model.image_token_id  # text before and after the image
    pixels = np.random.default_rng(1).normal(0, 1, [len(prompts)] + pixel_shape(model.vision_config)[1:])
    forwards = {"full_recompute": plain}
    if lora_layers(model):  # W + s·B·A rounds differently from the two-branch sum (PEFT: 1.6e-5)
        forwards["unmerged_lora"] = model
    return parity_report(folder, manifest, steps, forwards, prompts, new_tokens, pixels.astype(np.float32))
