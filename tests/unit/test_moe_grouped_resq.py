"""FP4 experts as grouped MoEResQ calls (`fp4.moeresq_grouped`, `GroupedExperts.grouped_resq_forward`)
against the per-expert loop (`grouped = False`): the same bits in forward, dgrad and wgrad.

Bitwise by construction (see the module docstring): per element the grouped call runs the same
quantizer ops (a row-local format quantizes each row alone; other formats and stochastic rounding
go expert by expert on each expert's own stream) and the same per-expert `mm` on operands of the
same shape, strides and values. Compared as raw bit patterns, so even a -0/+0 or one-ulp
difference fails."""
import pytest
import torch

from megatron_fp4.fp4 import Numerics, Recipe
from megatron_fp4.fp4.moeresq_grouped import MAX_PAD_RATIO, _buckets, grouped_moeresq_linear
from megatron_fp4.fp4.recipe import OperandFormat
from megatron_fp4.model.moe import GroupedExperts
from tests.unit.test_moe_expert_grads import _nodes

SR = OperandFormat(rounding="stochastic")
RECIPES = {
    "fp4_resq": Recipe(),
    "fp4": Recipe(mode="fp4"),
    "mxfp4": Recipe.for_format("fp4_resq", "mxfp4"),
    "tensor_scale": Recipe(input=OperandFormat(scale="tensor"), grad_output=OperandFormat(scale="tensor")),
    "stochastic": Recipe(input=SR, grad_output=SR, weight=OperandFormat(scale="tensor", block="2d",
                                                                         rounding="stochastic"), seed=7),
    "fp32_backward": Recipe(quantize_backward=False),
}


def _experts(recipe, E=5, H=64, Fd=32, dtype=torch.float32):
    torch.manual_seed(0)
    ex = GroupedExperts(E, H, Fd, recipe)
    ex.quant_name, ex.numerics = "layers.0.mlp.experts", Numerics()
    with torch.no_grad():
        ex.w13.normal_(0, 0.2)
        ex.w2.normal_(0, 0.2)
    return ex.to(dtype)


def _run(ex, x, counts, dy, grouped, segments=None):
    ex.grouped = grouped
    ex.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    with ex.numerics.training_step(3), ex.numerics.micro_batch(1):
        y = ex(x, counts, segments)
        nodes = _nodes(y.grad_fn)
        y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, "dw13": ex.w13.grad.clone(), "dw2": ex.w2.grad.clone()}, nodes


def _bits(t):
    return t.view({torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}[t.dtype])


def _assert_same_bits(got, want):
    for k in want:
        assert got[k].shape == want[k].shape, k
        assert torch.equal(_bits(got[k]), _bits(want[k])), f"{k}: grouped and loop differ"


