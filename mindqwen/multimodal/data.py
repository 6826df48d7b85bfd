"""Image-text and video-text data: JSONL records whose images stay on disk, read through the
MindSpore dataset pipeline (``mindqwen.data.loader.mindspore_dataset``), transformed as below.

    {"image": "img/1.jpg", "caption": "..."}  or  {"image": ..., "messages": [... "<image>" ...]}
    file ─► load_image (RGB, HWC uint8; a corrupt file is an error naming it)
         ─► Resize(256) (shorter side) ─► CenterCrop(224) ─► Rescale(1/255) ─► Normalize ─► HWC2CHW
         ─► pixel_values (3, 224, 224) float32

Video (``{"video": "clip.npy" | "frames/", ...}``): ``load_clip`` reads the ``num_frames`` frames
``sample_frames`` picks (the centre of each of ``num_frames`` equal segments, VideoMAE's test-time
sampling) from a memory-mapped ``.npy`` (T, H, W, 3) or a folder of frame images; the image
transforms run on every frame → pixel_values (T, 3, 224, 224).

A caption's tokens are ``<|im_start|>user\n<image>Describe the image.<|im_end|>\n<|im_start|>assistant\n``
then the caption and EOS; labels are -100 everywhere but the caption and EOS. A conversation goes
through the chat template with the text path's assistant-only labels. ``<image>`` is one token,
``image_token_id``: text from it on attends to the image (``MultimodalQwen``).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from mindqwen.config import IGNORE_INDEX

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
PROMPT = "Describe the image."
PLACEHOLDERS = ("<image>", "<video>")  # where a conversation's image goes
IMAGE_PAD = "<|image_pad|>"  # Qwen's tokenizers carry this id for vision tokens


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
    prompt = encode_prompt(tokenizer, image_token_id, PROMPT, template)
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


def sample_frames(total: int, num_frames: int) -> np.ndarray:
    """Indices of ``num_frames`` frames out of ``total``: the centre of each of ``num_frames`` equal
    segments (a short video repeats frames rather than failing)."""
    if total < 1:
        raise ValueError("a video needs at least one frame")
    return np.minimum(((np.arange(num_frames) + 0.5) * total / num_frames).astype(np.int64), total - 1)


def load_clip(path: str, num_frames: int) -> np.ndarray:
    """The ``num_frames`` sampled frames of a video (``sample_frames``) as (num_frames, H, W, 3)
    uint8, reading only those: a ``.npy`` is memory-mapped, a folder decodes the chosen files."""
    import os
    if os.path.isdir(path):
        names = _frame_names(path)
        frames = [load_image(os.path.join(path, names[i])) for i in sample_frames(len(names), num_frames)]
        if len({f.shape for f in frames}) > 1:
            raise ValueError(f"{path}: frames differ in size ({sorted({f.shape for f in frames})})")
        return np.stack(frames)
    video = _video_array(path)
    return np.asarray(video[sample_frames(len(video), num_frames)], np.uint8)


def _frame_names(folder: str) -> List[str]:
    import os
    names = sorted(n for n in os.listdir(folder) if not n.startswith("."))
    if not names:
        raise ValueError(f"{folder}: no frames in the folder")
    return names


def _video_array(path: str) -> np.ndarray:
    try:
        video = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the video ({e})") from None
    if video.ndim != 4 or video.shape[-1] != 3 or len(video) == 0:
        raise ValueError(f"{path}: a video array is (T, H, W, 3) with T ≥ 1, got shape {video.shape}")
    return video


def check_media(path: str, video: bool) -> None:
    """Cheap checks before training (no pixel decoding): the file exists, an image's structure
    reads (PIL ``verify``: header, PNG chunk checksums), a video array's header and shape, a
    frames folder's files.

    Raises:
        ValueError: naming ``path`` and what is wrong.
    """
    import os
    from PIL import Image
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file")
    if video and path.endswith(".npy"):
        _video_array(path)
        return
    if video and not os.path.isdir(path):
        raise ValueError(f"{path}: a video is a .npy array (T, H, W, 3) or a folder of frame images")
    for name in (_frame_names(path) if video else [""]):
        file = os.path.join(path, name) if name else path
        try:
            with Image.open(file) as img:
                img.verify()
        except (OSError, SyntaxError, ValueError) as e:
            raise ValueError(f"{file}: cannot read the image ({e})") from None


def encode_prompt(tokenizer, image_token_id: int, text: str = PROMPT, template: str = "qwen2.5") -> List[int]:
    """A user turn of the image token then ``text``, through the chat template up to the
    assistant's turn: what a caption follows in training, and what generation starts from."""
    from mindqwen.data.chat import render
    rendered = render([{"role": "user", "content": "\0" + text}], template, add_generation_prompt=True)[0]
    before, after = rendered.split("\0")
    return tokenizer.encode(before) + [image_token_id] + tokenizer.encode(after)


