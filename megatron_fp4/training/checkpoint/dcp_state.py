"""The AdamW state of tp / etp-cut weights in DCP checkpoints, reshardable (`checkpoint/dcp.py`).

ZeRO keeps a rank's AdamW state (fp32 master, exp_avg, exp_avg_sq) as flat ranges of its *local*
shard of a weight. A cut (``tp_shard`` / ``etp_shard = (dim, index)``) holds the global positions
`index` of dim ``dim``; fold the global weight at that dim into a 2-D view ``[rows, cols]`` (rows:
the dims before it, a rank's experts under ep a block of them; cols: the cut dim and the dims after
it). The local shard is then a block of rows times one column block per contiguous run of `index`
(w13's gate and up rows under etp: two), and a flat range of it is at most three row-major
rectangles per run. So each state kind of a cut weight is stored as one global ``[rows, cols]``
tensor, ``optim/<name>/<kind>``, each rank writing its rectangles as DCP chunks (`StateChunks`:
DTensor's checkpoint hooks for an arbitrary chunk list), and a later layout's ranks request their
own rectangles, which DCP reads out of whatever chunks overlap them: the state reshards across tp,
etp, dp, ep, pp and ZeRO stage like the weights. Nothing is gathered on save.

(A DTensor with the weight's placement cannot hold it: a ZeRO range cuts through the local shard's
rows, which no placement describes. The 2-D fold is the weight's global tensor reshaped.)

Checkpoints written before this (``optim/<name>/tp<i>/<kind>/<offset>``, pieces of the local shard)
are still read at the tp / etp they were saved with (`dcp.py`, `dcp_tp.check_tp_layout`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


@dataclass(frozen=True)
class Fold:
    """A cut weight's local shard inside the 2-D view of its global tensor."""
    shape: tuple  # (rows, cols) of the global view
    local_cols: int
    row_offset: int  # of the local rows (a rank's experts under ep)
    runs: tuple  # ((local col start, local col end, global col start), ...): one per contiguous run of the index
    flat_offset: int = 0  # a whole weight's (`whole`): where its local elements start in the global flat tensor


def whole(shape: tuple, flat_offset: int) -> Fold:
    """A weight no cut touches (its local elements a contiguous range of the global ones, from
    `flat_offset`: a rank's experts under ep) inside a saved 2-D state tensor of `shape`, which is
    its global tensor reshaped (a checkpoint of a layout that cut it)."""
    return Fold(tuple(shape), shape[1], 0, ((0, shape[1], 0),), flat_offset)


def fold(p, mesh, expert: tuple | None, num_experts: int) -> Fold | None:
    """`p`'s `Fold`, or None for a weight no tp / etp cut touches. `expert`: (expert offset,
    local experts) for an expert weight (dim 0: its experts)."""
    if getattr(p, "tp_shard", None) is not None:
        (dim, index), parts = p.tp_shard, mesh.tp // getattr(p, "tp_replicas", 1)
    elif getattr(p, "etp_shard", None) is not None:
        (dim, index), parts = p.etp_shard, mesh.etp
    else:
        return None
    shape = tuple(p.shape)
    assert 0 < dim < len(shape) or (dim == 0 and expert is None), "experts are never cut along dim 0"
    index = [int(i) for i in index]
    assert len(index) == shape[dim] and 0 <= min(index) and max(index) < shape[dim] * parts, \
        "a cut's index must name its own positions of the global dim"
    suffix = math.prod(shape[dim + 1:])
    inner = math.prod(shape[1:dim]) if expert is not None else math.prod(shape[:dim])
    rows, row_offset = (num_experts * inner, expert[0] * inner) if expert is not None else (inner, 0)
    runs, start = [], 0
    for i in range(1, len(index) + 1):
        if i == len(index) or index[i] != index[i - 1] + 1:
            runs.append((start * suffix, i * suffix, index[start] * suffix))
            start = i
    return Fold((rows, shape[dim] * parts * suffix), shape[dim] * suffix, row_offset, tuple(runs))


def rectangles(f: Fold, lo: int, hi: int) -> list:
    """The rectangles of flat local elements [lo, hi): ((global row, global col), (nrows, ncols),
    flat local position of the first element), in flat order within each run."""
    n, lo, hi = f.local_cols, lo + f.flat_offset, hi + f.flat_offset
    (r0, c0), (r1, c1) = divmod(lo, n), divmod(hi, n)
    if r0 == r1:
        rects = [(r0, 1, c0, c1)] if c1 > c0 else []
    else:
        rects = [(r0, 1, c0, n)] if c0 else []
        r0 += 1 if c0 else 0
        rects += [(r0, r1 - r0, 0, n)] if r1 > r0 else []
        rects += [(r1, 1, 0, c1)] if c1 else []
    out = []
    for row, nrows, a, b in rects:
        for start, end, g in f.runs:
            x, y = max(a, start), min(b, end)
            if x < y:
                out.append(((f.row_offset + row, g + x - start), (nrows, y - x), row * n + x - f.flat_offset))
    return out


