"""MXFP4 (OCP Microscaling v1.0): E2M1 elements, one E8M0 power-of-two scale per 32 elements.

Shared exponent of a block with absolute maximum ``amax`` (as torchao computes it, in fp32):

- ``floor`` (OCP): ``e = floor(log2(amax)) − 2`` (2 = emax of E2M1). Elements up to 8·2^e then
  saturate to ±6, as the spec allows.
- ``rceil``: ``e = ceil(log2(fp32(amax / 6)))``, so no element saturates beyond rounding.

``e`` is clamped to the E8M0 range [−127, 127]; an all-zero block gets the smallest scale 2^−127
(biased exponent 0, torchao's behaviour) and codes 0. Both log2 are taken exactly from the fp32
exponent (``frexp``), not from an approximate ``log2``. Elements are E2M1 rounding of
``x / 2^e`` (exact in fp32: a power-of-two scaling) with saturation at ±6. Non-finite input and a
last dim not a multiple of 32 raise ``ValueError`` (see ``formats.py``).
"""
from __future__ import annotations

import torch

from megatron_fp4.fp4.e2m1 import round_e2m1_, stochastic_round_e2m1, values_to_codes
from megatron_fp4.fp4.formats import (
                                      FP4Tensor, Sweep, abs_block_max, check_finite, check_input, check_multiple,
                                      pow2_fp32, check_finite_flag, to_fp32_rows,
                                      )

MX_BLOCK = 32
E2M1_EMAX = 2
E8M0_BIAS = 127
_SIX_F32 = torch.tensor(6.0, dtype=torch.float32)


def shared_exponent(amax: torch.Tensor, scale_mode: str) -> torch.Tensor:
    """Unbiased E8M0 exponent (int32) per block."""
    if scale_mode == "floor":
        mant, exp = torch.frexp(amax)  # amax = mant · 2^exp, mant in [0.5, 1): floor(log2) = exp − 1
        e = exp - 1 - E2M1_EMAX
    else:
        mant, exp = torch.frexp(amax / _SIX_F32.to(amax.device))  # a tensor: see nvfp4_scales
        e = torch.where(mant == 0.5, exp - 1, exp)  # exact power of two: ceil(log2) = exp − 1
    e = torch.where(mant == 0, -E8M0_BIAS, e)  # zero block (or amax/6 underflowing to 0)
    return e.clamp_(-E8M0_BIAS, E8M0_BIAS)


def _check_options(scale_mode: str, rounding: str) -> None:
    what = "quantize_mxfp4"
    if scale_mode not in ("floor", "rceil"):
        raise ValueError(f"{what}: scale_mode={scale_mode!r} is not one of ('floor', 'rceil')")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"{what}: rounding={rounding!r} is not one of ('nearest', 'stochastic')")


def mxfp4_core(x: torch.Tensor, scale_mode: str, rounding: str, generator, name: str, nonfinite=None):
    """Returns (rounded signed E2M1 values (rows, nblk, 32) fp32, unbiased exponent (rows, nblk, 1))."""
    what = "quantize_mxfp4"
    _check_options(scale_mode, rounding)
    check_multiple(x, -1, MX_BLOCK, name, what)
    xf = to_fp32_rows(x, name)  # contiguous fp32 (x itself when it already is)
    a, pooled = abs_block_max(xf, MX_BLOCK)  # |x| (fresh buffer, reused for y below), block maxima
    nblk = x.shape[-1] // MX_BLOCK
    block_amax = pooled.view(-1, nblk, 1)
    amax = block_amax.amax() if block_amax.numel() else block_amax.new_zeros(())  # no rows: finite
    check_finite(x, amax, name, what, nonfinite)  # amax propagates NaN/Inf
    e = shared_exponent(block_amax, scale_mode)
    xb = xf.view(-1, nblk, MX_BLOCK)
    inv = pow2_fp32(-e)  # multiply by 2^-e == divide by 2^e, exactly
    if torch.is_grad_enabled() and xb.requires_grad:  # out= is not differentiable
        y = (xb * inv).clamp_(-6.0, 6.0)
    else:  # reuse the |x| buffer
        y = torch.mul(xb, inv, out=a.view(-1, nblk, MX_BLOCK)).clamp_(-6.0, 6.0)
    q = round_e2m1_(y) if rounding == "nearest" else stochastic_round_e2m1(y, generator)
    return q, e


