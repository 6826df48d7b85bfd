"""Image-text data in the MindSpore dataset API: the seeds' transforms, captions through the
chat template with loss on the caption only, and the image placeholder.

    file ─► load_image (RGB, HWC uint8; a corrupt file is an error naming it)
         ─► Resize(256) (shorter side) ─► CenterCrop(224) ─► Rescale(1/255) ─► Normalize ─► HWC2CHW
         ─► pixel_values (3, 224, 224) float32

A sample's tokens are ``<|im_start|>user\\n<image>Describe the image.<|im_end|>\\n<|im_start|>assistant\\n``
then the caption and EOS; labels are -100 everywhere but the caption and EOS. ``<image>`` is one
token, ``image_token_id``: text from it on attends to the image (``MultimodalQwen``).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
PROMPT = "Describe the image."
IGNORE_INDEX = -100


def image_transforms(image_size: int = 224, resize: Optional[int] = None) -> List[Callable]:
    """Resize(shorter side → ``resize``, default 256/224·image_size), CenterCrop, scale, normalize, CHW."""
    import mindspore.dataset.vision as vision
    resize = resize or round(image_size * 256 / 224)
    return [vision.Resize(resize), vision.CenterCrop(image_size), vision.Rescale(1.0 / 255, 0.0),
            vision.Normalize(IMAGENET_MEAN, IMAGENET_STD), vision.HWC2CHW()]


def load_image(path: str) -> np.ndarray:
    """An image file as RGB (H, W, 3) uint8.

    Raises:
        ValueError: naming ``path`` when the file is missing, truncated or not an image.
    """
    from PIL import Image
    try:
        with Image.open(path) as img:
            return np.asarray(img.convert("RGB"), np.uint8)
    except (OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the image ({e})") from None


def apply_transforms(image: np.ndarray, transforms: Sequence[Callable]) -> np.ndarray:
    """Run the transforms eagerly on one HWC image (the dataset runs them in its workers)."""
    import mindspore.dataset.transforms as T
    return np.asarray(T.Compose(list(transforms))(image), np.float32)


def encode_caption(tokenizer, caption: str, image_token_id: int, seq_length: int,
                   template: str = "qwen2.5") -> Tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) (seq_length,) int32: chat prompt with the image token, caption, EOS, padding.

    Raises:
        ValueError: when the prompt and caption do not fit ``seq_length``.
    """
    from mindqwen.data.chat import render
    text = render([{"role": "user", "content": "\0" + PROMPT}], template, add_generation_prompt=True)[0]
    before, after = text.split("\0")
    prompt = tokenizer.encode(before) + [image_token_id] + tokenizer.encode(after)
    answer = tokenizer.encode(caption) + [tokenizer.eos_token_id]
    n = len(prompt) + len(answer)
    if n > seq_length:
        raise ValueError(f"caption {caption!r}: {n} tokens do not fit seq_length {seq_length}")
    pad = getattr(tokenizer, "pad_token_id", tokenizer.eos_token_id)
    ids = np.full(seq_length, pad, np.int32)
    labels = np.full(seq_length, IGNORE_INDEX, np.int32)
    ids[:n] = prompt + answer
    labels[len(prompt):n] = answer
    return ids, labels


class ImageTextSource:
    """Random-access (image, input_ids, labels) rows for ``GeneratorDataset``.

    Args:
        records: (image path or HWC uint8 array, caption) pairs.
    """

    def __init__(self, records: Sequence[Tuple[object, str]], tokenizer, image_token_id: int, seq_length: int,
                 template: str = "qwen2.5"):
        self.records = list(records)
        self.tokens = [encode_caption(tokenizer, c, image_token_id, seq_length, template) for _, c in self.records]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int):
        image = self.records[i][0]
        image = load_image(image) if isinstance(image, str) else np.asarray(image, np.uint8)
        return (image, *self.tokens[i])


def image_text_dataset(source: ImageTextSource, batch_size: int, image_size: int = 224, shuffle: bool = True,
                       num_workers: int = 1, seed: int = 0):
    """A batched ``GeneratorDataset``: columns pixel_values (B, 3, S, S), input_ids, labels (B, L).

    The transforms run in ``num_workers`` parallel workers (the machines here have 2 cores:
    MindSpore caps it at the core count).
    """
    import mindspore.dataset as ds
    ds.config.set_seed(seed)
    data = ds.GeneratorDataset(source, ["pixel_values", "input_ids", "labels"], shuffle=shuffle)
    data = data.map(image_transforms(image_size), input_columns="pixel_values", num_parallel_workers=num_workers)
    return data.batch(batch_size, drop_remainder=True)
