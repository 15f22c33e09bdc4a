"""The wire format of a weight update: (name, shape, dtype, bytes) metadata plus flat byte buckets.

It is the format verl's checkpoint engines carry (`verl.checkpoint_engine.base.TensorMeta`: name,
shape, dtype, chunk_offset, chunk_size, offset): a tensor larger than a bucket is split into
chunks, each chunk says where its bytes sit in the tensor and in the bucket. Packing copies every
byte into fresh buffers, so a packed update is an immutable snapshot of the weights.

Across processes the metadata travels as JSON (`manifest_to_json` / `layout_to_json` and their
`_from_json` inverses, which accept only well-formed values and known torch dtypes), never pickle:
a peer's message is data. `unpack_buckets` checks every chunk with real checks (not `assert`,
which `python -O` strips) and raises `BucketError` naming the tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch


class BucketError(ValueError):
    """A bucket, its metadata or a JSON header is malformed, inconsistent or incomplete."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple
    dtype: torch.dtype
    chunk_offset: int  # byte offset of this chunk inside the tensor
    chunk_size: int  # bytes of this chunk
    offset: int  # byte offset of this chunk inside its bucket

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass
class Bucket:
    metas: list
    buffer: torch.Tensor  # uint8 [bucket bytes]


def manifest_of(named_tensors: Iterable) -> dict:
    """name -> (shape, dtype): what a receiver validates before it touches anything."""
    return {n: (tuple(t.shape), t.dtype) for n, t in named_tensors}


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().view(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def plan_buckets(manifest: dict, bucket_bytes: int) -> list:
    """Where every byte of the tensors `manifest` (name -> (shape, dtype), in order) goes: per bucket
    (metas, nbytes), buckets of at most `bucket_bytes` bytes (the last may be smaller). Needs no
    data, so every rank of a sharded trainer computes the same plan from the manifest alone."""
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} must be a positive integer (e.g. 4 << 20 for 4 MiB)")
    plan, metas, used = [], [], 0
    for name, (shape, dtype) in manifest.items():
        meta = TensorMeta(name, tuple(shape), dtype, 0, 0, used)
        if meta.nbytes == 0:
            metas.append(meta)
            continue
        start = 0
        while start < meta.nbytes:
            if used == bucket_bytes:
                plan.append((metas, used))
                metas, used = [], 0
            size = min(bucket_bytes - used, meta.nbytes - start)
            metas.append(TensorMeta(name, tuple(shape), dtype, start, size, used))
            used += size
            start += size
    if metas:
        plan.append((metas, used))
    return plan


def pack_buckets(named_tensors: Iterable, bucket_bytes: int) -> list:
    """Copy `(name, tensor)` pairs into buckets of at most `bucket_bytes` bytes (the last may be
    smaller). Returns a list of `Bucket` whose buffers share no memory with the inputs."""
    named = dict(named_tensors)
    buckets = []
    for metas, nbytes in plan_buckets(manifest_of(named.items()), bucket_bytes):
        buffer = torch.empty(nbytes, dtype=torch.uint8)  # fresh: the bucket owns its bytes (the snapshot)
        for m in metas:
            buffer[m.offset:m.offset + m.chunk_size] = _bytes_of(named[m.name])[m.chunk_offset:m.chunk_offset + m.chunk_size]
        buckets.append(Bucket(metas, buffer))
    return buckets


def _check_meta(m: TensorMeta, bucket_nbytes: int) -> None:
    if m.chunk_offset < 0 or m.chunk_size < 0 or m.offset < 0:
        raise BucketError(f"chunk of {m.name!r} has a negative offset or size ({m})")
    if m.chunk_offset + m.chunk_size > m.nbytes:
        raise BucketError(f"chunk of {m.name!r} ends at byte {m.chunk_offset + m.chunk_size} of a "
                          f"{m.nbytes}-byte tensor (shape {tuple(m.shape)}, {m.dtype})")
    if m.offset + m.chunk_size > bucket_nbytes:
        raise BucketError(f"chunk of {m.name!r} ends at byte {m.offset + m.chunk_size} of a "
                          f"{bucket_nbytes}-byte bucket")


def unpack_buckets(buckets: Iterable) -> dict:
    """Reassemble buckets into fresh tensors: name -> tensor. Raises `BucketError` unless every chunk
    arrived in order, inside its bucket and tensor, and every tensor is complete."""
    out, filled = {}, {}
    for bucket in buckets:
        bucket_nbytes = int(bucket.buffer.numel())
        for m in bucket.metas:
            _check_meta(m, bucket_nbytes)
            if m.name not in out:
                out[m.name] = torch.empty(m.shape, dtype=m.dtype)
                filled[m.name] = 0
            elif (tuple(out[m.name].shape), out[m.name].dtype) != (tuple(m.shape), m.dtype):
                raise BucketError(f"chunks of {m.name!r} disagree on shape/dtype: {tuple(out[m.name].shape)} "
                                  f"{out[m.name].dtype} vs {tuple(m.shape)} {m.dtype}")
            if m.chunk_size:
                if filled[m.name] != m.chunk_offset:
                    raise BucketError(f"chunk of {m.name!r} out of order: starts at byte {m.chunk_offset}, "
                                      f"expected {filled[m.name]}")
                _bytes_of(out[m.name])[m.chunk_offset:m.chunk_offset + m.chunk_size] = \
                    bucket.buffer[m.offset:m.offset + m.chunk_size]
                filled[m.name] += m.chunk_size
    for name, t in out.items():
        if filled[name] != t.numel() * t.element_size():
            raise BucketError(f"tensor {name!r} arrived incomplete: {filled[name]} of "
                              f"{t.numel() * t.element_size()} bytes")
    return out


