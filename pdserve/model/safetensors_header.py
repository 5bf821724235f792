"""A safetensors file's header, read and checked without torch and without reading a tensor's bytes.

Contract: `read_header(file)` returns every tensor's name, dtype, shape and absolute byte span,
or raises `CheckpointError` naming the file and what is wrong: a header length past
`MAX_HEADER_BYTES` or past the file, a header that is not a JSON object of tensor entries, a
dtype safetensors does not define, a shape that is not a list of non-negative integers, a span
whose length is not the shape's bytes, a span that ends past the file (a truncated file), or
spans that do not tile the data section exactly (what safetensors itself refuses at load).
Every message starts "unreadable safetensors header" or "unreadable safetensors file".

It is what the serving process reads at pre-flight (api/preflight.py), so a checkpoint a worker
could not load is refused once, before any worker starts, instead of crashing every worker.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from pdserve.model.errors import CheckpointError

# safetensors refuses a header longer than this (its own MAX_HEADER_SIZE); reading a length field
# of 2**62 as given would ask for exabytes before the JSON parse could say anything.
MAX_HEADER_BYTES = 100_000_000
LENGTH_BYTES = 8  # the header's length: a little-endian u64 at the start of the file

# bytes per element of the dtypes safetensors defines (the sub-byte F4/F6 kinds are left out:
# no loader here reads them)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as its file's header describes it; `start`/`end` are byte offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(file: Path) -> list[TensorEntry]:
    """Every tensor of `file` (the `__metadata__` entry left out), each checked against the file's size."""
    try:
        file_bytes = os.path.getsize(file)
        with open(file, "rb") as f:
            raw_length = f.read(LENGTH_BYTES)
            if len(raw_length) < LENGTH_BYTES:
                raise CheckpointError(file, f"unreadable safetensors header (the file is {file_bytes} bytes, "
                                            f"shorter than the header's {LENGTH_BYTES}-byte length)")
            (length,) = struct.unpack("<Q", raw_length)
            _check_length(file, length, file_bytes)
            header = json.loads(f.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(file, f"unreadable safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(file, f"unreadable safetensors header (a JSON {type(header).__name__}, not an object)")
    header.pop("__metadata__", None)
    base = LENGTH_BYTES + length
    entries = [_entry(file, name, info, base, file_bytes) for name, info in header.items()]
    _check_layout(file, entries, base, file_bytes)
    return entries


def _check_length(file: Path, length: int, file_bytes: int) -> None:
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(file, f"unreadable safetensors header (its length field says {length} bytes; "
                                    f"safetensors allows at most {MAX_HEADER_BYTES})")
    if LENGTH_BYTES + length > file_bytes:
        raise CheckpointError(file, f"unreadable safetensors header (its length field says {length} bytes; "
                                    f"the file is {file_bytes} bytes: truncated?)")


def _entry(file: Path, name: str, info: object, base: int, file_bytes: int) -> TensorEntry:
    """One header entry checked: its dtype known, its shape sane, its span the shape's bytes and in the file."""
    if not isinstance(info, dict):
        raise CheckpointError(file, f"unreadable safetensors header (entry {name!r} is not an object)")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(file, f"unreadable safetensors header (tensor {name!r} has dtype {dtype!r}, "
                                    f"not one safetensors defines)")
    if not _naturals(shape):
        raise CheckpointError(file, f"unreadable safetensors header (tensor {name!r} has shape {shape!r})")
    if not _naturals(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise CheckpointError(file, f"unreadable safetensors header (tensor {name!r} has data_offsets {offsets!r})")
    want = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != want:
        raise CheckpointError(file, f"unreadable safetensors header (tensor {name!r} of shape {tuple(shape)} {dtype} "
                                    f"needs {want} bytes; its data_offsets {offsets} span {offsets[1] - offsets[0]})")
    if base + offsets[1] > file_bytes:
        raise CheckpointError(file, f"unreadable safetensors file (tensor {name!r} ends at byte {base + offsets[1]}, "
                                    f"past the file's {file_bytes} bytes: truncated?)")
    return TensorEntry(name, dtype, tuple(shape), base + offsets[0], base + offsets[1])


def _check_layout(file: Path, entries: list[TensorEntry], base: int, file_bytes: int) -> None:
    """The tensors tile the data section exactly, as safetensors' own `validate` demands at load:
    a gap, an overlap or bytes past the last tensor would pass here and fail in every worker."""
    at = base
    for entry in sorted(entries, key=lambda e: (e.start, e.end)):
        if entry.start != at:
            raise CheckpointError(file, f"unreadable safetensors header (tensor {entry.name!r} starts at byte "
                                        f"{entry.start}; the data before it ends at {at})")
        at = entry.end
    if at != file_bytes:
        raise CheckpointError(file, f"unreadable safetensors file ({file_bytes - at} bytes after the last tensor)")


def _naturals(value: object) -> bool:
    """A list of non-negative ints (bools excluded: JSON's true would pass as 1)."""
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