def load_pixels(path: str, vision) -> np.ndarray:
    """One image (or, for a video model, a ``.npy`` clip or frames folder) as the model's pixel
    values: (3, S, S) or (num_frames, 3, S, S) float32, transformed as in training."""
    return MediaColumn([path], [""], vision)[0]


class MediaColumn:
    """The ``pixel_values`` of rows whose images (or videos) stay on disk, decoded when a batch
    needs them. ``TokenDataset`` takes it in place of an array; ``mindspore_dataset`` reads
    ``load`` in its source workers and maps ``transforms`` in its own workers.

    Args:
        paths: one image file, video ``.npy`` or frames folder per row.
        origins: ``file:line`` of each row, for errors.
        vision: the encoder's input: ``image_size`` and ``num_frames`` (> 1: videos).
        workers: threads running the transforms.
        read_workers: readers of the files: 1 is one thread (PIL releases the GIL while it
            decodes); more are processes. On 2 cores one thread is fastest (measured: 7.7 ms per
            batch of 32 small PNGs against 21 ms with 2 processes and 85 ms with 2 threads;
            42 ms per 16 500×375 JPEGs against 59 ms); hosts with many cores gain from more.
    """

    def __init__(self, paths: Sequence[str], origins: Sequence[str], vision, workers: int = 2,
                 read_workers: int = 1):
        if len(paths) != len(origins):
            raise ValueError(f"{len(paths)} paths for {len(origins)} origins")
        if workers < 1 or read_workers < 1:
            raise ValueError(f"workers and read_workers must be >= 1, got {workers} and {read_workers}")
        self.paths, self.origins, self.workers, self.read_workers = list(paths), list(origins), workers, read_workers
        self.num_frames, self.image_size = vision.num_frames, vision.image_size
        self.image_transforms = image_transforms(vision.image_size)

    @property
    def shape(self) -> Tuple[int, ...]:
        frames = (self.num_frames,) if self.num_frames > 1 else ()
        return (len(self.paths),) + frames + (3, self.image_size, self.image_size)

    def __len__(self) -> int:
        return len(self.paths)

    def load(self, i: int) -> np.ndarray:
        """Row ``i`` decoded, before the transforms: (H, W, 3) or (num_frames, H, W, 3) uint8."""
        try:
            if self.num_frames > 1:
                return load_clip(self.paths[i], self.num_frames)
            return load_image(self.paths[i])
        except ValueError as e:
            raise ValueError(f"{self.origins[i]}: {e}" if self.origins[i] else str(e)) from None

    @property
    def transforms(self) -> List[Callable]:
        """What the dataset maps over a loaded row: the image ops, or them on every frame."""
        return self.image_transforms if self.num_frames == 1 else [self._frames]

    def _frames(self, clip: np.ndarray) -> np.ndarray:
        return np.stack([apply_transforms(frame, self.image_transforms) for frame in clip])

    def __getitem__(self, index) -> np.ndarray:
        """Rows ``index`` (an int array) decoded and transformed: (len(index), …, 3, S, S) float32
        (one row, without the leading axis, for an int)."""
        rows = np.stack([apply_transforms(self.load(i), self.transforms) for i in np.atleast_1d(index)])
        return rows if np.ndim(index) else rows[0]


def image_token_id(tokenizer) -> int:
    """The id that stands for the image: Qwen's ``<|image_pad|>`` when the tokenizer has it, else
    one past the tokenizer's vocabulary (the LM's ``vocab_size`` must exceed it)."""
    added = getattr(tokenizer, "added", None) or {}
    return added.get(IMAGE_PAD, tokenizer.vocab_size)


