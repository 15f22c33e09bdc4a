import pytest
import torch

from megatron_fp4.parallel.moe.alltoall import grouping_permutation
from megatron_fp4.parallel.moe.expert_parallel import expert_owner, expert_placement, local_expert_range
from megatron_fp4.parallel.moe.gcmoe import chunk_bounds, exchange_step


def test_contiguous_blocks():
    assert expert_placement(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert expert_placement(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert expert_placement(3, 1) == [[0, 1, 2]]
    assert expert_placement(4, 4) == [[0], [1], [2], [3]]


@pytest.mark.parametrize("num_experts,ep", [(8, 3), (6, 4), (2, 4)])
def test_indivisible_is_a_named_error(num_experts, ep):
    with pytest.raises(ValueError, match="num_experts.*parallel.ep"):
        expert_placement(num_experts, ep)


@pytest.mark.parametrize("num_experts,ep", [(0, 1), (4, 0)])
def test_nonpositive_rejected(num_experts, ep):
    with pytest.raises(ValueError):
        expert_placement(num_experts, ep)


def test_owner_and_range_agree_with_placement():
    for num_experts, ep in [(8, 2), (8, 4), (16, 8), (6, 3)]:
        blocks = expert_placement(num_experts, ep)
        for r, block in enumerate(blocks):
            assert local_expert_range(num_experts, ep, r) == (block[0], block[-1] + 1)
            assert all(expert_owner(e, num_experts, ep) == r for e in block)
        assert sorted(e for b in blocks for e in b) == list(range(num_experts))
    with pytest.raises(ValueError, match="expert=8"):
        expert_owner(8, 8, 2)
    with pytest.raises(ValueError, match="ep_rank"):
        local_expert_range(8, 2, 2)


def test_grouping_permutation_is_expert_major_then_source():
    # 2 sources x 2 local experts; receive order is src-major.
    recv = torch.tensor([[2, 1], [0, 3]])
    # receive rows: src0/e0: 0,1  src0/e1: 2  src1/e0: -  src1/e1: 3,4,5
    assert grouping_permutation(recv).tolist() == [0, 1, 2, 3, 4, 5]
    recv = torch.tensor([[1, 2], [2, 0]])
    # src0/e0: 0  src0/e1: 1,2  src1/e0: 3,4 -> grouped e0: 0,3,4 then e1: 1,2
    assert grouping_permutation(recv).tolist() == [0, 3, 4, 1, 2]
    assert grouping_permutation(torch.zeros(3, 2, dtype=torch.int64)).tolist() == []


def test_chunk_bounds():
    assert chunk_bounds(0, 4) == []
    assert chunk_bounds(4, 4) == [(0, 4)]
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(3, 100) == [(0, 3)]


def test_exchange_steps_mirror_pair_by_pair():
    """Tag-free matching: rank a's operations with b, step after step, are rank b's with a with
    send and recv swapped, in the same order; every chunk sent is received exactly once."""
    g = torch.Generator().manual_seed(0)
    swap = {"send": "recv", "recv": "send"}
    for ep in (2, 3, 4):
        for _ in range(20):
            chunks = torch.randint(0, 4, (ep, ep), generator=g).tolist()  # chunks[a][b]: a sends b
            for a in range(ep):
                chunks[a][a] = 0
            logs = [{p: [] for p in range(ep)} for _ in range(ep)]
            for k in range(4):
                for me in range(ep):
                    peers = [p for p in range(ep) if p != me]
                    recv = [chunks[p][me] for p in range(ep)]
                    for kind, p in exchange_step(me, peers, chunks[me], recv, k):
                        logs[me][p].append((kind, k))
            for a in range(ep):
                for b in range(ep):
                    assert logs[a][b] == [(swap[kind], k) for kind, k in logs[b][a]], (chunks, a, b)
                    assert [k for kind, k in logs[a][b] if kind == "send"] == list(range(chunks[a][b]))
