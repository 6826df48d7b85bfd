"""Writing a file or a folder so that it appears whole or not at all: a temporary name, fsync,
one rename."""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Iterator, List, Tuple


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


@contextmanager
def atomic_folder(folder: str, replace: bool = True) -> Iterator[str]:
    """Yield a staging folder next to ``folder`` to fill; on success it becomes ``folder`` (an
    existing one is swapped out only then, and deleted), on any error it is removed.

    Args:
        replace: False refuses to overwrite an existing ``folder`` (``FileExistsError``).
    """
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    if not replace and os.path.exists(folder):
        raise FileExistsError(f"{folder} exists; not overwriting it")
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.tmp-", dir=parent)
    try:
        yield staging
        if os.path.exists(folder):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.old-", dir=parent)
            os.replace(folder, os.path.join(old, "x"))
            os.replace(staging, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


@contextmanager
def staged_files(folder: str) -> Iterator[Tuple[str, List[str]]]:
    """Yield ``(stage, names)``: write files into the staging folder ``stage`` (inside ``folder``)
    and list them in ``names``. On success they move into ``folder`` one rename each, in that
    order (the last marks the folder complete: an index, a config); other files in ``folder``
    stay. On any error nothing moves. The staging folder is removed either way.
    """
    os.makedirs(folder, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=".tmp-", dir=folder)
    names: List[str] = []
    try:
        yield stage, names
        for name in names:
            os.replace(os.path.join(stage, name), os.path.join(folder, name))
    finally:
        shutil.rmtree(stage, ignore_errors=True)
