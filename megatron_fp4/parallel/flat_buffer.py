"""The flat buffers of `parallel.zero.ZeroAdamW`: bucket planning and ownership (pure), the buffer of
one parameter group, and the piecewise passes over a buffer (sum of squares, finiteness) that touch
every parameter once without a parameter-sized temporary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

# Elements per piece of the optimizer's passes over a flat buffer (gradient norm, clipping, AdamW):
# a few MB, so a piece's clipped gradient is still in cache when AdamW reads it and no
# parameter-sized temporary is allocated. A multiple of every SIMD width (64 elements), so cutting
# a tensor into pieces never moves the fused kernel's vector/scalar split: the bits of one call.
CHUNK_NUMEL = 1 << 20  # (the memory planner reads it)


def plan_buckets(numels: list[int], bucket_numel: int, group_size: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Pure: (offset of every param, [(start, end)] of every bucket) for params laid out in order.

    A bucket closes once it holds >= bucket_numel elements; its end is padded to a multiple of
    group_size so every rank owns an equal slice."""
    offsets, buckets, start, pos = [], [], 0, 0
    for i, n in enumerate(numels):
        offsets.append(pos)
        pos += n
        if pos - start >= bucket_numel or i == len(numels) - 1:
            pos = start + math.ceil((pos - start) / group_size) * group_size
            buckets.append((start, pos))
            start = pos
    return offsets, buckets


def owned_ranges(buckets: list[tuple[int, int]], group_size: int, group_rank: int) -> list[tuple[int, int]]:
    """Pure: the buffer ranges rank `group_rank` owns (its slice of every bucket)."""
    out = []
    for start, end in buckets:
        size = (end - start) // group_size
        out.append((start + group_rank * size, start + (group_rank + 1) * size))
    return out


def merge_ranges(ranges) -> list[tuple[int, int]]:
    """Pure: `ranges` (in order) with back-to-back neighbours joined."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


NORM_ROW = 1024  # elements of one row of `sum_of_squares`' fused pass (a multiple of every SIMD width)


def sum_of_squares(flat: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """Σ flat² in `wide`, as accurate as ``flat.to(wide).pow(2).sum()`` (error ~ log2(n)·u relative, not
    the n·u of one running sum) and without a parameter-sized temporary.

    A tensor already in `wide` (fp32/fp64 gradients, the common case) is read once: its rows of
    NORM_ROW elements each reduced by ATen's vectorized L2 norm (fused multiply-adds into one
    accumulator per SIMD lane: NORM_ROW / lanes terms each, error <= ~80u of the row's sum), the
    rows' squared norms then summed by torch's pairwise reduction; a pass of squares into a buffer
    and a second reading them cost ~1.5x that at 100M+ parameters (issue 37). Another dtype
    (bf16 gradients): each chunk cast into one reused `wide` buffer, squared there and summed."""
    if flat.numel() == 0:
        return torch.zeros((), dtype=wide, device=flat.device)
    flat = flat.reshape(-1)
    if flat.dtype == wide:
        whole = flat.numel() // NORM_ROW * NORM_ROW
        parts = []
        if whole:
            rows = torch.linalg.vector_norm(flat[:whole].view(-1, NORM_ROW), dim=-1)
            parts.append(rows.mul_(rows).sum())
        if whole < flat.numel():
            tail = flat[whole:]
            parts.append((tail * tail).sum())
        return parts[0] if len(parts) == 1 else parts[0] + parts[1]
    scratch = torch.empty(min(CHUNK_NUMEL, flat.numel()), dtype=wide, device=flat.device)
    parts = []
    for lo in range(0, flat.numel(), CHUNK_NUMEL):
        piece = scratch[:min(CHUNK_NUMEL, flat.numel() - lo)]
        piece.copy_(flat[lo:lo + CHUNK_NUMEL]).mul_(piece)
        parts.append(piece.sum())
    return torch.stack(parts).sum()


@dataclass
class Bucket:
    start: int
    end: int
    params: list
    pending: int = 0
    work: Optional[object] = None


@dataclass
class FlatBuffer:
    """Params of one (dtype, axis, weight decay) group with their grad buffer, buckets and shard."""

    axis: str
    group: Optional[object]
    group_size: int
    group_rank: int
    weight_decay: float
    names: list
    params: list
    offsets: list
    buckets: list
    data: torch.Tensor
    grad: torch.Tensor
    owned: list  # [(lo, hi)] buffer ranges this rank owns
    state_ranges: list = field(default_factory=list)  # buffer ranges this rank keeps Adam state for

    @property
    def numel(self) -> int:
        return self.data.numel()

    def param_view(self, i: int, flat: torch.Tensor) -> torch.Tensor:
        p = self.params[i]
        return flat[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)

    def gather_ranges(self, flat: torch.Tensor, ranges) -> torch.Tensor:
        """`flat`'s elements in `ranges`, concatenated: a view when they are one contiguous span (a
        group of one owns every bucket back to back), a copy only for a rank's disjoint slices."""
        spans = merge_ranges(ranges)
        return flat[spans[0][0]:spans[0][1]] if len(spans) == 1 else torch.cat([flat[lo:hi] for lo, hi in spans])

    def pieces(self, ranges=None):
        """(param index, param element lo, hi, offset in the concatenated ranges) of every param part
        inside `ranges` (default: the ranges this rank keeps Adam state for)."""
        out, state_pos = [], 0
        for lo, hi in self.state_ranges if ranges is None else ranges:
            for i, p in enumerate(self.params):
                a, b = max(lo, self.offsets[i]), min(hi, self.offsets[i] + p.numel())
                if a < b:
                    out.append((i, a - self.offsets[i], b - self.offsets[i], state_pos + a - lo))
            state_pos += hi - lo
        return out


def all_finite_pieces(flat: torch.Tensor, piece_sums: list) -> bool:
    """Whether `flat` (whose pieces sum to `piece_sums`) is all finite: a sum is non-finite whenever
    a term is (NaN propagates, an infinity stays or meets its opposite as NaN), so finite sums prove
    it; a finite tensor whose sum overflows gets the exact scan (`training.nonfinite.all_finite`'s rule)."""
    if bool(torch.isfinite(torch.stack(piece_sums).to(torch.float32)).all()):
        return True
    return bool(torch.isfinite(flat).all())