def region(flat: torch.Tensor, f: Fold, size: tuple, local_pos: int, base: int) -> torch.Tensor:
    """The rectangle of `size` starting at flat local element `local_pos`, as a view of `flat` (the
    state, whose element `base` is the param's local element 0)."""
    return flat.as_strided(size, (f.local_cols, 1), flat.storage_offset() + base + local_pos)


class StateChunks:
    """One rank's rectangles of a global state tensor (DCP chunks: `offsets` -> tensor), with the
    checkpoint hooks DTensor implements so that DCP's planners write and read them as such."""

    def __init__(self, shape: tuple, dtype: torch.dtype):
        self.shape, self.dtype, self.chunks = torch.Size(shape), dtype, {}

    def add(self, offsets: tuple, tensor: torch.Tensor) -> None:
        assert offsets not in self.chunks and tensor.dtype == self.dtype
        self.chunks[torch.Size(offsets)] = tensor

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, obj) -> list:
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(off, t.size()),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.shape))
                for off, t in self.chunks.items()]

    def __create_chunk_list__(self) -> list:
        return [ChunkStorageMetadata(off, t.size()) for off, t in self.chunks.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.chunks[torch.Size(index.offset)]


class SavePlanner(DefaultSavePlanner):
    """DCP's default planner, finding a `StateChunks`' chunk by its offsets."""

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict.get(index.fqn)
        return obj.__get_tensor_shard__(index) if isinstance(obj, StateChunks) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, finding a `StateChunks`' chunk by its offsets. Its set-up leaves the
    state dict as given: the default's first step (materialising meta tensors, which we never pass)
    replaces every value it does not know, such as a `StateChunks`, by None."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        assert not any(getattr(v, "is_meta", False) for v in state_dict.values())
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = state_dict, {}
        self.flatten_state_dict = False  # already flat: one level of DCP keys
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        return obj.__get_tensor_shard__(index) if isinstance(obj, StateChunks) else super().lookup_tensor(index)


def folds_of(shape: tuple) -> list:
    """Every 2-D view a layout's cut can store a weight of global `shape` as: folded at one of its
    dims (the dims before it the rows), all the weight's global tensor reshaped."""
    return [(math.prod(shape[:d]), math.prod(shape[d:])) for d in range(len(shape))]


def check_declared(md, key: str, shapes: list) -> str:
    """'' if `.metadata`'s entry `md` for state tensor `key` is a floating tensor of one of the
    weight's global 2-D views `shapes` with every chunk inside it, else the problem (checked before
    anything is allocated for it)."""
    if not isinstance(md, TensorStorageMetadata):
        return f"{key} is not a tensor"
    shape = tuple(md.size)
    if shape not in [tuple(s) for s in shapes]:
        return (f"{key} has the global shape {shape}, the weight's optimizer state has "
                f"{' or '.join(str(tuple(s)) for s in shapes)} (its weight's global shape folded at the cut dim)")
    if not md.properties.dtype.is_floating_point:
        return f"{key} is stored as {md.properties.dtype}, not a floating dtype"
    for c in md.chunks:
        if len(c.offsets) != 2 or len(c.sizes) != 2 or any(o < 0 or n < 0 or o + n > d for o, n, d in
                                                            zip(c.offsets, c.sizes, shape)):
            return f"{key} has a chunk at {tuple(c.offsets)} of {tuple(c.sizes)} outside its shape {shape}"
    return ""


def count_coverage(counts: torch.Tensor, offsets: tuple, md: TensorStorageMetadata) -> None:
    """Add 1 to `counts` (a rectangle at global `offsets`) wherever a saved chunk of `md` covers it."""
    for c in md.chunks:
        lo = [max(o, co) for o, co in zip(offsets, c.offsets)]
        hi = [min(o + n, co + cn) for o, n, co, cn in zip(offsets, counts.shape, c.offsets, c.sizes)]
        if all(a < b for a, b in zip(lo, hi)):
            counts[lo[0] - offsets[0]:hi[0] - offsets[0], lo[1] - offsets[1]:hi[1] - offsets[1]] += 1
