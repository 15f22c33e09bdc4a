"""The NVFP4/MXFP4 quantizers with fewer ops give the bits of the code they replaced.

``_reference_scales`` is ``nvfp4.nvfp4_scales`` as it was (commit a3d0106, verbatim). Why the bits
agree by construction: the new one applies the same IEEE operations to the same operands
(``2688 / amax`` from a constant tensor instead of a fresh ``full``; the clamp and the ``amax == 0``
replacement in place instead of out of place), and the eager finiteness check reads ``max(amax)``
on the host instead of ``isfinite(amax).all()`` (a max propagates NaN and every amax is ≥ 0 or
non-finite, so both say "finite" for the same tensors). Checked on ties at every E2M1 rounding
boundary, zero blocks and rows, subnormal inputs (subnormal global scales), huge values (S_enc at
FLT_MAX's clamp), and non-finite input (the same error, and the same recorded flag when deferred).
"""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.fp4 import NonFiniteFlags, NonFiniteInputError, fake_quantize_mxfp4, nvfp4
from megatron_fp4.fp4.formats import FLT_MAX
from megatron_fp4.fp4.nvfp4 import E4M3_MAX, fake_quantize_nvfp4, quantize_nvfp4


def _reference_scales(block_amax, scale, amax_reduce=None):
    assert amax_reduce is None  # the tensor-parallel reduction has its own tests (test_fp4_tensor_cut.py)
    if scale == "row":
        amax = block_amax.amax(dim=-2, keepdim=True)
    else:
        amax = block_amax.amax()
    s_enc = torch.clamp(torch.full((), E4M3_MAX * 6.0, dtype=torch.float32, device=amax.device) / amax, max=FLT_MAX)
    s_enc = torch.where(amax == 0, torch.ones_like(s_enc), s_enc)
    s_dec = 1.0 / s_enc
    s_blk = (block_amax * (s_enc * torch.tensor(1.0 / 6.0))).clamp_(max=E4M3_MAX).to(torch.float8_e4m3fn)
    s_blk32 = s_blk.to(torch.float32)
    enc_blk = torch.clamp(1.0 / (s_blk32 * s_dec), max=FLT_MAX)
    return amax, s_blk, s_blk32, s_dec, enc_blk


def _adversarial(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 2.0 ** torch.randint(-20, 20, (rows, 1), generator=g)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])  # E2M1 ties (and the max) ...
    x[0] = ties.repeat(k // 8)[:k] * torch.where(torch.rand(k, generator=g) < 0.5, -1.0, 1.0)
    x[1, :16] = 0.0  # a zero block
    x[2] = 0.0  # a zero row
    x[3] *= 1e-38  # subnormal inputs
    x[4] = (torch.rand(k, generator=g) * 2 - 1) * 3e38  # S_enc tiny, block scales at the E4M3 max
    x[5, ::16] = 6.0 * 2.0 ** torch.randint(-8, 8, (k // 16,), generator=g).float()  # ... at exact block scales
    return x


def bits(t):
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.uint8)


@pytest.mark.parametrize("scale", ["row", "tensor"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nvfp4_scales_bits_equal_reference(scale, seed):
    x = _adversarial(8, 64, seed).abs()
    block_amax = x.view(8, 4, 16).amax(-1, keepdim=True)
    for got, want in zip(nvfp4.nvfp4_scales(block_amax, scale), _reference_scales(block_amax, scale)):
        assert torch.equal(bits(got.float() if got.dtype == torch.float8_e4m3fn else got),
                           bits(want.float() if want.dtype == torch.float8_e4m3fn else want))


@pytest.mark.parametrize("scale,block", [("row", "1d"), ("tensor", "1d"), ("tensor", "2d")])
def test_nvfp4_quantize_bits_equal_reference(monkeypatch, scale, block):
    x = _adversarial(16, 64, 7)
    got = (quantize_nvfp4(x, scale=scale, block=block), fake_quantize_nvfp4(x, scale=scale, block=block, compile="off"))
    monkeypatch.setattr(nvfp4, "nvfp4_scales", _reference_scales)
    want = (quantize_nvfp4(x, scale=scale, block=block), fake_quantize_nvfp4(x, scale=scale, block=block, compile="off"))
    assert torch.equal(got[0].codes, want[0].codes)
    assert torch.equal(bits(got[0].block_scales.float()), bits(want[0].block_scales.float()))
    assert torch.equal(bits(got[0].global_scale), bits(want[0].global_scale))
    assert torch.equal(bits(got[1]), bits(want[1]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("quant", [lambda x, **k: fake_quantize_nvfp4(x, compile="off", **k),
                                   lambda x, **k: fake_quantize_mxfp4(x, compile="off", **k)])
def test_non_finite_input_raises_and_is_flagged_as_before(quant, bad):
    x = torch.randn(4, 64)
    x[2, 17] = bad
    with pytest.raises(NonFiniteInputError, match="1 non-finite element"):
        quant(x)
    flags = NonFiniteFlags()
    quant(x, nonfinite=flags)  # deferred: recorded on the device, not raised
    assert flags.error() is not None
    big = torch.full((4, 64), 3.4e38)  # finite at the top of the range: no error
    assert torch.isfinite(quant(big)).all()
    assert quant(torch.zeros(0, 64)).shape == (0, 64)  # no rows: nothing to check
