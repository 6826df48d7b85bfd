"""A multimodal recipe (a ``multimodal`` section): every stage through ``fit``, in the order a real
project runs it:

1. the data: the recipe's JSONL image-text (video-text) files, or the shapes demo's synthetic
   images written as PNG files and JSONL (``<output_dir>/data``) with a SentencePiece tokenizer,
   then read back the same way; images stay on disk and are decoded per batch;
2. ``text``: the LM learns the captions' language alone (the stand-in for a pre-trained Qwen);
3. ``vision`` (the demo only): the ViT learns to see colour, shape and place through an attention-pooling
   classifier that is then thrown away (the stand-in for a pre-trained CLIP/SigLIP encoder);
4. fusion through gated cross-attention, the per-group policies, training on image-caption
   pairs with the recipe's ``trainer`` (precision, recompute, accumulation, resume, …);
5. held-out caption exact match before and after step 4 → ``summary.json``; the export.

Stages 2 and 3 write into ``<output_dir>/text`` and ``<output_dir>/vision`` with the trainer's
settings (their own steps, rate and seed). With ``trainer.resume`` each stage resumes from its own
newest checkpoint, so a finished stage is loaded, not re-run.

Step 3 is there because the fusion stage cannot teach a ViT to see from scratch: measured on this
demo, a random ViT trained only through the caption loss (even with every group in full) learns
the colour, which every vision token carries, and stays at chance on shape and place, while the
same fused model reads them at once from hand-made vision tokens. That is what real vision-language
models rely on too: a pre-trained encoder.

Caption exact match is measured teacher-forced: a caption counts when the argmax at every caption
position (EOS included) is the reference token. By induction that is exactly when greedy decoding
reproduces the caption, and it takes one forward pass per batch.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindqwen.config import IGNORE_INDEX
from mindqwen.data.loader import TokenDataset
from mindqwen.data.tokenizer import load_tokenizer
from mindqwen.io.hf import no_init_parameters
from mindqwen.io.jsonfile import write_json
from mindqwen.io.safetensors import CheckpointError, SafetensorsFile, save_file
from mindqwen.models.qwen import QwenForCausalLM
from mindqwen.multimodal.data import image_token_id, read_media_jsonl
from mindqwen.multimodal.fusion import MultimodalQwen, apply_multimodal_lora, trainable_by_group
from mindqwen.tasks import run_eval
from mindqwen.train.config import TrainerConfig
from mindqwen.train.loop import fit
from mindqwen.train.model import build_model, model_config
from mindqwen.train.recipe import Recipe, RecipeError
from mindqwen.train.validate import (check_eval, check_export_section, check_numerics, check_outputs,
                                     check_unused, recipe_model_config)

SEED_OFFSETS = {"text": 0, "vision": 1}  # each stage draws its own batches
WEIGHTS = "multimodal.safetensors"
# Keys of other tasks a multimodal recipe must leave unset, each with the reason.
UNUSED = {
    "lora": "LoRA is set per group in multimodal.policy",
    "pretrain": "the LM's stage on the captions is multimodal.text_steps",
    "data.pretrain": "multimodal data is image-text JSONL in data.train / data.eval",
    "data.synthetic": "multimodal data is image-text JSONL in data.train / data.eval",
    "data.reset_positions": "a caption row holds one document",
}


class CaptionLoss(nn.Cell):
    """(input_ids, labels, pixel_values) → the caption loss: ``fit``'s loss network."""

    def __init__(self, model: MultimodalQwen):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, input_ids, labels, pixel_values):
        return self.model(input_ids, pixel_values, None, labels)


class CaptionLogits(nn.Cell):
    def __init__(self, model: MultimodalQwen):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, input_ids, pixel_values):
        return ops.argmax(self.model(input_ids, pixel_values), -1).astype(ms.int32)


