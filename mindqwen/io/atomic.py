"""Writing a file so that it appears whole or not at all: a temporary name, fsync, one rename."""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def atomic_file(path: str, suffix: str = "") -> Iterator[str]:
    """Yield a temporary path next to ``path`` to write; on success it is fsynced and renamed to
    ``path`` (replacing it), on any error removed. A killed process leaves only ``*.tmp-<pid>*``.

    Args:
        suffix: kept at the end of the temporary name, for writers that choose the format by it
            (``.ckpt``, ``.png``).
    """
    tmp = f"{path}.tmp-{os.getpid()}{suffix}"
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
