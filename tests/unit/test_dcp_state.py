"""The 2-D folds and rectangles of cut weights' AdamW state (checkpoint/dcp_state.py), exactly.

Reference: a global tensor holding each element's own flat index. A cut (tp: a block of one dim;
etp's w13: two blocks, gate and up rows; a rank's experts under ep: a block of dim 0) is
`index_select` of it; for every flat range of the local shard (a ZeRO piece) the rectangles must
cover exactly that range, each holding the global elements `fold`'s view puts at its offsets. Then
DCP round trips: rectangles written by one cut are read back by another cut's rectangles (and by
a whole weight's) with the reference values, bit for bit (plain copies).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_fp4.training.checkpoint import dcp_state

# (global shape, cut dim, parts, w13-like two runs, experts (num, local, offset) or None)
CASES = [
    ((12, 8), 0, 2, False, None),  # a row cut: one contiguous block of the flat tensor
    ((12, 8), 1, 4, False, None),  # a column cut: strided rows
    ((4, 6, 5), 1, 3, True, (4, 2, 2)),  # etp w13 of a rank's 2 experts of 4: gate and up rows
    ((4, 5, 6), 2, 2, False, (4, 2, 0)),  # etp w2
]


def _local(case, rank):
    """(the global tensor of flat indices, the rank's local shard, a param-like object for `fold`)."""
    shape, dim, parts, two_runs, experts = case
    full = torch.arange(math.prod(shape), dtype=torch.float64).view(shape)
    n = shape[dim] // parts
    if two_runs:
        half = shape[dim] // 2
        n = half // parts
        index = torch.cat([torch.arange(rank * n, (rank + 1) * n), half + torch.arange(rank * n, (rank + 1) * n)])
    else:
        index = torch.arange(rank * n, (rank + 1) * n)
    local = full.index_select(dim, index)
    expert = None
    if experts is not None:
        _, count, offset = experts
        local, expert = local[offset:offset + count], (offset, count)
    p = SimpleNamespace(shape=local.shape, etp_shard=(dim, index)) if experts else \
        SimpleNamespace(shape=local.shape, tp_shard=(dim, index))
    return full, local, p, expert


def _fold(case, rank):
    full, local, p, expert = _local(case, rank)
    mesh = SimpleNamespace(tp=case[2], etp=case[2])
    num = case[4][0] if case[4] else 0
    return full, local, dcp_state.fold(p, mesh, expert, num)


@pytest.mark.parametrize("case", CASES)
def test_rectangles_cover_each_range_with_the_global_elements(case):
    for rank in range(case[2]):
        full, local, f = _fold(case, rank)
        view = full.reshape(f.shape)
        flat = local.reshape(-1)
        n = flat.numel()
        for lo, hi in [(0, n), (1, n - 1), (3, 4), (n // 3, 2 * n // 3 + 1), (0, 1)]:
            seen = torch.zeros(n, dtype=torch.int64)
            for (r, c), (rows, cols), pos in dcp_state.rectangles(f, lo, hi):
                got = dcp_state.region(flat, f, (rows, cols), pos, 0)
                assert torch.equal(got, view[r:r + rows, c:c + cols]), (case, rank, lo, hi)
                dcp_state.region(seen, f, (rows, cols), pos, 0).add_(1)
            want = torch.zeros(n, dtype=torch.int64)
            want[lo:hi] = 1
            assert torch.equal(seen, want), (case, rank, lo, hi)


def test_folds_of_are_reshapes_and_a_foreign_shape_is_refused():
    assert dcp_state.folds_of((4, 6, 5)) == [(1, 120), (4, 30), (24, 5)]
    md = SimpleNamespace()
    assert "not a tensor" in dcp_state.check_declared(md, "k", [(4, 30)])


@pytest.mark.parametrize("case", CASES[:2])
def test_dcp_reads_one_cut_s_rectangles_into_another_s(case, tmp_path):
    shape, dim, parts, _, _ = case
    saved = {}
    for rank in range(parts):  # every rank's ZeRO halves of its shard, written as one DCP checkpoint
        _, local, f = _fold(case, rank)
        n = local.numel()
        chunks = saved.setdefault("k", dcp_state.StateChunks(f.shape, torch.float64))
        for lo, hi in ((0, n // 2 + 1), (n // 2 + 1, n)):
            for off, size, pos in dcp_state.rectangles(f, lo, hi):
                chunks.add(off, dcp_state.region(local.reshape(-1), f, size, pos, 0).clone())
    dcp.save(saved, checkpoint_id=str(tmp_path), planner=dcp_state.SavePlanner(), no_dist=True)
    full = torch.arange(math.prod(shape), dtype=torch.float64)
    other = (shape, dim, 1, False, None)  # read back whole, through the other cut's fold...
    _, _, f_one = _fold(other, 0)
    whole = dcp_state.whole(f_one.shape, 0)
    n = full.numel()
    for f, lo, hi in ((whole, 0, n), (whole, 5, n - 7)):
        want = dcp_state.StateChunks(f.shape, torch.float64)
        rects = dcp_state.rectangles(f, lo, hi)
        for off, size, pos in rects:
            want.add(off, torch.zeros(size, dtype=torch.float64))
        dcp.load({"k": want}, checkpoint_id=str(tmp_path), planner=dcp_state.LoadPlanner(), no_dist=True)
        got = torch.full((n,), -1.0, dtype=torch.float64)
        for off, size, pos in rects:
            dcp_state.region(got, f, size, pos, 0).copy_(want.chunks[torch.Size(off)])
        assert torch.equal(got[lo:hi], full[lo:hi]) and (got[:lo] == -1).all() and (got[hi:] == -1).all()
