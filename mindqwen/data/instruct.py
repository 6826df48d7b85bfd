"""Examples → fixed-shape token rows: packed plain text (pre-training) and prompt/response pairs.

Prompt/response rows put the loss on the response (and its EOS) only: prompt positions get label
-100. Rows are right-padded with the pad id, label -100, so every batch has one shape.
"""
from __future__ import annotations

import json
from typing import Iterable, List, Sequence, Tuple

import numpy as np

from mindqwen.config import IGNORE_INDEX
from mindqwen.data.loader import TokenDataset, sample_positions
from mindqwen.io.textfile import read_lines

Pair = Tuple[str, str]  # (prompt, response)


def pack_text(lines: Iterable[str], tokenizer, seq_length: int) -> TokenDataset:
    """Concatenate ``text + EOS`` for every line and cut into rows of ``seq_length`` (tail dropped),
    with each line's positions (``position_ids``: 0 where a line starts, and where a line cut at a
    row's end continues)."""
    ids: List[int] = []
    first: List[int] = []  # where each line starts
    for line in lines:
        first.append(len(ids))
        ids.extend(tokenizer.encode(line))
        ids.append(tokenizer.eos_token_id)
    rows = len(ids) // seq_length
    if rows == 0:
        raise ValueError(f"{len(ids)} tokens cannot fill one row of seq_length={seq_length}")
    starts = np.zeros(rows * seq_length, bool)
    starts[[i for i in first if i < starts.size]] = True
    starts[::seq_length] = True
    return TokenDataset(np.asarray(ids[:rows * seq_length], np.int32).reshape(rows, seq_length),
                        position_ids=sample_positions(starts.reshape(rows, seq_length)))


def encode_pairs(pairs: Sequence[Pair], tokenizer, seq_length: int) -> TokenDataset:
    """One row per pair: prompt + response + EOS, loss on the response and EOS only.

    Raises:
        ValueError: naming the first pair that does not fit in ``seq_length``.
    """
    ids = np.full((len(pairs), seq_length), tokenizer.pad_token_id, np.int32)
    labels = np.full((len(pairs), seq_length), IGNORE_INDEX, np.int32)
    for i, (prompt, response) in enumerate(pairs):
        p = tokenizer.encode(prompt)
        r = tokenizer.encode(response) + [tokenizer.eos_token_id]
        if len(p) + len(r) > seq_length:
            raise ValueError(f"example {i} is {len(p) + len(r)} tokens, longer than seq_length={seq_length}: "
                             f"{prompt!r}")
        ids[i, :len(p) + len(r)] = p + r
        labels[i, len(p):len(p) + len(r)] = r
    return TokenDataset(ids, labels)


def read_pairs(path: str) -> List[Pair]:
    """A JSON-lines file of ``{"prompt": ..., "response": ...}`` objects.

    Raises:
        ValueError: naming the file and line of the first malformed record.
    """
    pairs = []
    for n, line, _ in read_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
        if not (isinstance(record, dict) and isinstance(record.get("prompt"), str)
                and isinstance(record.get("response"), str)):
            raise ValueError(f"{path}:{n}: expected {{\"prompt\": <string>, \"response\": <string>}}, "
                             f"got {line.strip()[:80]}")
        pairs.append((record["prompt"], record["response"]))
    if not pairs:
        raise ValueError(f"{path}: no examples")
    return pairs


def write_pairs(pairs: Sequence[Pair], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for prompt, response in pairs:
            f.write(json.dumps({"prompt": prompt, "response": response}, ensure_ascii=False) + "\n")
