"""Stochastic rounding: unbiased within the representable range, reproducible from a generator."""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.fp4 import FP4Tensor, quantize_mxfp4, quantize_nvfp4
from megatron_fp4.fp4.e2m1 import E2M1_VALUES, stochastic_round_e2m1
from megatron_fp4.fp4.formats import block_scales_fp32


def _draw(fn, x, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([fn(x, rounding="stochastic", generator=g).dequantize() for _ in range(n)])


def _scale_per_element(q: FP4Tensor) -> torch.Tensor:
    s = block_scales_fp32(q.block_scales).repeat_interleave(q.block_size, dim=-1)
    if q.global_scale is not None:
        s = s * (q.global_scale.unsqueeze(-1) if q.global_scale.dim() else q.global_scale)
    return s


@pytest.mark.parametrize("fn", [quantize_nvfp4, quantize_mxfp4])
def test_stochastic_rounding_is_unbiased(fn):
    torch.manual_seed(0)
    x = torch.randn(4, 64) * torch.logspace(-2, 2, 4).unsqueeze(1)
    n = 4000
    draws = _draw(fn, x, n, seed=1)
    scale = _scale_per_element(fn(x))
    # Representable range: |x| ≤ 6 · scale (beyond it values saturate, which is biased by design).
    target = torch.maximum(torch.minimum(x, 6 * scale), -6 * scale)
    # Each draw is one of the two neighbouring grid points, at most 2·scale apart, so its std is at
    # most scale; the mean of n draws has std ≤ scale/√n. 6σ over 256 elements: false alarm < 1e-6.
    err = (draws.mean(0) - target).abs()
    assert (err <= 6 * scale / n ** 0.5).all(), (err / scale).max()
    # ... and the mean is not just the RNE value: check the bound above is a meaningful one.
    rne = fn(x).dequantize()
    assert ((rne - target).abs() > 6 * scale / n ** 0.5).any()


def test_stochastic_rounding_two_neighbours_and_probability():
    y = torch.full((20000,), 2.75)  # between 2 and 3: P(3) = 0.75
    r = stochastic_round_e2m1(y, torch.Generator().manual_seed(0))
    assert set(r.unique().tolist()) == {2.0, 3.0}
    assert abs(r.eq(3.0).float().mean().item() - 0.75) < 6 * (0.75 * 0.25 / 20000) ** 0.5
    grid = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    assert torch.equal(stochastic_round_e2m1(grid, torch.Generator().manual_seed(0)), grid)  # exact stay put


@pytest.mark.parametrize("fn", [quantize_nvfp4, quantize_mxfp4])
def test_stochastic_rounding_reproducible(fn):
    x = torch.randn(8, 64)
    a = fn(x, rounding="stochastic", generator=torch.Generator().manual_seed(7)).codes
    b = fn(x, rounding="stochastic", generator=torch.Generator().manual_seed(7)).codes
    c = fn(x, rounding="stochastic", generator=torch.Generator().manual_seed(8)).codes
    assert torch.equal(a, b) and not torch.equal(a, c)