def encode_messages(messages, tokenizer, image_id: int, seq_length: int,
                    template: str = "qwen2.5") -> Tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) (seq_length,) int32 of a conversation whose user turn holds one
    ``<image>`` (or ``<video>``) placeholder: the chat template, the placeholder as ``image_id``,
    labels on the assistant turns only (as the text path's ``encode_chat``), padding.

    Raises:
        ValueError: no placeholder or more than one, or the conversation does not fit.
    """
    from mindqwen.data.chat import render
    text, spans = render(messages, template)
    places = [(text.find(tag), tag) for tag in PLACEHOLDERS if tag in text]
    if len(places) != 1 or sum(text.count(tag) for tag in PLACEHOLDERS) != 1:
        raise ValueError(f"a conversation needs exactly one {' or '.join(PLACEHOLDERS)} placeholder, "
                         f"found {sum(text.count(tag) for tag in PLACEHOLDERS)}")
    at, tag = places[0]
    ids, train = [], []
    for part, offset in ((text[:at], 0), (text[at + len(tag):], at + len(tag))):
        part_ids, starts = tokenizer.encode_with_offsets(part) if part else ([], [])
        inside = [any(lo <= offset + s < hi for lo, hi in spans) for s in starts]
        ids += part_ids
        train += inside
        if offset == 0:
            ids.append(image_id)
            train.append(False)
    if len(ids) > seq_length:
        raise ValueError(f"{len(ids)} tokens do not fit seq_length {seq_length}")
    pad = getattr(tokenizer, "pad_token_id", tokenizer.eos_token_id)
    out = np.full(seq_length, pad, np.int32)
    labels = np.full(seq_length, IGNORE_INDEX, np.int32)
    out[:len(ids)] = ids
    labels[:len(ids)] = np.where(train, ids, IGNORE_INDEX)
    return out, labels


def read_media_jsonl(path: str, tokenizer, image_id: int, seq_length: int, vision, template: str = "qwen2.5",
                     skip_bad: bool = False, workers: int = 2, read_workers: int = 1, progress: bool = True):
    """Image-text (or video-text) rows from a JSON-lines file, images left on disk.

    Each line is ``{"image": <path>, "caption": <text>}`` or ``{"image": <path>, "messages":
    [<chat turns>, the user's holding "<image>">]}``; video models (``vision.num_frames`` > 1)
    read ``"video"`` (a ``.npy`` (T, H, W, 3) or a folder of frames) instead of ``"image"``.
    Relative paths are relative to the JSONL file. Every image is checked here (``check_media``).

    Returns:
        (``TokenDataset`` with a ``MediaColumn``, the rows' records).

    Raises:
        ValueError: ``file:line: what`` for the first bad record, unless ``skip_bad`` (then
            bad records are left out and counted in a warning).
    """
    import json
    import os
    import warnings
    from tqdm import tqdm
    from mindqwen.data.loader import TokenDataset
    from mindqwen.io.textfile import iter_lines
    key = "video" if vision.num_frames > 1 else "image"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: data not found")
    rows, records, origins, paths, bad = [], [], [], [], []
    for line in tqdm(list(iter_lines(path)), desc=f"checking {os.path.basename(path)}", unit="record",
                     disable=not progress, leave=False):
        where = f"{path}:{line.number}"
        try:
            if line.error:
                raise ValueError(line.error)
            if not line.text.strip():
                continue
            record = _media_record(line.text, key)
            media = os.path.join(folder, record[key])
            check_media(media, key == "video")
            rows.append(encode_caption(tokenizer, record["caption"], image_id, seq_length, template)
                        if "caption" in record else
                        encode_messages(record["messages"], tokenizer, image_id, seq_length, template))
        except (ValueError, json.JSONDecodeError) as e:
            if not skip_bad:
                raise ValueError(f"{where}: {e}") from None
            bad.append(f"{where}: {e}")
            continue
        records.append(record)
        origins.append(where)
        paths.append(media)
    if bad:
        warnings.warn(f"{path}: skipped {len(bad)} bad record(s) (data.skip_bad), first: {'; '.join(bad[:3])}")
    if not rows:
        raise ValueError(f"{path}: no usable {key}-text records")
    return TokenDataset(np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]),
                        MediaColumn(paths, origins, vision, workers, read_workers)), records


def _media_record(text: str, key: str) -> dict:
    import json
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    other = "image" if key == "video" else "video"
    if not isinstance(record, dict) or not isinstance(record.get(key), str):
        hint = f" (this model reads {key}s: vision.num_frames decides)" if isinstance(record, dict) and other in record else ""
        raise ValueError(f"expected a {key!r} path (string){hint}, got {text.strip()[:80]}")
    if isinstance(record.get("caption"), str) == isinstance(record.get("messages"), list):
        raise ValueError(f"expected either \"caption\" (string) or \"messages\" (list of turns), got {text.strip()[:80]}")
    return record
