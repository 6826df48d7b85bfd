"""Reading UTF-8 text files line by line, where one bad line is an error naming ``file:line``."""
from __future__ import annotations

import codecs
from typing import Iterator, NamedTuple, Optional


class Line(NamedTuple):
    number: int  # 1-based
    text: Optional[str]  # None when the bytes are not UTF-8
    error: Optional[str]  # why ``text`` is None


def iter_lines(path: str) -> Iterator[Line]:
    """Every line of ``path`` (a UTF-8 byte-order mark at the start is dropped).

    A line that is not UTF-8 comes with ``text=None`` and the decode error, so a caller can skip
    it or stop with ``file:line``; a binary file gives such lines instead of one exception.
    """
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if number == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]
            try:
                yield Line(number, raw.decode("utf-8"), None)
            except UnicodeDecodeError as e:
                yield Line(number, None, f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})")


def read_lines(path: str) -> Iterator[Line]:
    """``iter_lines`` that stops at the first line that is not UTF-8 (``ValueError`` naming it)."""
    for line in iter_lines(path):
        if line.error:
            raise ValueError(f"{path}:{line.number}: {line.error}")
        yield line
