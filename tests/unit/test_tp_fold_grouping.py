"""The grouped order of an expert-parallel layer with tensor parallel folded into ep (pure parts).

`parallel.moe.alltoall.grouping_permutation(recv_counts, fold, positions)`: rows received src-major (then
local expert) regroup by local expert, then micro-batch (a block of `fold` sources), then the
rows' positions in the micro-batch; `DispatchPlan.expert_segments` gives one run per micro-batch.
Checked against a sort written out row by row.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_fp4.parallel.moe.alltoall import DispatchPlan, grouping_permutation


def test_grouped_order_is_expert_then_micro_batch_then_position():
    g = torch.Generator().manual_seed(0)
    ep, local, fold = 4, 3, 2
    recv = torch.randint(0, 4, (ep, local), generator=g)
    rows = [(src, le) for src in range(ep) for le in range(local) for _ in range(int(recv[src, le]))]
    # each micro-batch's positions are distinct: a permutation of its rows' slots
    positions = torch.randperm(len(rows), generator=g)
    perm = grouping_permutation(recv, fold, positions).tolist()
    want = sorted(range(len(rows)), key=lambda i: (rows[i][1], rows[i][0] // fold, int(positions[i])))
    assert perm == want
    assert grouping_permutation(recv).tolist() == sorted(range(len(rows)), key=lambda i: (rows[i][1], rows[i][0]))
    plan = DispatchPlan(None, None, None, recv, None, fold)
    assert plan.expert_segments == [[int(recv[0:2, e].sum()), int(recv[2:4, e].sum())] for e in range(local)]


def test_fold_needs_the_all_to_all_and_a_divisor_of_ep():
    from megatron_fp4.parallel.moe.alltoall import AllToAllDispatcher
    from megatron_fp4.parallel.moe.expert_parallel import apply_expert_parallel
    with pytest.raises(ValueError, match="fold=3 .* must divide ep=4"):
        AllToAllDispatcher(None, 4, 8, fold=3)
    with pytest.raises(ValueError, match="tp_fold=2 .* needs parallel.expert_dispatcher=alltoall"):
        apply_expert_parallel(torch.nn.Module(), SimpleNamespace(ep=4), dispatcher="gcmoe", tp_fold=2)