def bucket_layout(buckets: list) -> list:
    """Per bucket (metas, nbytes): everything but the bytes, for a receiver to allocate buffers.
    Lazily gathered buckets (a sharded publisher's) give it without materialising any."""
    if hasattr(buckets, "layout"):
        return buckets.layout()
    return [(b.metas, int(b.nbytes if hasattr(b, "nbytes") else b.buffer.numel())) for b in buckets]


# -- JSON forms (what crosses a process boundary) ---------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name) -> torch.dtype:
    """The torch dtype called `name` ("float32", "bfloat16", ...); anything else is refused."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise BucketError(f"unknown dtype {name!r} in a weight-sync header")
    return dtype


def _nonneg_int(value, what: str) -> int:
    if type(value) is not int or value < 0:  # bool is an int subclass: refused too
        raise BucketError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _shape(value, what: str) -> tuple:
    if not isinstance(value, list):
        raise BucketError(f"{what} must be a list of non-negative integers, got {value!r}")
    return tuple(_nonneg_int(s, what) for s in value)


def _name(value, what: str) -> str:
    if not isinstance(value, str):
        raise BucketError(f"{what} must be a string, got {value!r}")
    return value


def manifest_to_json(manifest: dict) -> list:
    return [[n, list(shape), dtype_name(dtype)] for n, (shape, dtype) in manifest.items()]


def manifest_from_json(obj) -> dict:
    """Inverse of `manifest_to_json`; raises `BucketError` on anything malformed."""
    if not isinstance(obj, list) or not all(isinstance(e, list) and len(e) == 3 for e in obj):
        raise BucketError("a weight-sync manifest must be a list of [name, shape, dtype]")
    return {_name(n, "tensor name"): (_shape(shape, f"shape of {n!r}"), dtype_from_name(dtype))
            for n, shape, dtype in obj}


def layout_to_json(layout: list) -> list:
    return [[[[m.name, list(m.shape), dtype_name(m.dtype), m.chunk_offset, m.chunk_size, m.offset] for m in metas],
             nbytes] for metas, nbytes in layout]


def layout_from_json(obj) -> list:
    """Inverse of `layout_to_json` (a `bucket_layout`): every chunk checked against its bucket."""
    if not isinstance(obj, list) or not all(isinstance(b, list) and len(b) == 2 and isinstance(b[0], list)
                                            for b in obj):
        raise BucketError("a weight-sync bucket layout must be a list of [metas, nbytes]")
    layout = []
    for metas, nbytes in obj:
        nbytes = _nonneg_int(nbytes, "bucket size")
        parsed = []
        for m in metas:
            if not isinstance(m, list) or len(m) != 6:
                raise BucketError(f"a chunk must be [name, shape, dtype, chunk_offset, chunk_size, offset], got {m!r}")
            name = _name(m[0], "tensor name")
            meta = TensorMeta(name, _shape(m[1], f"shape of {name!r}"), dtype_from_name(m[2]),
                              *(_nonneg_int(v, f"offset/size of a chunk of {name!r}") for v in m[3:]))
            _check_meta(meta, nbytes)
            parsed.append(meta)
        layout.append((parsed, nbytes))
    return layout


def check_layout(manifest: dict, layout: list) -> int:
    """A received layout must place exactly the manifest's bytes the way `plan_buckets` does: every
    chunk of a tensor the manifest lists with its shape and dtype, each tensor's chunks in order and
    complete, each bucket exactly its chunks back to back. -> the total bytes (what a receiver
    allocates: no more than the manifest's tensors, checked before anything is allocated)."""
    filled = dict.fromkeys(manifest, 0)
    total = 0
    for index, (metas, nbytes) in enumerate(layout):
        used = 0
        for m in metas:
            if m.name not in manifest or (tuple(m.shape), m.dtype) != tuple(manifest[m.name]):
                raise BucketError(f"bucket {index} holds a chunk of {m.name!r} {tuple(m.shape)} {m.dtype}, which the "
                                  "manifest does not list with that shape and dtype")
            if m.chunk_offset != filled[m.name] or m.offset != used:
                raise BucketError(f"bucket {index}: the chunk of {m.name!r} at tensor byte {m.chunk_offset}, bucket "
                                  f"byte {m.offset} does not follow the previous one (expected "
                                  f"{filled[m.name]}, {used})")
            filled[m.name] += m.chunk_size
            used += m.chunk_size
        if nbytes != used:
            raise BucketError(f"bucket {index} declares {nbytes} bytes but its chunks hold {used}")
        total += nbytes
    for name, (shape, dtype) in manifest.items():
        expected = TensorMeta(name, tuple(shape), dtype, 0, 0, 0).nbytes
        if filled[name] != expected:
            raise BucketError(f"the layout carries {filled[name]} of the {expected} bytes of {name!r}")
    return total
