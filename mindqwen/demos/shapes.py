"""The multimodal demo's data: coloured shapes at positions, and their captions.

Each image (``size``×``size`` RGB, grey background with noise) holds one shape (square, circle or
triangle) of one colour (red, green, blue or yellow) in one quadrant, with a random size and
offset inside the quadrant; the caption names all three, e.g. ``a red circle at the top left``.
Every draw is a new image, so held-out images are never seen in training.
"""
from __future__ import annotations

import json
import os
from typing import List, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

SHAPES = ("square", "circle", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (40, 60, 220), "yellow": (230, 210, 30)}
PLACES = ("top left", "top right", "bottom left", "bottom right")


def draw(shape: str, colour: str, place: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """One (size, size, 3) uint8 image."""
    img = np.clip(rng.normal(128, 12, (size, size, 3)), 0, 255).astype(np.uint8)
    half = size // 2
    side = int(rng.integers(half * 5 // 10, half * 9 // 10 + 1))
    top = (0 if place.startswith("top") else half) + int(rng.integers(0, half - side + 1))
    left = (0 if place.endswith("left") else half) + int(rng.integers(0, half - side + 1))
    yy, xx = np.mgrid[0:side, 0:side]
    if shape == "square":
        inside = np.ones((side, side), bool)
    elif shape == "circle":
        r = (side - 1) / 2
        inside = (yy - r) ** 2 + (xx - r) ** 2 <= r * r
    else:  # an upward triangle: width grows with the row
        inside = np.abs(xx - (side - 1) / 2) <= yy / 2
    img[top:top + side, left:left + side][inside] = COLOURS[colour]
    return img


def make_captioned_images(n: int, size: int = 32, seed: int = 0) -> List[Tuple[np.ndarray, str]]:
    """``n`` (image, caption) pairs, the attributes drawn uniformly."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        shape, colour, place = (SHAPES[rng.integers(3)], list(COLOURS)[rng.integers(4)], PLACES[rng.integers(4)])
        out.append((draw(shape, colour, place, size, rng), f"a {colour} {shape} at the {place}"))
    return out


def caption_attributes(caption: str) -> Tuple[int, int, int]:
    """(colour, shape, place) indices of a caption made by ``make_captioned_images``."""
    words = caption.split()
    return list(COLOURS).index(words[1]), SHAPES.index(words[2]), PLACES.index(" ".join(words[-2:]))



def write_shapes(section, image_size: int, template: str, folder: str) -> Tuple[str, str, str]:
    """The demo's data as a user would bring it: ``folder/{train,eval}/<i>.png`` and
    ``folder/{train,eval}.jsonl`` (``{"image", "caption"}`` records), and a SentencePiece tokenizer
    trained on the captions (``folder/tokenizer.model``).

    Args:
        section: a recipe's ``multimodal.shapes`` (seed, split sizes, vocab_size).

    Returns:
        The paths of train.jsonl, eval.jsonl and tokenizer.model.
    """
    from PIL import Image

    from mindqwen.data.chat import render
    from mindqwen.data.tokenizer import train_sentencepiece
    from mindqwen.io.atomic import atomic_folder
    from mindqwen.multimodal.data import PROMPT
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


class AttributeProbe(nn.Cell):
    """The vision stage's network: attention pooling over a ViT's tokens and one linear head per
    attribute, so the encoder learns to see colour, shape and place (what a pre-trained encoder
    brings to a real project).

    Its rows are ``TokenDataset(attributes, pixel_values=pixels)``: the (colour, shape, place)
    indices (B, 3) stand where a row's tokens would, so ``fit`` feeds (attributes, attributes,
    pixel_values) → the summed cross-entropy. Only the encoder is kept.
    """

    def __init__(self, encoder: nn.Cell):
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
