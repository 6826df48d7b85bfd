"""A recipe's data files → token rows: preprocess folders, ``.npy`` rows, ``.jsonl`` pairs, ``.txt``.

Every error names the file (and the line, for text): ``mindqwen validate`` and ``mindqwen train``
read data through these same functions, so what validate passes, train can load.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Tuple

import numpy as np

from mindqwen.config import IGNORE_INDEX
from mindqwen.data.instruct import encode_pairs, pack_text, read_pairs
from mindqwen.data.loader import TokenDataset
from mindqwen.io.textfile import read_lines


def load_split(path: Optional[str], tokenizer, seq_length: int, vocab_size: Optional[int] = None,
               reset_positions: bool = False) -> Tuple[Optional[TokenDataset], list]:
    """(token rows, prompt/response pairs) of one split; pairs only for ``.jsonl``.

    Args:
        vocab_size: if given, token ids must lie in [0, vocab_size) (an id past the embedding
            table is not an error in every kernel: it can read zeros and train on them).
        reset_positions: keep the sample boundaries the packer recorded (``position_ids``), so
            each sample of a packed row restarts its positions and attends only to itself
            (``data.reset_positions``); without it the rows carry none.

    Raises:
        ValueError: naming the file (``reset_positions`` with packed rows that record no boundaries).
    """
    if path is None:
        return None, []
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: data not found")
    if os.path.isdir(path):  # a `mindqwen preprocess` folder (memory-mapped)
        from mindqwen.data.preprocess import load_packed
        data, manifest = load_packed(path)
        if manifest.get("seq_length") != seq_length:
            raise ValueError(f"{path}: packed to seq_length={manifest.get('seq_length')}, the recipe says {seq_length}")
    elif path.endswith(".npy"):
        data = TokenDataset(_load_rows(path, seq_length))
    elif path.endswith(".jsonl"):
        if tokenizer is None:
            raise ValueError(f"{path}: prompt/response data needs data.tokenizer")
        pairs = read_pairs(path)
        try:  # one example per row: no boundaries to keep
            return _checked(encode_pairs(pairs, tokenizer, seq_length), path, vocab_size), pairs
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    else:
        raise ValueError(f"{path}: data is a `mindqwen preprocess` folder, .npy token rows or .jsonl "
                         "prompt/response pairs")
    return _checked(_boundaries(data, path, reset_positions), path, vocab_size), []


def load_pretrain(path: str, tokenizer, seq_length: int, vocab_size: Optional[int] = None,
                  reset_positions: bool = False) -> TokenDataset:
    """Pre-training rows: ``.txt`` is packed plain text (each line a sample, ``reset_positions`` as
    in ``load_split``); ``.jsonl`` pairs put the loss on the responses."""
    if path.endswith(".txt"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: data not found")
        if tokenizer is None:
            raise ValueError(f"{path}: plain text needs data.tokenizer")
        try:
            rows = pack_text((line.text.rstrip("\r\n") for line in read_lines(path)), tokenizer, seq_length)
        except ValueError as e:
            raise ValueError(str(e) if str(e).startswith(path) else f"{path}: {e}") from None
        return _checked(_boundaries(rows, path, reset_positions), path, vocab_size)
    return load_split(path, tokenizer, seq_length, vocab_size, reset_positions)[0]


def _boundaries(data: TokenDataset, path: str, reset_positions: bool) -> TokenDataset:
    """``data`` with its sample boundaries if ``reset_positions`` asks for them, else without."""
    if not reset_positions:
        return dataclasses.replace(data, position_ids=None) if data.position_ids is not None else data
    if data.position_ids is None:
        raise ValueError(f"{path}: these rows record no sample boundaries, which data.reset_positions needs: "
                         "pack the data with `mindqwen preprocess` (text or sft), or set it to false")
    return data


def _load_rows(path: str, seq_length: int) -> np.ndarray:
    try:
        ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{path}: not a readable .npy array ({e})") from None
    if ids.ndim != 2 or ids.shape[1] != seq_length or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{path}: expected integer token rows [examples, {seq_length}] (data.seq_length), "
                         f"got {ids.dtype} {list(ids.shape)}")
    return ids


def _checked(data: TokenDataset, path: str, vocab_size: Optional[int]) -> TokenDataset:
    if len(data) == 0:
        raise ValueError(f"{path}: no examples")
    if vocab_size is not None:
        lo, hi = int(data.input_ids.min()), int(data.input_ids.max())
        labels = np.asarray(data.labels)
        bad_label = labels[(labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab_size))]
        if lo < 0 or hi >= vocab_size or bad_label.size:
            raise ValueError(f"{path}: token ids must be in [0, {vocab_size}) (the model's vocab_size), "
                             f"found {lo if lo < 0 else hi if hi >= vocab_size else int(bad_label[0])}")
    return data
