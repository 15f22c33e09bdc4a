"""A safetensors file's header, read and checked by us before the safetensors library sees the file.

    header = read_header(Path("model.safetensors"))   # {name: TensorInfo(dtype="BF16", shape=(40, 32))}

The format: an 8-byte little-endian header length N, N bytes of JSON ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}``, then the data, each tensor's bytes at
[begin, end) of it. Everything a bad or hostile file could get wrong is refused here with one
ValueError naming the file: fewer than 8 bytes, a header longer than `MAX_HEADER_BYTES` or than the
file, invalid JSON, duplicate keys, an unknown dtype, a bad shape, offsets outside the data, overlapping,
leaving gaps, or not matching the shape. So a checked header bounds what loading the file allocates
by the file's size, and sizes can be compared with a model before anything is allocated.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

__all__ = ["TensorInfo", "read_header", "MAX_HEADER_BYTES", "DTYPE_BYTES", "FLOAT_DTYPES"]

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
               "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


class TensorInfo(NamedTuple):
    dtype: str          # the safetensors spelling: "BF16", "F32", "I32", ...
    shape: tuple


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"the header names {dup!r} twice")
    return dict(pairs)


def _entry(name: str, entry, data_bytes: int) -> tuple[TensorInfo, int, int]:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"tensor {name!r}: expected {{'dtype', 'shape', 'data_offsets'}}, got {entry!r:.200}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"tensor {name!r}: dtype {dtype!r:.40} is not one of {sorted(DTYPE_BYTES)}")
    ints = lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
    if not ints(shape):
        raise ValueError(f"tensor {name!r}: shape {shape!r:.200} is not a list of non-negative integers")
    if not ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1] or offsets[1] > data_bytes:
        raise ValueError(f"tensor {name!r}: data_offsets {offsets!r:.200} are not [begin, end] within the "
                         f"{data_bytes} data bytes of the file (truncated?)")
    if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise ValueError(f"tensor {name!r}: shape {shape} of {dtype} needs {math.prod(shape) * DTYPE_BYTES[dtype]} "
                         f"bytes, its data_offsets {offsets} hold {offsets[1] - offsets[0]}")
    return TensorInfo(dtype, tuple(shape)), offsets[0], offsets[1]


def _parse(file: Path) -> dict[str, TensorInfo]:
    size = file.stat().st_size
    with file.open("rb") as f:
        if size < 8:
            raise ValueError(f"only {size} bytes: shorter than the 8-byte header length (truncated)")
        n = int.from_bytes(f.read(8), "little")
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"declares a header of {n} bytes, more than the {MAX_HEADER_BYTES} safetensors allows")
        if 8 + n > size:
            raise ValueError(f"declares a header of {n} bytes but the file has only {size} (truncated)")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"the header is not JSON ({type(err).__name__}: {str(err):.200})") from None
    if not isinstance(header, dict):
        raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("__metadata__ must map strings to strings")
    data_bytes, tensors, spans = size - 8 - n, {}, []
    for name, entry in header.items():
        tensors[name], begin, end = _entry(name, entry, data_bytes)
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            what = "overlaps the tensor before it" if begin < at else f"leaves bytes [{at}, {begin}) unused"
            raise ValueError(f"tensor {name!r}: data_offsets [{begin}, {end}] {what}")
        at = end
    if at != data_bytes:
        raise ValueError(f"the tensors hold {at} bytes but the file has {data_bytes} data bytes after the header")
    return tensors


def read_header(file) -> dict[str, TensorInfo]:
    """Name -> TensorInfo of the safetensors `file`, every offset checked against the file's size."""
    file = Path(file)
    try:
        return _parse(file)
    except ValueError as err:
        raise ValueError(f"{str(file)!r} is not a valid safetensors file: {err}; re-download or re-export it") from None
    except OSError as err:
        raise ValueError(f"{str(file)!r} cannot be read ({err.strerror or err})") from None
