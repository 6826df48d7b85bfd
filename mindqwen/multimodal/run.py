"""The multimodal demo end to end: synthetic shapes → tokenizer → text pre-training of the LM on
the captions → fusion with a ViT through gated cross-attention → LoRA/full per group → training
on images → caption exact match before and after → summary.json.

Caption exact match is measured teacher-forced: a caption counts when the argmax at every caption
position (EOS included) is the reference token. By induction that is exactly when greedy decoding
reproduces the caption, and it takes one forward pass per batch.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindqwen.config import QwenConfig
from mindqwen.models.qwen import IGNORE_INDEX, QwenForCausalLM
from mindqwen.data.chat import render
from mindqwen.multimodal.data import PROMPT, apply_transforms, encode_caption, image_transforms
from mindqwen.multimodal.fusion import (MultimodalLoraConfig, MultimodalQwen, apply_multimodal_lora,
                                        trainable_by_group)
from mindqwen.multimodal.synthetic import make_captioned_images
from mindqwen.multimodal.vision import VisionConfig
from mindqwen.train.optim import WarmupSchedule, make_optimizer
from mindqwen.train.precision import PrecisionConfig, make_loss_scaler
from mindqwen.train.step import Stepper


@dataclass
class ShapesDemoConfig:
    """Sizes and steps of the demo (defaults: a few minutes on 2 CPU cores)."""

    image_size: int = 32
    template: str = "qwen3"  # no default system prompt: short rows
    vocab_size: int = 96
    train_images: int = 3000
    eval_images: int = 200
    seq_length: int = 48
    text_steps: int = 300
    steps: int = 600
    batch_size: int = 32
    lr: float = 2e-3
    seed: int = 0
    text: dict = field(default_factory=lambda: dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                    num_attention_heads=4, num_key_value_heads=2,
                                                    max_position_embeddings=64))
    vision: dict = field(default_factory=lambda: dict(patch_size=8, hidden_size=64, num_hidden_layers=2,
                                                      num_attention_heads=4, intermediate_size=128))
    cross_layers: List[int] = field(default_factory=lambda: [0, 1])
    policy: MultimodalLoraConfig = field(default_factory=MultimodalLoraConfig)


class CaptionLoss(nn.Cell):
    """(input_ids, pixel_values, labels) → the caption loss; what the ``Stepper`` feeds."""

    def __init__(self, model: MultimodalQwen):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, input_ids, pixel_values, labels):
        return self.model(input_ids, pixel_values, None, labels)


class CaptionLogits(nn.Cell):
    def __init__(self, model: MultimodalQwen):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, input_ids, pixel_values):
        return ops.argmax(self.model(input_ids, pixel_values), -1).astype(ms.int32)


def caption_exact_match(model: MultimodalQwen, ids: np.ndarray, pixels: np.ndarray, labels: np.ndarray,
                        batch_size: int = 50) -> float:
    """Fraction of captions whose every token (EOS included) is the argmax given the prefix."""
    was = model.training
    model.set_train(False)
    predict, hits = CaptionLogits(model), 0
    for i in range(0, len(ids), batch_size):
        pred = predict(Tensor(ids[i:i + batch_size]), Tensor(pixels[i:i + batch_size])).asnumpy()
        target = labels[i:i + batch_size, 1:]
        ok = (pred[:, :-1] == target) | (target == IGNORE_INDEX)
        hits += int(ok.all(1).sum())
    model.set_train(was)
    return hits / len(ids)


def _encode(records, tokenizer, image_token_id: int, config: ShapesDemoConfig) -> Tuple[np.ndarray, ...]:
    transforms = image_transforms(config.image_size)
    pixels = np.stack([apply_transforms(img, transforms) for img, _ in records])
    pairs = [encode_caption(tokenizer, c, image_token_id, config.seq_length, config.template) for _, c in records]
    return np.stack([p[0] for p in pairs]), pixels, np.stack([p[1] for p in pairs])  # the CaptionLoss order


def _train(stepper: Stepper, batches, steps: int, batch_size: int, seed: int, label: str) -> List[float]:
    """``steps`` optimizer steps on random rows of ``batches`` (arrays with the rows first)."""
    rng, losses = np.random.default_rng(seed), []
    for step in range(steps):
        rows = rng.integers(0, len(batches[0]), batch_size)
        loss, _, _ = stepper([tuple(Tensor(b[rows]) for b in batches)])
        losses.append(loss)
        if (step + 1) % 100 == 0 or step + 1 == steps:
            print(f"{label} step {step + 1}/{steps}: loss {np.mean(losses[-100:]):.4f}", flush=True)
    return losses


def run_shapes_demo(output_dir: str, config: Optional[ShapesDemoConfig] = None) -> dict:
    """Train the shapes demo; returns (and writes ``summary.json``) the figures."""
    from mindqwen.data.tokenizer import train_sentencepiece
    config = config or ShapesDemoConfig()
    start = time.time()
    ms.set_seed(config.seed)
    ms.set_context(mode=ms.GRAPH_MODE)
    os.makedirs(output_dir, exist_ok=True)
    train = make_captioned_images(config.train_images, config.image_size, config.seed)
    held_out = make_captioned_images(config.eval_images, config.image_size, config.seed + 1)
    prompt = render([{"role": "user", "content": PROMPT}], config.template, add_generation_prompt=True)[0]
    tokenizer = train_sentencepiece([c for _, c in train] + [prompt] * 200, os.path.join(output_dir, "tokenizer.model"),
                                    config.vocab_size)
    image_token_id = tokenizer.vocab_size  # one id past SentencePiece's pieces
    lm = QwenForCausalLM(QwenConfig(vocab_size=tokenizer.vocab_size + 1, **config.text))
    train_data, eval_data = _encode(train, tokenizer, image_token_id, config), _encode(held_out, tokenizer,
                                                                                       image_token_id, config)
    # 1. the LM learns the captions' language alone (what a pre-trained Qwen brings)
    lm.set_train(True)
    text_opt = make_optimizer(lm.trainable_params(), WarmupSchedule("cosine", config.lr, config.text_steps, 20))
    scaler = make_loss_scaler(PrecisionConfig())
    _train(Stepper(lm, text_opt, scaler, clip_norm=1.0), (train_data[0], train_data[2]), config.text_steps, config.batch_size,
           config.seed, "text")
    # 2. fuse, apply the group policies, train on images
    model = MultimodalQwen(lm, VisionConfig(image_size=config.image_size, **config.vision), config.cross_layers,
                           image_token_id)
    apply_multimodal_lora(model, config.policy)
    before = caption_exact_match(model, *eval_data)
    print(f"held-out caption exact match before multimodal training: {before:.1%}", flush=True)
    model.set_train(True)
    opt = make_optimizer(model.trainable_params(), WarmupSchedule("cosine", config.lr, config.steps, 30))
    stepper = Stepper(model, opt, scaler, clip_norm=1.0, loss_net=CaptionLoss(model))
    losses = _train(stepper, train_data, config.steps, config.batch_size, config.seed + 1, "multimodal")
    after = caption_exact_match(model, *eval_data)
    print(f"held-out caption exact match after multimodal training:  {after:.1%}", flush=True)
    summary = {"caption_exact_match_before": before, "caption_exact_match_after": after,
               "final_loss": float(np.mean(losses[-20:])), "trainable_by_group": trainable_by_group(model),
               "seconds": round(time.time() - start, 1), "config": asdict(config)}
    with open(os.path.join(output_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary
