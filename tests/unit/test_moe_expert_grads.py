"""Grouped experts' weight gradients: produced once through `unbind` views (one stacked buffer per
weight) with the values of per-expert indexing (`expert_forward(e, x)`, which indexes `w13[e]`,
called expert by expert: the reference). The forward runs the per-expert loop (`grouped = False`);
the grouped GEMM path is `test_moe_grouped.py`."""
import pytest
import torch

from megatron_fp4.fp4 import Recipe
from megatron_fp4.model.moe import GroupedExperts


def _make(mode):
    torch.manual_seed(0)
    ex = GroupedExperts(4, 32, 16, Recipe(mode=mode))
    ex.grouped = False
    with torch.no_grad():
        ex.w13.normal_(0, 0.1)
        ex.w2.normal_(0, 0.1)
    return ex


def _grads(ex, x, counts, indexed):
    """Output and gradients through `forward` (unbind views) or, `indexed`, through `expert_forward`
    per expert with its default `w13[e]` / `w2[e]` indexing."""
    ex.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    if indexed:
        y = torch.cat([ex.expert_forward(e, chunk) for e, chunk in enumerate(x.split(counts)) if chunk.shape[0]])
    else:
        y = ex(x, counts)
    y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
    return y, x.grad, ex.w13.grad, ex.w2.grad


def _bits(t):
    return (t + 0.0).view(torch.int32)  # + 0.0: one layout sums in zeros of other experts, so -0 -> +0


@pytest.mark.parametrize("mode", ["bf16", "fp4", "fp4_resq"])
def test_unbind_views_give_the_gradients_of_per_expert_indexing(mode):
    ex = _make(mode)
    x = torch.randn(20, 32)
    counts = [7, 0, 13, 0]  # idle experts get zero gradients either way
    new, old = _grads(ex, x, counts, False), _grads(ex, x, counts, True)
    for a, b in zip(new, old):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.count_nonzero(new[2][1]) == 0 and torch.count_nonzero(new[3][3]) == 0


def _nodes(fn):
    seen, stack = set(), [fn]
    while stack:
        f = stack.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        stack.extend(n for n, _ in f.next_functions)
    return [type(f).__name__ for f in seen]


def test_each_expert_weight_reaches_its_gradient_through_one_unbind_node():
    ex = _make("bf16")
    y = ex(torch.randn(12, 32), [3, 3, 3, 3])
    names = _nodes(y.grad_fn)
    assert names.count("UnbindBackward0") == 2  # w13 and w2
    assert "SelectBackward0" not in names  # no per-expert full-size zeroed gradients
