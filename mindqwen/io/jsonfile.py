"""Reading the small JSON files of checkpoint and adapter folders with errors that name them."""
import json
import os
from typing import Any, Type


def read_json(path: str, error: Type[Exception], what: str) -> Any:
    """Parse ``path``; a missing or malformed file raises ``error`` naming the path."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise error(f"{path}: {what} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None


def write_json(path: str, data: Any) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync and a rename: never half a file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, ensure_ascii=False, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
