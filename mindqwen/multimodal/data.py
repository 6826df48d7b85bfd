"""Image-text data in the MindSpore dataset API: the seeds' transforms, captions through the
chat template with loss on the caption only, and the image placeholder.

    file ─► load_image (RGB, HWC uint8; a corrupt file is an error naming it)
         ─► Resize(256) (shorter side) ─► CenterCrop(224) ─► Rescale(1/255) ─► Normalize ─► HWC2CHW
         ─► pixel_values (3, 224, 224) float32

Video: ``load_video`` reads a ``.npy`` array (T, H, W, 3) or a folder of frame images;
``sample_frames`` picks ``num_frames`` evenly spread frames (the centre of each of ``num_frames``
equal segments, VideoMAE's test-time sampling); the image transforms run on every frame
→ pixel_values (T, 3, 224, 224).

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


def load_video(path: str) -> np.ndarray:
    """A video as (T, H, W, 3) uint8: a ``.npy`` array of that shape, or a folder of frame images
    (sorted by name).

    Raises:
        ValueError: naming ``path`` (or the frame) when it is missing, unreadable or misshapen.
    """
    import os
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if not n.startswith("."))
        if not names:
            raise ValueError(f"{path}: no frames in the folder")
        frames = [load_image(os.path.join(path, n)) for n in names]
        if len({f.shape for f in frames}) > 1:
            raise ValueError(f"{path}: frames differ in size ({sorted({f.shape for f in frames})})")
        return np.stack(frames)
    try:
        video = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the video ({e})") from None
    if video.ndim != 4 or video.shape[-1] != 3:
        raise ValueError(f"{path}: a video array is (T, H, W, 3), got shape {video.shape}")
    return video.astype(np.uint8)


def sample_frames(total: int, num_frames: int) -> np.ndarray:
    """Indices of ``num_frames`` frames out of ``total``: the centre of each of ``num_frames`` equal
    segments (a short video repeats frames rather than failing)."""
    if total < 1:
        raise ValueError("a video needs at least one frame")
    return np.minimum(((np.arange(num_frames) + 0.5) * total / num_frames).astype(np.int64), total - 1)


def video_pixels(video: np.ndarray, num_frames: int, transforms: Sequence[Callable]) -> np.ndarray:
    """(T_any, H, W, 3) uint8 → (num_frames, 3, S, S) float32: sampled frames, each transformed."""
    return np.stack([apply_transforms(video[i], transforms) for i in sample_frames(len(video), num_frames)])


class VideoTextSource(ImageTextSource):
    """Random-access (pixel_values (T, 3, S, S), input_ids, labels) rows of video-caption pairs.

    Args:
        records: (video path — ``.npy`` or a frames folder — or (T, H, W, 3) array, caption) pairs.
    """

    def __init__(self, records: Sequence[Tuple[object, str]], tokenizer, image_token_id: int, seq_length: int,
                 num_frames: int, image_size: int = 224, template: str = "qwen2.5"):
        super().__init__(records, tokenizer, image_token_id, seq_length, template)
        self.num_frames, self.transforms = num_frames, image_transforms(image_size)

    def __getitem__(self, i: int):
        video = self.records[i][0]
        video = load_video(video) if isinstance(video, str) else np.asarray(video, np.uint8)
        return (video_pixels(video, self.num_frames, self.transforms), *self.tokens[i])


def video_text_dataset(source: VideoTextSource, batch_size: int, shuffle: bool = True, num_workers: int = 1,
                       seed: int = 0):
    """A batched ``GeneratorDataset``: pixel_values (B, T, 3, S, S), input_ids, labels (B, L);
    decoding and the per-frame transforms run in ``num_workers`` parallel workers."""
    import mindspore.dataset as ds
    ds.config.set_seed(seed)
    data = ds.GeneratorDataset(source, ["pixel_values", "input_ids", "labels"], shuffle=shuffle,
                               num_parallel_workers=num_workers)
    return data.batch(batch_size, drop_remainder=True)
