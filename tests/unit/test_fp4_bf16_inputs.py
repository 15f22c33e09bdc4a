"""bf16 inputs to the fake-quantizers give the bits of the fp32-upcast input, on every path.

bf16 -> fp32 is exact and every quantizer step runs in fp32, so ``fq(x_bf16, dtype=fp32)`` must
equal ``fq(x_bf16.float())`` bitwise, and with a bf16 output the same value rounded once to bf16
(tolerance 0 by construction). Checked for the eager path and the compiled kernels; also the
multiply-by-reciprocal-step rounding of the compiled kernels against the eager rounding.
"""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.fp4 import fused
from megatron_fp4.fp4 import mxfp4, nvfp4

from megatron_fp4.fp4.e2m1 import E2M1_VALUES, round_e2m1

from tests.unit.test_fp4_formats import tricky_rows
from tests.unit.test_fp4_fused import _bits, compiled, needs_inductor  # noqa: F401 (fixture)


# The quantizers take their compiled backend as an argument (None: the eager reference alone); these
# tests hand them the process's store (tests/conftest.py makes it fresh for every test) unless they name one.
def fake_quantize_nvfp4(x, **kw):
    return nvfp4.fake_quantize_nvfp4(x, **{"kernels": fused.PROCESS, **kw})


def fake_quantize_mxfp4(x, **kw):
    return mxfp4.fake_quantize_mxfp4(x, **{"kernels": fused.PROCESS, **kw})

_CASES = [
    (fake_quantize_nvfp4, {}),
    (fake_quantize_nvfp4, {"scale": "tensor"}),
    (fake_quantize_nvfp4, {"scale": "tensor", "block": "2d"}),
    (fake_quantize_mxfp4, {}),
    (fake_quantize_mxfp4, {"scale_mode": "rceil"}),
]


def _bf16_inputs():
    g = torch.Generator().manual_seed(3)
    tricky = tricky_rows(torch.bfloat16)
    yield torch.cat([tricky, -tricky.flip(0) * 3]).reshape(16, 64)
    yield (torch.randn(32, 128, generator=g) * torch.logspace(-30, 30, 128)).bfloat16()
    yield torch.randn(64, 32, generator=g).bfloat16().t()  # non-contiguous (32, 64)


def _check(fn, kw, mode):
    for x in _bf16_inputs():
        if kw.get("block") == "2d" and x.shape[-2] % 16 or fn is fake_quantize_mxfp4 and x.shape[-1] % 32:
            continue
        ref = fn(x.float(), compile="off", **kw)  # the fp32-upcast reference (eager)
        wide = fn(x, dtype=torch.float32, compile=mode, **kw)
        narrow = fn(x, compile=mode, **kw)
        assert wide.dtype == torch.float32 and narrow.dtype == torch.bfloat16
        assert torch.equal(_bits(wide), _bits(ref)), (fn.__name__, kw, mode)
        assert torch.equal(_bits(narrow), _bits(ref.bfloat16())), (fn.__name__, kw, mode)


@pytest.mark.parametrize("fn,kw", _CASES)
def test_bf16_eager_equals_fp32_upcast(fn, kw):
    _check(fn, kw, "off")


@needs_inductor
@pytest.mark.parametrize("fn,kw", _CASES)
def test_bf16_compiled_equals_fp32_upcast(fn, kw, compiled):  # noqa: F811
    _check(fn, kw, "on")


def test_reciprocal_step_rounding_equals_eager_rounding():
    """``y · (1/step)`` (compiled kernels) gives ``round_e2m1``'s bits (``y / step``) on [-6, 6]:
    every bf16 value, the grid, its midpoints and their fp32 neighbours, subnormals, ±0."""
    every_bf16 = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    grid = torch.tensor(E2M1_VALUES)
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, grid] + [torch.nextafter(t, t + d) for t in (mids, grid) for d in (1, -1)])
    g = torch.Generator().manual_seed(0)
    y = torch.cat([every_bf16, torch.rand(1 << 20, generator=g) * 12 - 6, near, -near,
                   torch.tensor([1e-45, -1e-45, 1e-39, 0.0, -0.0])])
    y = y[y.isfinite()].clamp(-6.0, 6.0)
    assert torch.equal(_bits(round_e2m1(y)), _bits(fused.round_e2m1_mul(y)))
