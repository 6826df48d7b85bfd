"""``mindqwen train`` on a multimodal recipe: the shapes demo, every stage through ``fit``, in the
order a real project runs it:

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
import json
import os
import time
from typing import Optional, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindqwen.data.chat import render
from mindqwen.data.loader import IGNORE_INDEX, TokenDataset
from mindqwen.data.tokenizer import load_tokenizer, train_sentencepiece
from mindqwen.io.atomic import atomic_folder
from mindqwen.io.hf import no_init_parameters
from mindqwen.io.jsonfile import write_json
from mindqwen.io.safetensors import CheckpointError, SafetensorsFile, save_file
from mindqwen.models.qwen import QwenForCausalLM
from mindqwen.multimodal.data import PROMPT, image_token_id, read_media_jsonl
from mindqwen.multimodal.fusion import MultimodalQwen, apply_multimodal_lora, trainable_by_group
from mindqwen.multimodal.synthetic import COLOURS, PLACES, SHAPES, caption_attributes, make_captioned_images
from mindqwen.multimodal.vision import VisionEncoder
from mindqwen.train.config import TrainerConfig
from mindqwen.train.loop import fit
from mindqwen.train.model import build_model, model_config
from mindqwen.train.recipe import Recipe, ShapesSection

SEED_OFFSETS = {"text": 0, "vision": 1}  # each stage draws its own batches
WEIGHTS = "multimodal.safetensors"


class CaptionLoss(nn.Cell):
    """(input_ids, labels, pixel_values) → the caption loss: ``fit``'s loss network."""

    def __init__(self, model: MultimodalQwen):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, input_ids, labels, pixel_values):
        return self.model(input_ids, pixel_values, None, labels)


class AttributeProbe(nn.Cell):
    """Stage 3: attention pooling over the ViT's tokens and one linear head per attribute.

    Its rows are ``TokenDataset(attributes, pixel_values=pixels)``: the (colour, shape, place)
    indices (B, 3) stand where a row's tokens would, so ``fit`` feeds (attributes, attributes,
    pixel_values) → the summed cross-entropy. Only the encoder is kept.
    """

    def __init__(self, encoder: VisionEncoder):
        super().__init__(auto_prefix=False)  # a prefix here would rename the encoder's parameters
        d = encoder.config.hidden_size
        self.encoder = encoder
        self.query = ms.Parameter(Tensor(np.random.default_rng(0).normal(0, 0.1, d).astype(np.float32)),
                                  name="probe.query")
        self.head = nn.Dense(d, len(COLOURS) + len(SHAPES) + len(PLACES))
        self.head.weight.name, self.head.bias.name = "probe.head.weight", "probe.head.bias"
        self.splits = (len(COLOURS), len(COLOURS) + len(SHAPES))

    def construct(self, attributes, labels, pixel_values):
        h = self.encoder(pixel_values)  # (B, N, D)
        weights = ops.softmax((h * self.query.astype(h.dtype)).sum(-1).astype(ms.float32), -1).expand_dims(-1)
        logits = self.head((weights * h.astype(ms.float32)).sum(1))  # (B, 4 + 3 + 4)
        a, b = self.splits
        return (ops.cross_entropy(logits[:, :a], attributes[:, 0]) + ops.cross_entropy(logits[:, a:b], attributes[:, 1])
                + ops.cross_entropy(logits[:, b:], attributes[:, 2]))


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


def write_shapes(section: ShapesSection, image_size: int, template: str, folder: str) -> Tuple[str, str, str]:
    """The demo's data as a user would bring it: ``folder/{train,eval}/<i>.png`` and
    ``folder/{train,eval}.jsonl`` (``{"image", "caption"}`` records), and a SentencePiece tokenizer
    trained on the captions (``folder/tokenizer.model``). Returns the three paths."""
    from PIL import Image
    splits = {"train": make_captioned_images(section.train_images, image_size, section.seed),
              "eval": make_captioned_images(section.eval_images, image_size, section.seed + 1)}
    with atomic_folder(folder) as stage:
        for split, records in splits.items():
            os.makedirs(os.path.join(stage, split))
            with open(os.path.join(stage, f"{split}.jsonl"), "w", encoding="utf-8") as f:
                for i, (image, caption) in enumerate(records):
                    Image.fromarray(image).save(os.path.join(stage, split, f"{i:05d}.png"))
                    f.write(json.dumps({"image": f"{split}/{i:05d}.png", "caption": caption}) + "\n")
        prompt = render([{"role": "user", "content": PROMPT}], template, add_generation_prompt=True)[0]
        train_sentencepiece([c for _, c in splits["train"]] + [prompt] * 200, os.path.join(stage, "tokenizer.model"),
                            section.vocab_size)
    return tuple(os.path.join(folder, name) for name in ("train.jsonl", "eval.jsonl", "tokenizer.model"))


def multimodal_data(recipe: Recipe, folder: str):
    """The tokenizer, the ``<image>`` id, the train and held-out ``TokenDataset`` s (pixels left on
    disk: ``MediaColumn``) and the training records: the recipe's JSONL files, or the shapes demo's
    written into ``folder``."""
    m, d = recipe.multimodal, recipe.data
    train, held_out, tokenizer_file = (write_shapes(m.shapes, m.vision.image_size, m.template, folder)
                                       if m.shapes is not None else (d.train, d.eval, d.tokenizer))
    tokenizer = load_tokenizer(tokenizer_file)
    image_id = image_token_id(tokenizer)

    def load(path: str):
        return read_media_jsonl(path, tokenizer, image_id, d.seq_length, m.vision, m.template, d.skip_bad,
                                d.workers, d.read_workers, recipe.trainer.progress)

    train_set, records = load(train)
    return tokenizer, image_id, train_set, load(held_out)[0] if held_out else None, records