def mxfp4_rows(src: torch.Tensor, dst: torch.Tensor, sw: Sweep, scale_mode: str) -> torch.Tensor:
    """Fake-quantize a range of fp32 rows ``src`` into ``dst`` (``sw.f32[1]`` too) with
    ``mxfp4_core``'s ops and the dequantizing multiply (MX scales are per block: every range alone
    gives its bits in the whole); returns the block maxima for the finite check."""
    c, n = src.shape
    shape = (c, n // MX_BLOCK, MX_BLOCK)
    block_amax = sw.block_amax(src, MX_BLOCK).unsqueeze(-1)
    e = shared_exponent(block_amax, scale_mode)
    y = torch.mul(src.view(shape), pow2_fp32(-e), out=sw.f32[1][:c].view(shape)).clamp_(-6.0, 6.0)
    torch.mul(round_e2m1_(y, sw.i32[:c].view(shape)), pow2_fp32(e), out=dst.view(shape))
    return block_amax


def _fake_sweep(x: torch.Tensor, scale_mode: str, dtype):
    """``fake_quantize_mxfp4`` (nearest, nothing to differentiate, CPU) of a finite ``x`` one range of
    rows at a time (``formats.Sweep``, as ``nvfp4._fake_sweep``), or None when ``x`` holds a NaN/Inf
    (the reference then reports it and writes its bits)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty(x2.shape, dtype=dtype, device=x.device)
    with Sweep(x2.shape[0], n, x.device) as sw:
        seen = [mxfp4_rows(sw.fp32(x2[a:b]), out[a:b], sw, scale_mode).max() for a, b in sw.spans]
        return out.view(x.shape) if sw.finite(seen) else None


def quantize_mxfp4(x: torch.Tensor, *, scale_mode: str = "floor", rounding: str = "nearest",
                   generator: torch.Generator | None = None, name: str = "x") -> FP4Tensor:
    """Quantize ``x`` (fp32/bf16/fp16, any shape, any strides) to MXFP4; see the module docstring."""
    q, e = mxfp4_core(x, scale_mode, rounding, generator, name)
    codes = values_to_codes(q).reshape(x.shape)
    biased = (e + E8M0_BIAS).to(torch.uint8).reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK)
    return FP4Tensor(codes, biased.view(torch.float8_e8m0fnu), None, "mxfp4", "1d")


def fake_quantize_mxfp4(x: torch.Tensor, *, scale_mode: str = "floor", rounding: str = "nearest",
                        generator: torch.Generator | None = None, name: str = "x", dtype: torch.dtype | None = None,
                        nonfinite=None, compile: str | None = None, kernels=None) -> torch.Tensor:
    """``quantize_mxfp4(x).dequantize()`` without building codes (same bits).

    ``compile``: ``auto`` (None), ``on`` or ``off``, when nearest rounding runs as compiled kernels
    (``fused.py``; the config's ``fp4.compile``, which ``MEGATRON_FP4_COMPILE`` overrides at load).
    ``nonfinite``: a ``NonFiniteFlags`` to record the NaN/Inf check in (no host sync) instead of raising.
    ``kernels``: whose compiled kernels serve (as ``fake_quantize_nvfp4``).
    """
    if kernels is not None and kernels.use_fused(x, rounding, compile):
        what = "quantize_mxfp4"
        _check_options(scale_mode, rounding)
        check_multiple(x, -1, MX_BLOCK, name, what)
        check_input(x, name)
        res = kernels.fake_quantize_mxfp4(x, scale_mode, dtype or x.dtype, compile)
        if res is not None:
            out, finite = res
            check_finite_flag(x, finite, name, what, nonfinite)
            return out
    if rounding == "nearest" and x.device.type == "cpu" and x.numel() \
            and not (torch.is_grad_enabled() and x.requires_grad):  # the eager sweep (finite input)
        _check_options(scale_mode, rounding)
        check_multiple(x, -1, MX_BLOCK, name, "quantize_mxfp4")
        check_input(x, name)
        out = _fake_sweep(x, scale_mode, dtype or x.dtype)
        if out is not None:
            check_finite_flag(x, torch.ones((), dtype=torch.bool), name, "quantize_mxfp4", nonfinite)
            return out
    q, e = mxfp4_core(x, scale_mode, rounding, generator, name, nonfinite)
    return q.mul_(pow2_fp32(e)).reshape(x.shape).to(dtype or x.dtype)
