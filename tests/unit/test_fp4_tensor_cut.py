"""FP4 quantizers on a tensor-parallel slice (`fp4.tensor_cut`), two ranks simulated in one process.

Each "rank" quantizes its half of a tensor with ``amax_reduce`` = max with the other half's amax
(what the all-reduce over the group returns); its codes, block scales and global scale must be
the slice of the whole tensor's, bit for bit (a max is exact in any order). The halves are
scaled apart so that without the reduction they would not be.
"""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.fp4 import OperandFormat, Recipe, quantize_nvfp4
from megatron_fp4.fp4.resq import portable_resq_quantize
from megatron_fp4.fp4.tensor_cut import TensorCut


def _tensor(rows=32, cols=64, seed=0):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x[:, cols // 2:] *= 5.0  # the amax of every row and of the tensor lives in the right half
    x[rows // 2:] *= 3.0
    return x


def _halves(x, dim):
    return x.chunk(2, dim)


def _other_max(x, dim, scale):
    """amax_reduce for each half: the max with the other half's global amax."""
    a, b = _halves(x, dim)

    def amax(t):
        t = t.float()
        return t.abs().amax() if scale == "tensor" else t.abs().amax(dim=-1).reshape(-1, 1, 1)
    ma, mb = amax(a), amax(b)
    return [lambda m: torch.maximum(m, mb), lambda m: torch.maximum(m, ma)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("scale,block,dim", [("tensor", "2d", 0), ("tensor", "2d", 1), ("row", "1d", 1),
                                             ("tensor", "1d", 0)])
def test_slice_codes_equal_the_whole_tensors_slice(scale, block, dim, dtype):
    """Any operand dtype: the quantizers read it as fp32, the amax reduction sees fp32 amaxes."""
    x = _tensor().to(dtype)
    whole = quantize_nvfp4(x, scale=scale, block=block)
    for r, (part, reduce) in enumerate(zip(_halves(x, dim), _other_max(x, dim, scale))):
        got = quantize_nvfp4(part, scale=scale, block=block, amax_reduce=reduce)
        assert torch.equal(got.codes, whole.codes.chunk(2, dim)[r])
        assert torch.equal(got.block_scales.view(torch.uint8), whole.block_scales.view(torch.uint8).chunk(2, dim)[r])
        want_g = whole.global_scale if scale == "tensor" else whole.global_scale.chunk(2, 0)[r] if dim == 0 \
            else whole.global_scale
        assert torch.equal(got.global_scale, want_g)
        alone = quantize_nvfp4(part, scale=scale, block=block)
        assert not torch.equal(alone.global_scale, got.global_scale) or r == 1  # the reduction mattered


def test_residual_is_reduced_too():
    """Q(x) + Q(x − Q(x)) of a column slice with per-row scale: both amaxes reduced."""
    x = _tensor(8, 64)
    fmt = OperandFormat()
    whole = portable_resq_quantize(x, fmt)
    a, b = _halves(x, 1)
    seen = []

    def reduce_for(other):
        def reduce(m):
            seen.append(m.clone())
            return torch.maximum(m, other(m, len(seen)))
        return reduce
    # the other half's amax of x, then of its residual, in call order (b holds every row's amax, so
    # its own scale is the whole tensor's and b − Q(b) is the whole residual's right half)
    rb = b - quantize_nvfp4(b).dequantize()
    others = [b.abs().amax(-1).reshape(-1, 1, 1), rb.abs().amax(-1).reshape(-1, 1, 1)]
    got = portable_resq_quantize(a, fmt, amax_reduce=reduce_for(lambda m, i: others[i - 1]))
    assert len(seen) == 2
    assert torch.equal(got, whole.chunk(2, 1)[0])


def test_nan_reaches_every_rank_as_inf():
    x = _tensor(16, 32)
    x[3, 5] = float("nan")
    sent = []

    def reduce(m):
        sent.append(m)
        return m
    with pytest.raises(ValueError, match="non-finite"):
        quantize_nvfp4(x, scale="tensor", amax_reduce=reduce)
    assert torch.isinf(sent[0]).all()  # +inf (order-free under max), not NaN
    with pytest.raises(ValueError, match="its slice on another tensor-parallel rank"):
        quantize_nvfp4(torch.ones(16, 32), scale="tensor", amax_reduce=lambda m: m + float("inf"))


def test_which_amax_spans_the_cut():
    col, row = TensorCut("column", 2, max), TensorCut("row", 2, max)
    nv_row, nv_tensor, mx = OperandFormat(), OperandFormat(scale="tensor", block="2d"), OperandFormat(format="mxfp4")
    assert col.reducer(nv_tensor, "weight") is max and row.reducer(nv_tensor, "weight") is max
    assert col.reducer(nv_row, "input") is None and row.reducer(nv_row, "input") is max
    assert col.reducer(nv_row, "grad_output") is max and row.reducer(nv_row, "grad_output") is None
    assert col.reducer(nv_row, "grad_output (columnwise) segment 1") is None  # per-row, rows cut
    assert col.reducer(OperandFormat(scale="tensor"), "grad_output (columnwise)") is max
    assert all(c.reducer(mx, op) is None for c in (col, row) for op in ("weight", "input", "grad_output"))


def test_misaligned_slices_are_refused():
    cut = TensorCut("row", 2, max)
    cut.check(Recipe(), 64, 32, "o_proj")
    with pytest.raises(ValueError, match=r"o_proj: FP4 under tensor parallel 2 \(row-parallel\) leaves 8 input "
                                         r"features per rank, not a multiple of the nvfp4 block \(16\)"):
        cut.check(Recipe(), 64, 8, "o_proj")
    with pytest.raises(ValueError, match=r"leaves 16 input features per rank, not a multiple of the mxfp4 block \(32\)"):
        cut.check(Recipe.for_format(fmt="mxfp4"), 64, 16, "o_proj")
    with pytest.raises(ValueError, match="leaves 8 output features per rank"):
        TensorCut("column", 2, max).check(Recipe(), 8, 64, "q_proj")
    TensorCut("column", 2, max).check(Recipe(mode="bf16"), 8, 8, "q_proj")  # not FP4: nothing to align
    with pytest.raises(ValueError, match="TensorCut.kind='diagonal'"):
        TensorCut("diagonal", 2, max)