def stage(trainer: TrainerConfig, name: str, steps: int, lr: float) -> TrainerConfig:
    """The trainer settings of a preparatory stage: its steps, rate, seed and folder."""
    return dataclasses.replace(trainer, max_steps=steps, lr=lr, min_lr=min(trainer.min_lr, lr),
                               warmup_steps=min(trainer.warmup_steps, steps), seed=trainer.seed + SEED_OFFSETS[name],
                               eval_every=0, output_dir=os.path.join(trainer.output_dir, name),
                               resume="auto" if trainer.resume else None)


def train_multimodal_recipe(recipe: Recipe, recipe_text: Optional[str] = None) -> dict:
    """Run a recipe with a ``multimodal`` section (checked by ``check_recipe``); returns (and
    writes as ``summary.json``) its figures and output paths."""
    m, t = recipe.multimodal, recipe.trainer
    start, out = time.time(), t.output_dir
    os.makedirs(out, exist_ok=True)
    ms.set_seed(t.seed)
    tokenizer, image_id, train_set, eval_set, records = multimodal_data(recipe, os.path.join(out, "data"))
    summary = {"output_dir": out}

    lm = build_model(recipe.model, image_id + 1)
    if image_id >= lm.config.vocab_size:
        raise ValueError(f"the image token id {image_id} is past the LM's vocab_size {lm.config.vocab_size} "
                         "(model.config.vocab_size must hold the tokenizer's vocabulary and <image>)")
    if m.text_steps:  # the LM learns the captions' language alone (what a pre-trained Qwen brings)
        summary["text"] = fit(lm, TokenDataset(train_set.input_ids, train_set.labels),
                              stage(t, "text", m.text_steps, t.lr))
    model = MultimodalQwen(lm, m.vision, m.cross_layers, image_id)
    if m.vision_steps:  # the ViT learns to see the attributes (what a pre-trained encoder brings)
        probe = AttributeProbe(model.vision)
        attributes = np.array([caption_attributes(r["caption"]) for r in records], np.int32)
        summary["vision"] = fit(probe, TokenDataset(attributes, pixel_values=train_set.pixel_values),
                                stage(t, "vision", m.vision_steps, m.vision_lr), loss_net=probe)

    apply_multimodal_lora(model, m.policy)  # fuse: the group policies decide what trains
    if eval_set is not None:
        summary["caption_exact_match_before"] = caption_exact_match(model, eval_set)
        print(f"held-out caption exact match before multimodal training: {summary['caption_exact_match_before']:.1%}")
    summary["train"] = fit(model, train_set, t, eval_set, recipe_text, loss_net=CaptionLoss(model))
    if eval_set is not None:
        summary["caption_exact_match_after"] = caption_exact_match(model, eval_set)
        print(f"held-out caption exact match after multimodal training:  {summary['caption_exact_match_after']:.1%}")
    summary["trainable_by_group"] = trainable_by_group(model)
    weights = os.path.join(out, WEIGHTS)  # every parameter, LoRA unmerged: what ``trained_model`` loads
    save_file({p.name: p.asnumpy() for p in model.get_parameters()}, weights)
    summary["train"]["outputs"]["model"] = weights
    if recipe.export.enabled:
        summary["export"] = export_recipe_model(model, recipe, os.path.join(out, "export"))
    summary["seconds"] = round(time.time() - start, 1)
    write_json(os.path.join(out, "summary.json"), summary)
    return summary


def trained_model(recipe: Recipe) -> MultimodalQwen:
    """The fused model a finished run of ``recipe`` left in its output folder."""
    out = recipe.trainer.output_dir
    image_id = image_token_id(load_tokenizer(tokenizer_path(recipe)))
    weights = SafetensorsFile(os.path.join(out, WEIGHTS))
    with no_init_parameters():  # every weight comes from the file
        lm = QwenForCausalLM(model_config(recipe.model, image_id + 1))
    model = apply_multimodal_lora(MultimodalQwen(lm, recipe.multimodal.vision, recipe.multimodal.cross_layers,
                                                 image_id), recipe.multimodal.policy)
    names = [p.name for p in model.get_parameters()]
    if sorted(names) != sorted(weights.keys()):
        raise CheckpointError(f"{weights.path}: its tensors are not the parameters this recipe builds "
                              f"(missing {sorted(set(names) - set(weights.keys()))[:4]}, "
                              f"unexpected {sorted(set(weights.keys()) - set(names))[:4]})")
    for p in model.get_parameters():
        p.set_data(Tensor(weights.get(p.name)).astype(p.dtype))
    return model


def export_recipe_model(model: MultimodalQwen, recipe: Recipe, folder: str) -> dict:
    """``lm/`` and ``vision.mindir`` with the recipe's ``export`` settings; returns the parity figures."""
    from mindqwen.export.vision import export_multimodal
    e = recipe.export
    return export_multimodal(model, folder, e.batch_sizes, e.max_seq_len, e.seq_buckets, e.dtype, e.soc_version,
                             e.precision_mode, [path for path in [tokenizer_path(recipe)] if os.path.isfile(path)])


def tokenizer_path(recipe: Recipe) -> str:
    """The tokenizer a multimodal recipe trains with: the shapes demo's own, or ``data.tokenizer``."""
    if recipe.multimodal.shapes is not None:
        return os.path.join(recipe.trainer.output_dir, "data", "tokenizer.model")
    return recipe.data.tokenizer
