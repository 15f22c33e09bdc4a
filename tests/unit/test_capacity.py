"""Expert capacity and token dropping (model/capacity.py) against a per-expert Python reference."""
import math

import pytest
import torch

from megatron_fp4.model.capacity import capacity_keep, expert_capacity, refuse_for_rollout


def reference_keep(idx, w, num_experts, capacity, policy):
    """Per expert: list its (token, slot) pairs, order them by the documented policy, keep the first."""
    T, k = idx.shape
    keep = [[False] * k for _ in range(T)]
    for e in range(num_experts):
        pairs = [(t, j) for t in range(T) for j in range(k) if int(idx[t, j]) == e]
        if policy == "probs":
            pairs.sort(key=lambda p: (-float(w[p[0], p[1]]), p[0]))
        else:
            pairs.sort(key=lambda p: p[0])
        for t, j in pairs[:capacity]:
            keep[t][j] = True
    return torch.tensor(keep, dtype=torch.bool)


def test_capacity_formula():
    # Megatron-Core: get_capacity(num_tokens * topk, num_experts, capacity_factor) = ceil(T*k/E*cf)
    assert expert_capacity(10, 2, 8, 1.0) == math.ceil(20 / 8)
    assert expert_capacity(16, 2, 8, 1.25) == 5
    assert expert_capacity(1, 1, 64, 1.0) == 1
    with pytest.raises(ValueError, match="must be > 0"):
        expert_capacity(4, 2, 8, 0.0)


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("seed", range(6))
def test_keep_matches_reference(policy, seed):
    g = torch.Generator().manual_seed(seed)
    T, E, k = 37, 6, 2
    logits = torch.randn(T, E, generator=g)
    w, idx = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    w = (w * 4).round() / 4  # few distinct weights: ties must fall back to token order
    for cf in (0.5, 1.0, 1.5):
        cap = expert_capacity(T, k, E, cf)
        got = capacity_keep(idx, w, E, cap, policy)
        assert torch.equal(got, reference_keep(idx, w, E, cap, policy)), (policy, cf)
        per_expert = torch.bincount(idx[got], minlength=E)
        assert int(per_expert.max()) <= cap


def test_large_capacity_drops_nothing():
    idx = torch.tensor([[0, 1], [0, 1], [0, 2]])
    w = torch.full((3, 2), 0.5)
    assert capacity_keep(idx, w, 3, 3).all()
    # capacity 2 under 'position': expert 0's third token (token 2) is dropped, nothing else
    keep = capacity_keep(idx, w, 3, 2, "position")
    assert keep.tolist() == [[True, True], [True, True], [False, True]]


def test_bad_policy_and_rollout_refusal():
    with pytest.raises(ValueError, match="drop policy 'random'"):
        capacity_keep(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), 1, 1, "random")
    refuse_for_rollout(None)
    with pytest.raises(ValueError, match="moe_capacity_factor=null for RL"):
        refuse_for_rollout(1.25)
