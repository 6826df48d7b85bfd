"""Lazy safetensors reading and atomic, streaming writing, with exact bf16 handling.

Reading parses the header itself and reads one tensor at a time when asked for, so a model is
never held twice. bf16 becomes fp32 by a 16-bit shift (exact); fp32 becomes
bf16 by round-to-nearest-even. Written files appear under their final name only when complete.
"""
from __future__ import annotations

import json
import math
import os
import struct
from typing import Callable, Dict, Iterable, Mapping, NamedTuple, Optional, Tuple, Union

import numpy as np

from mindqwen.io.atomic import atomic_file

# safetensors dtype tag -> numpy storage dtype (bf16 is stored as its raw uint16 bits).
_STORAGE = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
            "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
            "BOOL": np.bool_}
_TAG = {np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
        np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16",
        np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint file or folder that cannot be read or does not fit the model."""


_BF16_SLICE = 1 << 22  # elements rounded at a time when writing bf16 (16 MB of fp32)


def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    """Raw bf16 bits (uint16) → float32, exactly."""
    wide = bits.astype(np.uint32)
    wide <<= 16  # in place: one fp32-sized buffer, not two
    return wide.view(np.float32)


def fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → raw bf16 bits (uint16), rounding to nearest, ties to even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + (((u >> 16) & 1) + np.uint32(0x7FFF))) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def is_finite(arr: np.ndarray) -> bool:
    """No NaN or inf in ``arr`` (integers always pass). One float64 sum, no boolean copy:
    NaN and inf survive a sum, and finite fp32 values cannot overflow one (|x| < 3.4e38)."""
    if not np.issubdtype(arr.dtype, np.floating) or arr.size == 0:
        return True
    with np.errstate(invalid="ignore", over="ignore"):  # inf + -inf: NaN, which is the answer
        return math.isfinite(arr.sum(dtype=np.float64))


def check_finite(arr: np.ndarray, where: str, name: str) -> np.ndarray:
    """``arr``, or ``CheckpointError`` naming ``where`` and tensor ``name`` if it holds NaN or inf."""
    if not is_finite(arr):
        bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr)))
        raise CheckpointError(f"{where}: tensor {name} has {bad:,} non-finite values (NaN or inf); "
                              "allow_non_finite=True (--allow-non-finite) loads it anyway")
    return arr


class SafetensorsFile:
    """Header of one safetensors file, with tensors read on demand from a memory map.

    Args:
        path: the file.
        allow_non_finite: ``get`` returns tensors holding NaN or inf instead of raising.

    Raises:
        CheckpointError: naming the file, if it is missing, truncated or its header is corrupt.
    """

    def __init__(self, path: str, allow_non_finite: bool = False):
        self.path = str(path)
        self.allow_non_finite = allow_non_finite
        if not os.path.isfile(self.path):
            raise CheckpointError(f"{self.path}: file not found")
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{self.path}: truncated safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER):
                raise CheckpointError(f"{self.path}: corrupt or truncated safetensors header "
                                      f"(header length {n}, file size {size})")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        self._entries: Dict[str, Tuple[str, Tuple[int, ...], int, int]] = {}
        for key, e in header.items():
            try:
                dtype, shape, (start, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: corrupt header entry for tensor {key}") from None
            if dtype not in _STORAGE:
                raise CheckpointError(f"{self.path}: tensor {key} has unsupported dtype {dtype}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(_STORAGE[dtype]).itemsize
            if end - start != nbytes or start < 0:
                raise CheckpointError(f"{self.path}: tensor {key} has {end - start} bytes, "
                                      f"its shape {list(shape)} and dtype {dtype} need {nbytes}")
            if self._data_start + end > size:
                raise CheckpointError(f"{self.path}: truncated file: tensor {key} ends at byte "
                                      f"{self._data_start + end}, the file has {size}")
            self._entries[key] = (dtype, shape, start, end)

    def keys(self) -> Iterable[str]:
        return self._entries.keys()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def shape(self, key: str) -> Tuple[int, ...]:
        return self._entries[key][1]

    def dtype(self, key: str) -> str:
        return self._entries[key][0]

    def raw(self, key: str) -> np.ndarray:
        """The stored array (bf16 as uint16 bits), read from disk now.

        A positioned read, not a memory map: mapped pages count as resident memory, which
        would put the whole file on top of the model while loading.
        """
        dtype, shape, start, end = self._entries[key]
        storage = np.dtype(_STORAGE[dtype])
        arr = np.fromfile(self.path, dtype=storage, count=(end - start) // storage.itemsize,
                          offset=self._data_start + start)
        return arr.reshape(shape)

    def get(self, key: str, dtype=np.float32) -> np.ndarray:
        """Tensor ``key`` as a new array of ``dtype`` (floats; bf16 widened exactly).

        Raises:
            CheckpointError: if it holds NaN or inf (unless ``allow_non_finite``).
        """
        arr = self.raw(key)
        if self.dtype(key) == "BF16":
            arr = bf16_bits_to_fp32(arr)
        arr = arr.astype(dtype, copy=False)
        return arr if self.allow_non_finite else check_finite(arr, self.path, key)


class LazyTensor(NamedTuple):
    """A tensor known by shape and dtype, read only when written (``load()``)."""
    shape: Tuple[int, ...]
    dtype: np.dtype
    load: Callable[[], np.ndarray]


def save_file(tensors: Mapping[str, Union[np.ndarray, LazyTensor]], path: str,
              metadata: Optional[Dict[str, str]] = None, bf16: bool = False) -> None:
    """Write tensors to ``path`` atomically (``atomic_file``: temp file, fsync, rename).

    ``LazyTensor`` values are loaded one at a time while writing, so peak memory stays near the
    largest tensor. With ``bf16=True`` floating tensors are stored as bf16 (round to nearest even).
    """
    header: Dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, t in tensors.items():
        dtype = np.dtype(t.dtype)
        tag = "BF16" if bf16 and np.issubdtype(dtype, np.floating) else _TAG.get(dtype)
        if tag is None:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        nbytes = int(np.prod(t.shape, dtype=np.int64)) * (2 if tag == "BF16" else dtype.itemsize)
        header[name] = {"dtype": tag, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, t in tensors.items():
            arr = np.ascontiguousarray(t.load() if isinstance(t, LazyTensor) else t)
            if header[name]["dtype"] == "BF16":  # rounded in slices: no full-size temporaries
                flat = arr.reshape(-1)
                for i in range(0, flat.size, _BF16_SLICE):
                    f.write(memoryview(fp32_to_bf16_bits(flat[i:i + _BF16_SLICE])).cast("B"))
            else:
                f.write(memoryview(arr).cast("B"))  # no bytes copy of the tensor