def caption_exact_match(model: MultimodalQwen, data: TokenDataset, batch_size: int = 50) -> float:
    """Fraction of captions whose every token (EOS included) is the argmax given the prefix."""
    was = model.training
    model.set_train(False)
    predict, hits = CaptionLogits(model), 0
    for i in range(0, len(data), batch_size):
        ids, labels, pixels = data.rows(np.arange(i, min(i + batch_size, len(data))))
        pred = predict(Tensor(ids), Tensor(pixels)).asnumpy()
        target = labels[:, 1:]
        ok = (pred[:, :-1] == target) | (target == IGNORE_INDEX)
        hits += int(ok.all(1).sum())
    model.set_train(was)
    return hits / len(data)


def stage(trainer: TrainerConfig, name: str, steps: int, lr: float) -> TrainerConfig:
    """The trainer settings of a preparatory stage: its steps, rate, seed and folder."""
    return dataclasses.replace(trainer, max_steps=steps, lr=lr, min_lr=min(trainer.min_lr, lr),
                               warmup_steps=min(trainer.warmup_steps, steps), seed=trainer.seed + SEED_OFFSETS[name],
                               eval_every=0, output_dir=os.path.join(trainer.output_dir, name),
                               resume="auto" if trainer.resume else None)


class MultimodalTask:
    """A vision encoder fused into a Qwen LM by gated cross-attention, trained on image (video) captions."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe

    def tokenizer_file(self) -> str:
        """The shapes demo's own (written by its run), or ``data.tokenizer``."""
        if self.recipe.multimodal.shapes is not None:
            return os.path.join(self.recipe.trainer.output_dir, "data", "tokenizer.model")
        return self.recipe.data.tokenizer

    def build(self, lm: QwenForCausalLM, image_id: int) -> MultimodalQwen:
        """The fused model around ``lm``, with the recipe's group policies."""
        m = self.recipe.multimodal
        return apply_multimodal_lora(MultimodalQwen(lm, m.vision, m.cross_layers, image_id), m.policy)

    def _data(self):
        """The tokenizer, the ``<image>`` id, the train and held-out ``TokenDataset`` s (pixels left
        on disk: ``MediaColumn``) and the training records."""
        recipe, m, d = self.recipe, self.recipe.multimodal, self.recipe.data
        train, held_out = d.train, d.eval
        if m.shapes is not None:
            from mindqwen.demos.shapes import write_shapes
            train, held_out, _ = write_shapes(m.shapes, m.vision.image_size, m.template,
                                              os.path.join(recipe.trainer.output_dir, "data"))
        tokenizer = load_tokenizer(self.tokenizer_file())
        image_id = image_token_id(tokenizer)

        def load(path: str):
            return read_media_jsonl(path, tokenizer, image_id, d.seq_length, m.vision, m.template, d.skip_bad,
                                    d.workers, d.read_workers, recipe.trainer.progress)

        train_set, records = load(train)
        return tokenizer, image_id, train_set, load(held_out)[0] if held_out else None, records

    def train(self, recipe_text: Optional[str] = None) -> dict:
        m, t = self.recipe.multimodal, self.recipe.trainer
        start, out = time.time(), t.output_dir
        os.makedirs(out, exist_ok=True)
        ms.set_seed(t.seed)
        tokenizer, image_id, train_set, eval_set, records = self._data()
        summary = {"output_dir": out}
        lm = build_model(self.recipe.model, image_id + 1)
        if image_id >= lm.config.vocab_size:
            raise ValueError(f"the image token id {image_id} is past the LM's vocab_size {lm.config.vocab_size} "
                             "(model.config.vocab_size must hold the tokenizer's vocabulary and <image>)")
        if m.text_steps:  # the LM learns the captions' language alone (what a pre-trained Qwen brings)
            summary["text"] = fit(lm, TokenDataset(train_set.input_ids, train_set.labels),
                                  stage(t, "text", m.text_steps, t.lr))
        model = MultimodalQwen(lm, m.vision, m.cross_layers, image_id)
        if m.vision_steps:  # the ViT learns to see the attributes (what a pre-trained encoder brings)
            summary["vision"] = self._vision_stage(model, train_set, records)
        apply_multimodal_lora(model, m.policy)  # fuse: the group policies decide what trains
        if eval_set is not None:
            summary["caption_exact_match_before"] = caption_exact_match(model, eval_set)
            print(f"held-out caption exact match before multimodal training: "
                  f"{summary['caption_exact_match_before']:.1%}")
        summary["train"] = fit(model, train_set, t, eval_set, recipe_text, loss_net=CaptionLoss(model))
        if eval_set is not None:
            summary["caption_exact_match_after"] = caption_exact_match(model, eval_set)
            print(f"held-out caption exact match after multimodal training:  "
                  f"{summary['caption_exact_match_after']:.1%}")
        summary["trainable_by_group"] = trainable_by_group(model)
        weights = os.path.join(out, WEIGHTS)  # every parameter, LoRA unmerged: what ``trained_model`` loads
        save_file({p.name: p.asnumpy() for p in model.get_parameters()}, weights)
        summary["train"]["outputs"]["model"] = weights
        if self.recipe.eval is not None:
            summary["eval"] = run_eval(self.recipe, model, self.tokenizer_file())
        if self.recipe.export.enabled:
            summary["export"] = self.export(model, os.path.join(out, "export"))
        summary["seconds"] = round(time.time() - start, 1)
        write_json(os.path.join(out, "summary.json"), summary)
        return summary

    def _vision_stage(self, model: MultimodalQwen, train_set: TokenDataset, records) -> dict:
        """The shapes demo's ViT learns colour, shape and place through a probe that is then thrown away."""
        from mindqwen.demos.shapes import AttributeProbe, caption_attributes
        m, t = self.recipe.multimodal, self.recipe.trainer
        probe = AttributeProbe(model.vision)
        attributes = np.array([caption_attributes(r["caption"]) for r in records], np.int32)
        return fit(probe, TokenDataset(attributes, pixel_values=train_set.pixel_values),
                   stage(t, "vision", m.vision_steps, m.vision_lr), loss_net=probe)

    def trained_model(self) -> MultimodalQwen:
        """The fused model a finished run left in ``<output_dir>/multimodal.safetensors``."""
        image_id = image_token_id(load_tokenizer(self.tokenizer_file()))
        weights = SafetensorsFile(os.path.join(self.recipe.trainer.output_dir, WEIGHTS))
        with no_init_parameters():  # every weight comes from the file
            lm = QwenForCausalLM(model_config(self.recipe.model, image_id + 1))
        model = self.build(lm, image_id)
        names = [p.name for p in model.get_parameters()]
        if sorted(names) != sorted(weights.keys()):
            raise CheckpointError(f"{weights.path}: its tensors are not the parameters this recipe builds "
                                  f"(missing {sorted(set(names) - set(weights.keys()))[:4]}, "
                                  f"unexpected {sorted(set(weights.keys()) - set(names))[:4]})")
        for p in model.get_parameters():
            p.set_data(Tensor(weights.get(p.name)).astype(p.dtype))
        return model

    def export(self, model: MultimodalQwen, folder: str) -> dict:
        """``lm/`` and ``vision.mindir`` with the recipe's ``export`` settings; returns the parity figures."""
        from mindqwen.export.vision import export_multimodal
        e = self.recipe.export
        return export_multimodal(model, folder, e.batch_sizes, e.max_seq_len, e.seq_buckets, e.dtype, e.soc_version,
                                 e.precision_mode, [p for p in [self.tokenizer_file()] if os.path.isfile(p)])

    # ------------------------------------------------------------------ validate
    def validate(self, source: str, tiny: bool = False) -> str:
        """Check the recipe, read its data (unless ``tiny``) and build the fused model it trains."""
        recipe, m, t = self.recipe, self.recipe.multimodal, self.recipe.trainer
        check_outputs(recipe, source)
        check_eval(recipe, source, self.tokenizer_file())
        self._check_sections(source)
        image_id = self.image_id(source)
        config = recipe_model_config(recipe, source, image_id + 1)  # the pieces, then <image>
        if image_id >= config.vocab_size:
            raise RecipeError(f"{source}: model.config.vocab_size={config.vocab_size} has no id for <image> "
                              f"({image_id}: after the tokenizer's pieces)")
        check_numerics(recipe, config, source, None if tiny else ms.get_context("device_target"))
        check_export_section(recipe, config, source, "float32")  # image-conditioned graphs export in fp32
        data = "the shapes demo's, written at train time" if m.shapes is not None else "not read (--tiny)"
        if m.shapes is None and not tiny:
            data = self._check_data(source, image_id)
        with no_init_parameters():  # the LM's shape matters here, not its weights
            lm = QwenForCausalLM(config)
        try:
            model = MultimodalQwen(lm, m.vision, m.cross_layers, image_id)
        except ValueError as e:
            raise RecipeError(f"{source}: multimodal: {e}") from None
        try:
            apply_multimodal_lora(model, m.policy)
        except ValueError as e:
            raise RecipeError(f"{source}: multimodal.policy: {e}") from None
        groups = ", ".join(f"{g} {getattr(m.policy, g).mode} ({n:,})" for g, n in trainable_by_group(model).items())
        return (f"{source}: ok\n"
                f"  model: {config.num_hidden_layers}-layer LM (hidden {config.hidden_size}) + ViT "
                f"{m.vision.num_hidden_layers} layers at {m.vision.image_size}px, cross-attention after layers "
                f"{list(m.cross_layers)}\n"
                f"  data: {data}\n"
                f"  trainable: {groups}\n"
                f"  training: text {m.text_steps} + vision {m.vision_steps} + fused {t.max_steps} steps, "
                f"precision {t.precision.level}, recompute {t.recompute}, accumulation {t.gradient_accumulation}")

    def _check_sections(self, source: str) -> None:
        """Keys this task does not read, and the ones the shapes demo and files exclude."""
        recipe, m, d = self.recipe, self.recipe.multimodal, self.recipe.data
        reasons = check_unused(recipe, UNUSED)
        if m.shapes is not None and any(getattr(d, k) is not None for k in ("train", "eval", "tokenizer")):
            reasons.append("data.train / eval / tokenizer (multimodal.shapes writes its own images, captions and "
                           "tokenizer; multimodal.shapes=null trains on the files)")
        if m.shapes is None and m.vision_steps > 0:
            reasons.append("multimodal.vision_steps (the ViT's pre-training stage learns the shapes demo's "
                           "colour/shape/place labels; on files the encoder comes trained: vision_steps=0)")
        if recipe.parallel.devices > 1:
            reasons.append("parallel (the layouts (data, tensor, pipeline) cover the LM alone, not the vision tower "
                           "and cross-attention: multimodal recipes run on one device)")
        if reasons:
            raise RecipeError(f"{source}: a multimodal recipe cannot use {'; '.join(reasons)}")

    def image_id(self, source: str = "recipe") -> int:
        """The ``<image>`` id: past the shapes demo's pieces, or the tokenizer's (``source``
        names the recipe in errors)."""
        m, d = self.recipe.multimodal, self.recipe.data
        if m.shapes is not None:
            return m.shapes.vocab_size
        if d.train is None or d.tokenizer is None:
            raise RecipeError(f"{source}: data.train and data.tokenizer are required (image-text JSONL and its "
                              "tokenizer), or multimodal.shapes for the demo's data")
        try:
            return image_token_id(load_tokenizer(d.tokenizer))
        except (OSError, ValueError, KeyError) as e:
            raise RecipeError(f"{source}: data.tokenizer: {e}") from None

    def _check_data(self, source: str, image_id: int) -> str:
        """Read every record and image of ``data.train`` / ``data.eval`` as training will."""
        recipe, m, d = self.recipe, self.recipe.multimodal, self.recipe.data
        tokenizer, counts = load_tokenizer(d.tokenizer), []
        for key in ("train", "eval"):
            if getattr(d, key) is not None:
                try:
                    rows = read_media_jsonl(getattr(d, key), tokenizer, image_id, d.seq_length, m.vision, m.template,
                                            d.skip_bad, d.workers, d.read_workers, recipe.trainer.progress)[0]
                except (OSError, ValueError) as e:
                    raise RecipeError(f"{source}: data.{key}: {e}") from None
                counts.append(f"{key} {len(rows):,} records")
        return ", ".join(counts) + " (every image checked)"
