"""The multimodal demo's data: coloured shapes at positions, and their captions.

Each image (``size``×``size`` RGB, grey background with noise) holds one shape (square, circle or
triangle) of one colour (red, green, blue or yellow) in one quadrant, with a random size and
offset inside the quadrant; the caption names all three, e.g. ``a red circle at the top left``.
Every draw is a new image, so held-out images are never seen in training.
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np

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

