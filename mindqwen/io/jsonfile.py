"""Reading the small JSON files of checkpoint and adapter folders with errors that name them."""
import json
from typing import Any, Type

from mindqwen.io.atomic import atomic_file


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
    """Write ``data`` to ``path`` atomically (``atomic_file``): never half a file."""
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False, default=str)
