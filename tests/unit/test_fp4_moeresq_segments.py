"""`moeresq_linear(segments=)` and `GroupedExperts(segments=)`: the FP4 weight gradient quantized
run by run (expert parallelism: the rows from each source rank = each single-process micro-batch).

- forward and dgrad ignore `segments` (row-wise quantization): bitwise the plain call's, by
  construction (the same kernels on the same tensors);
- wgrad equals the sum of the weight grads of one call per run. Each run's quantized operands are
  the bits of that call's (the same quantizer on the same rows); only the GEMM's sum is ordered
  differently (one GEMM over the runs' blocks side by side vs a sum of per-run GEMMs), so the test
  runs in float64, where that is a ~1e-16 relative effect: within ``FP64_REL``;
- one non-empty run is the plain call, bitwise (the same code path).
"""
import pytest
import torch
import torch.nn.functional as F

import megatron_fp4.fp4.moeresq as moeresq
from megatron_fp4.fp4 import Numerics, OperandFormat, Recipe, moeresq_linear, resq_quantize
from megatron_fp4.model.moe import GroupedExperts
from tests.numerics import FP64_REL, rel

RUNS = [21, 0, 5, 38]  # not multiples of the 16/32-token blocks; an empty run in between


NUM = Numerics()  # the numerics the calls compute with


def _call(x, w, dy, recipe, segments=None):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = moeresq_linear(x, w, recipe=recipe, name="l", segments=segments, numerics=NUM)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _data(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    n = sum(RUNS)
    # per-run magnitudes far apart: a shared columnwise amax would change the small runs' codes
    scale = torch.cat([torch.full((r, 1), 10.0 ** i) for i, r in enumerate(RUNS)])
    x = (torch.randn(n, 64, generator=g) * scale).to(dtype)
    dy = (torch.randn(n, 32, generator=g) / scale).to(dtype)
    return x, torch.randn(32, 64, generator=g).to(dtype) * 0.1, dy


@pytest.mark.parametrize("recipe", [Recipe(mode="fp4_resq"), Recipe(mode="fp4"), Recipe.for_format("fp4_resq", "mxfp4")],
                         ids=["fp4_resq", "fp4", "mxfp4"])
def test_wgrad_is_the_sum_of_per_run_calls_and_forward_dgrad_are_unchanged(recipe):
    x, w, dy = _data()
    y, dx, dw = _call(x, w, dy, recipe, RUNS)
    y0, dx0, dw0 = _call(x, w, dy, recipe)
    assert torch.equal(y, y0) and torch.equal(dx, dx0)
    want = torch.zeros_like(dw)
    for xs, dys in zip(x.split(RUNS), dy.split(RUNS)):
        if xs.shape[0]:
            want += _call(xs, w, dys, recipe)[2]
    assert rel(dw, want) <= FP64_REL, rel(dw, want)
    assert rel(dw0, want) > 1e-4  # one batch mixes the runs' scales: the segments are what makes it equal


def test_one_nonempty_run_is_the_plain_call_bitwise():
    x, w, dy = _data(torch.float32)
    plain = _call(x, w, dy, Recipe())
    for segments in ([x.shape[0]], [0, x.shape[0], 0]):
        assert all(torch.equal(a, b) for a, b in zip(_call(x, w, dy, Recipe(), segments), plain))


def _col(a, fmt, comp):
    """One run's wgrad operand written out: tokens padded to the block, transposed, Q̃."""
    pad = (-a.shape[0]) % fmt.block_size
    return resq_quantize((F.pad(a.t(), (0, pad)) if pad else a.t()).contiguous(), fmt, comp)


def test_segmented_wgrad_is_the_per_run_operands_side_by_side_bitwise():
    """fp32, bitwise: dW = [Q̃_col(dY_r)]ᵀ·[Q̃_col(X_r)] with each run padded and quantized alone."""
    x, w, dy = _data(torch.float32)
    r = Recipe()
    _, _, dw = _call(x, w, dy, r, RUNS)
    runs = [(xs, dys) for xs, dys in zip(x.split(RUNS), dy.split(RUNS)) if xs.shape[0]]
    dyt = torch.cat([_col(dys, r.grad_output, r.compensated) for _, dys in runs], dim=1)
    xt = torch.cat([_col(xs, r.input, r.compensated) for xs, _ in runs], dim=1)
    assert torch.equal(dw, dyt @ xt.t())


def test_without_backward_quantization_segments_change_nothing():
    x, w, dy = _data()
    r = Recipe(quantize_backward=False)
    (y, dx, dw), (y0, dx0, dw0) = _call(x, w, dy, r, RUNS), _call(x, w, dy, r)
    assert torch.equal(y, y0) and torch.equal(dx, dx0) and torch.equal(dw, dw0)


def test_stochastic_runs_draw_their_own_streams():
    seen, original = [], moeresq.sr_seed
    moeresq.sr_seed = lambda *key: seen.append(key[4]) or original(*key)
    try:
        sr = OperandFormat(rounding="stochastic")
        _call(*_data(torch.float32), Recipe(input=sr, grad_output=sr), RUNS)
    finally:
        moeresq.sr_seed = original
    for op in ("grad_output (columnwise)", "input (columnwise)"):
        assert [k for k in seen if k.startswith(op)] == [op, op + " segment 1", op + " segment 2"]


@pytest.mark.parametrize("segments", [[20, 45], [-1, 65], [10, 10]])
def test_bad_segments_raise(segments):
    x, w, _ = _data()
    with pytest.raises(ValueError, match="segments"):
        moeresq_linear(x, w, recipe=Recipe(), segments=segments)


def test_grouped_experts_wgrad_is_the_sum_over_sources():
    """Two sources' rows in grouped order (expert, then source) with `segments` give the weight
    grads of running each source's batch alone and summing (the single process's micro-batches)."""
    torch.manual_seed(0)
    ex = GroupedExperts(2, 32, 16, Recipe()).double()
    with torch.no_grad():
        ex.w13.normal_(0, 0.1)
        ex.w2.normal_(0, 0.1)
    counts = [[9, 20], [17, 0]]  # [source][expert]
    xs = [torch.randn(sum(c), 32, dtype=torch.float64) * (1 + 50 * s) for s, c in enumerate(counts)]
    dys = [torch.randn(sum(c), 32, dtype=torch.float64) for c in counts]

    def grads(x, dy, n, segments=None):
        ex.zero_grad(set_to_none=True)
        x = x.clone().requires_grad_(True)
        ex(x, n, segments).backward(dy)
        return x.grad, ex.w13.grad.clone(), ex.w2.grad.clone()

    want = [grads(x, dy, c) for x, dy, c in zip(xs, dys, counts)]
    # grouped order: expert 0's rows from source 0, then source 1; then expert 1's
    parts = [t.split(c) for t, c in zip(xs, counts)], [t.split(c) for t, c in zip(dys, counts)]
    xg, dyg = (torch.cat([p[s][e] for e in range(2) for s in range(2)]) for p in parts)
    segments = [[counts[s][e] for s in range(2)] for e in range(2)]
    dx, dw13, dw2 = grads(xg, dyg, [sum(s) for s in segments], segments)
    assert rel(dw13, want[0][1] + want[1][1]) <= FP64_REL and rel(dw2, want[0][2] + want[1][2]) <= FP64_REL
    dx_want = torch.cat([t for e in range(2) for s in range(2) for t in [want[s][0].split(counts[s])[e]]])
    assert rel(dx, dx_want) <= FP64_REL
    with pytest.raises(ValueError, match="segments"):
        ex(xg, [sum(s) for s in segments], [[9, 20], [17]])
