"""Export of a fused multimodal model (``mindqwen.multimodal.fusion.MultimodalQwen``):

    export/
      lm/            the language model, LoRA merged: prefill + decode MindIR, manifest, lite/,
                     parity.json — exactly what ``mindqwen.export.export_model`` writes
      vision.mindir  the vision tower (ViT + projector, LoRA merged): pixel_values
                     (B, 3, S, S) — or (B, T, 3, S, S) for video — float32 → vision tokens (B, Nv, H);
                     B is dynamic
      vision.json    its input/output shapes, the image transforms and its parity figures

The cross-attention blocks are not in the LM graphs: those serve the text-only path. A decode graph
that takes the vision tokens as an input is the next step (docs/multimodal.md).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

from mindqwen.export.mindir import export_model
from mindqwen.io.atomic import atomic_folder
from mindqwen.io.jsonfile import read_json, write_json
from mindqwen.lora import lora_layers
from mindqwen.multimodal.data import IMAGENET_MEAN, IMAGENET_STD
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


def export_vision(model, folder: str) -> dict:
    """Write ``vision.mindir`` and ``vision.json`` into ``folder``; returns the JSON's content.

    Raises:
        RuntimeError: the exported graph disagrees with the eager tower.
    """
    c = model.vision_config
    tower = plain_tower(model)
    shape = pixel_shape(c)
    ms.export(tower, Tensor(shape=[None] + shape[1:], dtype=ms.float32), file_name=os.path.join(folder, "vision"),
              file_format="MINDIR")
    pixels = np.random.default_rng(0).normal(0, 1, [2] + shape[1:]).astype(np.float32)
    graph = nn.GraphCell(ms.load(os.path.join(folder, "vision.mindir")))
    exported = graph(Tensor(pixels)).asnumpy()
    was = model.training
    model.set_train(False)
    eager = model.projector(model.vision(Tensor(pixels))).asnumpy()  # the model as trained (LoRA unmerged)
    model.set_train(was)
    same = tower(Tensor(pixels)).asnumpy()
    parity = {"vs_same_weights": float(np.abs(exported - same).max()),
              "vs_unmerged_model": float(np.abs(exported - eager).max()), "tolerance": VISION_TOLERANCE}
    parity["passed"] = parity["vs_unmerged_model"] <= VISION_TOLERANCE
    info = {"inputs": [{"name": "pixel_values", "shape": shape, "dtype": "float32"}],
            "outputs": [{"name": "vision_tokens", "shape": [-1, exported.shape[1], exported.shape[2]],
                         "dtype": "float32"}],
            "transforms": {"resize": round(c.image_size * 256 / 224), "center_crop": c.image_size,
                           "rescale": 1 / 255, "mean": IMAGENET_MEAN, "std": IMAGENET_STD, "layout": "CHW"},
            "cross_layers": list(model.cross_layers), "image_token_id": model.image_token_id, "parity": parity}
    write_json(os.path.join(folder, "vision.json"), info)
    if not parity["passed"]:
        raise RuntimeError(f"exported vision graph disagrees with the eager model: {parity}")
    return info


def export_multimodal(model, folder: str, batch_sizes: Sequence[int] = (1,), max_seq_len: int = 2048,
                      seq_buckets: Optional[Sequence[int]] = None, dtype: str = "float32",
                      target: str = "Ascend310", precision_mode: Optional[str] = None,
                      tokenizer_files: Sequence[str] = ()) -> dict:
    """``folder``/lm (the LM export, with its parity report) and ``folder``/vision.mindir; staged
    beside ``folder`` and renamed into place, so a failure leaves any earlier export as it was."""
    with atomic_folder(folder) as staging:
        export_model(model.lm, os.path.join(staging, "lm"), batch_sizes, max_seq_len, seq_buckets, dtype, target,
                     precision_mode, tokenizer_files)
        vision = export_vision(model, staging)
    lm_parity = read_json(os.path.join(folder, "lm", "parity.json"), RuntimeError, "LM parity report")
    print(f"exported {folder}: lm/ (prefill + decode MindIR, lite/), vision.mindir; vision graph vs eager: "
          f"{vision['parity']['vs_unmerged_model']:.1e}", flush=True)
    return {"folder": folder, "vision_parity": vision["parity"],
            "lm_parity": {k: lm_parity[k] for k in ("eager_same_steps", "full_recompute", "passed")}}
