"""The wire format of a weight update: (name, shape, dtype, bytes) metadata plus flat byte buckets.

It is the format verl's checkpoint engines carry (`verl.checkpoint_engine.base.TensorMeta`: name,
shape, dtype, chunk_offset, chunk_size, offset): a tensor larger than a bucket is split into
chunks, each chunk says where its bytes sit in the tensor and in the bucket. Packing copies every
byte into fresh buffers, so a packed update is an immutable snapshot of the weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch


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


def pack_buckets(named_tensors: Iterable, bucket_bytes: int) -> list:
    """Copy `(name, tensor)` pairs into buckets of at most `bucket_bytes` bytes (the last may be
    smaller). Returns a list of `Bucket` whose buffers share no memory with the inputs."""
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} must be a positive integer (e.g. 4 << 20 for 4 MiB)")
    buckets, metas, parts, used = [], [], [], 0

    def flush():
        nonlocal metas, parts, used
        if metas:
            # torch.cat always allocates: the bucket owns its bytes (the snapshot).
            buckets.append(Bucket(metas, torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)))
        metas, parts, used = [], [], 0

    for name, tensor in named_tensors:
        raw = _bytes_of(tensor)
        shape, dtype = tuple(tensor.shape), tensor.dtype
        if raw.numel() == 0:
            metas.append(TensorMeta(name, shape, dtype, 0, 0, used))
            continue
        start = 0
        while start < raw.numel():
            if used == bucket_bytes:
                flush()
            size = min(bucket_bytes - used, raw.numel() - start)
            metas.append(TensorMeta(name, shape, dtype, start, size, used))
            parts.append(raw[start:start + size])
            used += size
            start += size
    flush()
    return buckets


def unpack_buckets(buckets: Iterable) -> dict:
    """Reassemble buckets into fresh tensors: name -> tensor. Asserts every chunk arrived in order."""
    out, filled = {}, {}
    for bucket in buckets:
        for m in bucket.metas:
            if m.name not in out:
                out[m.name] = torch.empty(m.shape, dtype=m.dtype)
                filled[m.name] = 0
            if m.chunk_size:
                assert filled[m.name] == m.chunk_offset, f"chunk of {m.name!r} out of order"
                _bytes_of(out[m.name])[m.chunk_offset:m.chunk_offset + m.chunk_size] = \
                    bucket.buffer[m.offset:m.offset + m.chunk_size]
                filled[m.name] += m.chunk_size
    for name, t in out.items():
        assert filled[name] == t.numel() * t.element_size(), f"tensor {name!r} arrived incomplete"
    return out


def bucket_layout(buckets: list) -> list:
    """Per bucket (metas, nbytes): everything but the bytes, for a receiver to allocate buffers."""
    return [(b.metas, int(b.buffer.numel())) for b in buckets]