def _data(counts, H=64, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    n = sum(counts)
    x = torch.randn(n, H, generator=g, dtype=torch.float64).to(dtype)
    dy = torch.randn(n, H, generator=g, dtype=torch.float64).to(dtype)
    x[3] *= 40.0  # one large row: per-row scales differ from the experts' and the tensor's
    return x, dy


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("counts,segments", [
    ([7, 0, 19, 33, 5], None),  # an expert without rows, runs not multiples of the block
    ([12, 0, 21, 40, 9], [[5, 7], [], [21], [16, 0, 24], [1, 8]]),  # expert-parallel runs per source
])
def test_grouped_resq_equals_the_per_expert_loop_bitwise(name, counts, segments):
    ex = _experts(RECIPES[name])
    x, dy = _data(counts)
    want, loop_nodes = _run(ex, x, counts, dy, grouped=False, segments=segments)
    got, nodes = _run(ex, x, counts, dy, grouped=True, segments=segments)
    assert "_GroupedWgradHalfBackward" in nodes and "_GroupedWgradHalfBackward" not in loop_nodes
    _assert_same_bits(got, want)
    assert not got["dw13"][1].any() and not got["dw2"][1].any()  # no rows, no gradient


def test_buckets_bound_the_padding():
    pads = [160, 16, 32, 16, 144, 16]
    buckets = _buckets(pads)
    assert sorted(i for b in buckets for i in b) == list(range(len(pads)))
    for b in buckets:
        assert len(b) * max(pads[i] for i in b) <= MAX_PAD_RATIO * sum(pads[i] for i in b)
    assert buckets == [[0, 4, 2], [1, 3, 5]]  # 3·160 ≤ 1.5·336; a fourth run: 4·160 > 1.5·352


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fp64_and_bf16_experts_and_unequal_runs_in_buckets(dtype):
    """fp64 experts (the verification mode: fp64 GEMMs) and bf16 ones (fp32 GEMMs, results cast),
    runs so unequal that one padded buffer would exceed MAX_PAD_RATIO (several buckets): the same bits."""
    counts = [2, 150, 3, 1, 4]
    assert len(_buckets([16, 160, 16, 16, 16])) > 1
    ex = _experts(Recipe(), dtype=dtype)
    x, dy = _data(counts, dtype=dtype)
    want, _ = _run(ex, x, counts, dy, grouped=False)
    got, nodes = _run(ex, x, counts, dy, grouped=True)
    assert "_GroupedWgradHalfBackward" in nodes
    _assert_same_bits(got, want)


def test_split_backward_runs_dgrad_and_wgrad_separately():
    """The input-grad pass (autograd.grad w.r.t. x) gives the loop's dX without a weight gradient;
    the grouped layout keeps moeresq's dgrad/wgrad split for zero-bubble schedules."""
    counts = [9, 4, 0, 20, 3]
    ex = _experts(Recipe())
    x, dy = _data(counts)
    want, _ = _run(ex, x, counts, dy, grouped=False)
    ex.grouped = True
    ex.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_(True)
    with ex.numerics.training_step(3), ex.numerics.micro_batch(1):
        (dx,) = torch.autograd.grad(ex(xg, counts), xg, dy)
    assert torch.equal(_bits(dx), _bits(want["dx"]))
    assert ex.w13.grad is None and ex.w2.grad is None


def test_bad_counts_name_the_fix():
    w = torch.zeros(3, 16, 16)
    with pytest.raises(ValueError, match="one entry per expert"):
        grouped_moeresq_linear(torch.zeros(5, 16), w, [2, 3], recipe=Recipe(), names=["a", "b", "c"])
    with pytest.raises(ValueError, match="segments must hold one entry per expert"):
        grouped_moeresq_linear(torch.zeros(5, 16), w, [2, 3, 0], recipe=Recipe(), names=["a", "b", "c"],
                               segments=[[2], [3]])
    with pytest.raises(ValueError, match=r"\[N, in\]"):
        grouped_moeresq_linear(torch.zeros(5, 8), w, [2, 3, 0], recipe=Recipe(), names=["a", "b", "c"])


@pytest.mark.parametrize("name", list(RECIPES))
def test_grouped_resq_equals_the_loop_bitwise_at_the_batch_level(name):
    """At the ``batch`` numerics level both paths run each expert's forward GEMM over fixed row
    tiles: the grouped call keeps the loop's bits (forward and gradients), and an expert's rows
    keep their forward bits when that expert runs alone."""
    ex = _experts(RECIPES[name])
    ex.numerics = Numerics(invariance="batch")
    counts = [7, 0, 19, 33, 5]
    x, dy = _data(counts)
    want, _ = _run(ex, x, counts, dy, grouped=False)
    got, nodes = _run(ex, x, counts, dy, grouped=True)
    assert "_GroupedWgradHalfBackward" in nodes
    _assert_same_bits(got, want)
    alone, _ = _run(ex, x[26:59], [0, 0, 0, 33, 0], dy[26:59], grouped=True)
    assert torch.equal(_bits(alone["y"]), _bits(got["y"][26:59]))
