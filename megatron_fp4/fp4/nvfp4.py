"""NVFP4: E2M1 elements, E4M3 scale per 16-element block, fp32 global scale.

The arithmetic is Transformer Engine's NVFP4 recipe, every step in fp32:

    S_enc = min(448·6 / amax, FLT_MAX)   (1 when amax == 0; amax over the tensor or each row)
    S_dec = 1 / S_enc
    s_blk = e4m3_rne_satfinite(block_amax · (S_enc · fp32(1/6)))
    code  = e2m1_round(clamp(x · min(1 / (fp32(s_blk) · S_dec), FLT_MAX), −6, 6))
    value = code_value · fp32(s_blk) · S_dec

Blocks are 16 consecutive elements of the last dim (``block='1d'``) or 16×16 tiles of the last
two dims (``block='2d'``, per-tensor global scale only: a tile spans 16 rows, so a per-row global
scale would not give one scale per tile). All-zero blocks get scale 0 and codes 0. Leading dims
are flattened into rows, so with ``scale='row'`` a row quantizes to the same bits alone or inside
any batch. See ``formats.py`` for the non-finite and shape errors.

``amax_reduce`` (tensor parallelism, ``tensor_cut.py``): a callable giving the element-wise max of
the global amax (per row or per tensor) over the ranks that hold the other slices of the tensor,
applied before ``S_enc`` is formed, so a slice gets the codes and scales of its part of the whole
tensor. The compiled path does not take it (the portable path serves then).
"""
from __future__ import annotations

import torch

from megatron_fp4.fp4 import formats
from megatron_fp4.fp4.e2m1 import round_e2m1_, stochastic_round_e2m1, values_to_codes
from megatron_fp4.fp4.formats import (
                                      FLT_MAX, FP4Tensor, Sweep, abs_block_max, check_finite, check_input, check_multiple,
                                      check_finite_flag, reduced_amax, to_fp32_rows,
                                      )

E4M3_MAX = 448.0
_ONE_SIXTH_F32 = torch.tensor(1.0 / 6.0, dtype=torch.float32)
_ENC_NUM_F32 = torch.tensor(E4M3_MAX * 6.0, dtype=torch.float32)  # S_enc's numerator (CPU: no op per call)


def _check_options(scale: str, block: str, rounding: str) -> None:
    if scale not in ("row", "tensor"):
        raise ValueError(f"quantize_nvfp4: scale={scale!r} is not one of ('row', 'tensor')")
    if block not in ("1d", "2d"):
        raise ValueError(f"quantize_nvfp4: block={block!r} is not one of ('1d', '2d')")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"quantize_nvfp4: rounding={rounding!r} is not one of ('nearest', 'stochastic')")
    if block == "2d" and scale != "tensor":
        raise ValueError("quantize_nvfp4: block='2d' needs scale='tensor' (a 16x16 tile spans 16 rows)")


def _check_input(x: torch.Tensor, block: str, name: str) -> None:
    """Shape/dtype checks of the input, in the order the errors are documented."""
    what = "quantize_nvfp4"
    check_multiple(x, -1, 16, name, what)
    check_input(x, name)
    if block == "2d":
        if x.dim() < 2:
            raise ValueError(f"{what}: block='2d' needs at least 2 dims, '{name}' has shape {tuple(x.shape)}")
        check_multiple(x, -2, 16, name, what)


def _block_view(t: torch.Tensor, block: str) -> torch.Tensor:
    """Block layout of a contiguous tensor: (rows, nblk, 16) for 1d, (B, mt, 16, nt, 16) for 2d."""
    n = t.shape[-1]
    if block == "1d":
        return t.view(-1, n // 16, 16)
    m = t.shape[-2]
    return t.view(-1, m // 16, 16, n // 16, 16)


def e4m3_rne_(v: torch.Tensor) -> torch.Tensor:
    """``v.to(float8_e4m3fn).to(float32)`` in place on contiguous fp32 ``v`` with finite values in
    [0, 448] (returns ``v``): E4M3's grid step at ``v`` is 2^(max(exponent, −6) − 3) (3 mantissa
    bits, subnormal below 2^−6), and ``round(v / step) · step`` with torch's half-to-even ``round``
    is the cast's round-to-nearest-even. Six vectorized passes instead of two scalar-loop casts
    (fp8 → fp32 is ~15x slower than a multiply on CPU). NaN/Inf are not handled: callers serve
    only finite inputs (``_fake_sweep``)."""
    step = (v.view(torch.int32) & 0x7F800000).clamp_(min=121 << 23).sub_(3 << 23).view(torch.float32)
    return v.div_(step).round_().mul_(step)


def nvfp4_scales(block_amax: torch.Tensor, scale: str, amax_reduce=None):
    """``_scales`` with the block scales rounded by the fp8 cast (see there)."""
    return _scales(block_amax, scale, amax_reduce, fp8=True)


def _scales(block_amax: torch.Tensor, scale: str, amax_reduce=None, fp8: bool = True):
    """(amax, s_blk (e4m3), s_blk as fp32, S_dec, per-block encode scale) from the block amaxes.

    ``block_amax`` is in block layout with singleton element dims; the row amax is its max over
    dim −2 (the block index along the last dim), the tensor amax its max over everything (both
    propagate NaN/Inf, so the non-finite check looks at ``amax`` only). Shared by the eager and the
    compiled path; the numerator is a tensor because inductor turns ``scalar / t`` into
    ``scalar * (1 / t)`` (two roundings). ``amax_reduce``: see the module docstring. ``fp8=False``
    (finite block amaxes only): s_blk is None and s_blk32 is rounded by ``e4m3_rne_`` (the same values).
    """
    if scale == "row":
        amax = block_amax.amax(dim=-2, keepdim=True)  # (rows, 1, 1)
    else:
        amax = block_amax.amax()
    if amax_reduce is not None:
        amax = reduced_amax(amax, amax_reduce)
    num = _ENC_NUM_F32 if amax.device.type == "cpu" else torch.full((), E4M3_MAX * 6.0, dtype=torch.float32,
                                                                      device=amax.device)
    s_enc = (num / amax).clamp_(max=FLT_MAX).masked_fill_(amax == 0, 1.0)  # amax=0 gives inf→FLT_MAX, then 1
    s_dec = torch.reciprocal(s_enc)  # = 1.0 / s_enc, whose __rdiv__ is reciprocal(·) · 1.0: one kernel less
    s_blk = (block_amax * (s_enc * _ONE_SIXTH_F32.to(amax.device))).clamp_(max=E4M3_MAX)
    if fp8:
        s_blk = s_blk.to(torch.float8_e4m3fn)
        s_blk32 = s_blk.to(torch.float32)  # one cast (fp8 casts are scalar loops on CPU)
    else:
        s_blk, s_blk32 = None, e4m3_rne_(s_blk)
    enc_blk = torch.reciprocal(s_blk32 * s_dec).clamp_(max=FLT_MAX)
    return amax, s_blk, s_blk32, s_dec, enc_blk


def nvfp4_core(x: torch.Tensor, scale: str, block: str, rounding: str, generator, name: str, nonfinite=None,
               amax_reduce=None):
    """Shared by the quantizer and the fake-quant path.

    Returns (rounded signed E2M1 values in block layout (fp32, a fresh buffer), s_blk (e4m3, block
    layout with singleton element dims), s_blk as fp32, S_dec (fp32, broadcastable to the block
    layout)).
    """
    _check_options(scale, block, rounding)
    _check_input(x, block, name)
    xf = to_fp32_rows(x, name)  # contiguous fp32 (x itself when it already is)
    a, pooled = abs_block_max(xf, 16)  # |x| (fresh buffer, reused for y below), 1x16 maxima
    if block == "1d":
        block_amax = pooled.view(-1, pooled.shape[-1], 1)
    else:  # 16x16 tile max = max over 16 rows of the 1x16 maxima (a vectorized, non-trailing reduction)
        m, nt = x.shape[-2], pooled.shape[-1]
        block_amax = pooled.view(-1, m // 16, 16, nt).amax(dim=2).view(-1, m // 16, 1, nt, 1)
    amax, s_blk, s_blk32, s_dec, enc_blk = nvfp4_scales(block_amax, scale, amax_reduce)
    check_finite(x, amax, name, "quantize_nvfp4", nonfinite)
    xb = _block_view(xf, block)
    if torch.is_grad_enabled() and xb.requires_grad:  # out= is not differentiable
        y = (xb * enc_blk).clamp_(-6.0, 6.0)
    else:  # reuse the |x| buffer
        y = torch.mul(xb, enc_blk, out=_block_view(a, block)).clamp_(-6.0, 6.0)
    q = round_e2m1_(y) if rounding == "nearest" else stochastic_round_e2m1(y, generator)
    return q, s_blk, s_blk32, s_dec


def _apply(src: torch.Tensor, enc, s_blk32, s_dec, sw: Sweep, dst: torch.Tensor, block: str) -> None:
    """``dst = round(clamp(src · enc)) · s_blk · S_dec`` for a range of rows (``nvfp4_core``'s ops and
    the fake quantizer's two multiplies, left to right), ``y`` and the grid step in ``sw``'s scratch."""
    c, n = src.shape
    shape = (c, n // 16, 16) if block == "1d" else (c // 16, 16, n // 16, 16)
    y = torch.mul(src.view(shape), enc, out=sw.f32[1][:c].view(shape)).clamp_(-6.0, 6.0)
    round_e2m1_(y, sw.i32[:c].view(shape)).mul_(s_blk32)
    torch.mul(y, s_dec, out=dst.view(shape))


def _cast_scales(block_amax: torch.Tensor) -> bool:
    """Whether the sweep rounds the block scales by the fp8 casts (few blocks: two ops) rather than
    ``e4m3_rne_`` (many: six vectorized passes beat the casts' scalar loops); the same values."""
    return block_amax.numel() < 8192


def nvfp4_rows(src: torch.Tensor, dst: torch.Tensor, sw: Sweep) -> torch.Tensor:
    """Fake-quantize a range of rows with per-row scale and 1-D blocks (row-local: a range alone
    gives its bits in the whole) from fp32 ``src`` into ``dst`` (``sw.f32[1]`` too); returns the
    rows' block maxima for the finite check (the values are those of finite rows only)."""
    block_amax = sw.block_amax(src, 16).unsqueeze(-1)
    _, _, s_blk32, s_dec, enc_blk = _scales(block_amax, "row", fp8=_cast_scales(block_amax))
    _apply(src, enc_blk, s_blk32, s_dec, sw, dst, "1d")
    return block_amax


def _fake_sweep(x: torch.Tensor, scale: str, block: str, dtype):
    """``fake_quantize_nvfp4`` (nearest, nothing to differentiate, CPU) of a finite ``x`` one range of
    rows at a time (``Sweep``): the reference's ops on each element in the same order, so its bits,
    with the passes in cache and the scratch allocated once. Per-row scales take one sweep, a
    per-tensor scale a sweep for the block maxima, then one for the values. None when ``x`` holds a
    NaN/Inf: the reference then reports it and writes its bits."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    rows = x2.shape[0]
    out = torch.empty(rows, n, dtype=dtype, device=x.device)
    with Sweep(rows, n, x.device, 16 if block == "2d" else 1) as sw:
        return _fake_sweep_into(x, x2, out, sw, scale, block)


def _fake_sweep_into(x, x2, out, sw: Sweep, scale: str, block: str):
    n = x.shape[-1]
    if scale == "row":
        seen = [nvfp4_rows(sw.fp32(x2[a:b]), out[a:b], sw).max() for a, b in sw.spans]
        return out.view(x.shape) if sw.finite(seen) else None
    pooled = [sw.block_amax(sw.fp32(x2[a:b]), 16) for a, b in sw.spans]
    pooled = torch.cat(pooled) if len(pooled) > 1 else pooled[0]
    if block == "1d":
        block_amax = pooled.unsqueeze(-1)
    else:  # 16x16 tile max = max over 16 rows of the 1x16 maxima
        block_amax = pooled.view(-1, 16, n // 16).amax(dim=1).view(-1, 1, n // 16, 1)
    if not sw.finite([block_amax.max()]):
        return None
    _, _, s_blk32, s_dec, enc_blk = _scales(block_amax, scale, fp8=_cast_scales(block_amax))
    for a, b in sw.spans:
        f = slice(a, b) if block == "1d" else slice(a // 16, b // 16)
        _apply(sw.fp32(x2[a:b]), enc_blk[f], s_blk32[f], s_dec[a:b] if scale == "row" else s_dec, sw, out[a:b], block)
    return out.view(x.shape)


def quantize_nvfp4(x: torch.Tensor, *, scale: str = "row", block: str = "1d", rounding: str = "nearest",
                   generator: torch.Generator | None = None, name: str = "x", amax_reduce=None) -> FP4Tensor:
    """Quantize ``x`` (fp32/bf16/fp16, any shape, any strides) to NVFP4; see the module docstring."""
    q, s_blk, _, s_dec = nvfp4_core(x, scale, block, rounding, generator, name, amax_reduce=amax_reduce)
    codes = values_to_codes(q).reshape(x.shape)
    if block == "1d":
        block_scales = s_blk.reshape(*x.shape[:-1], x.shape[-1] // 16)
    else:
        block_scales = s_blk.reshape(*x.shape[:-2], x.shape[-2] // 16, x.shape[-1] // 16)
    global_scale = s_dec.reshape(x.shape[:-1]) if scale == "row" else s_dec.reshape(())
    return FP4Tensor(codes, block_scales, global_scale, "nvfp4", block)


def fake_quantize_nvfp4(x: torch.Tensor, *, scale: str = "row", block: str = "1d", rounding: str = "nearest",
                        generator: torch.Generator | None = None, name: str = "x", dtype: torch.dtype | None = None,
                        nonfinite=None, compile: str | None = None, amax_reduce=None, kernels=None) -> torch.Tensor:
    """``quantize_nvfp4(x).dequantize()`` without building codes (same bits, fewer passes).

    ``compile``: ``auto`` (None), ``on`` or ``off``, when nearest rounding runs as compiled kernels
    (``fused.py``; the config's ``fp4.compile``, which ``MEGATRON_FP4_COMPILE`` overrides at load).
    ``nonfinite``: a ``NonFiniteFlags`` to record the NaN/Inf check in (no host sync) instead of raising.
    ``kernels``: the compiled backend that may serve (a ``fused.CompiledKernels``: a model's
    ``Numerics.kernels``, or ``fused.PROCESS``, which ``resq.py`` passes for a caller that names
    none), or None: this eager reference alone. An argument, never a module attribute: this module
    does not import the compiled path (``fused.py`` builds on it).
    """
    if amax_reduce is None and kernels is not None and kernels.use_fused(x, rounding, compile):
        _check_options(scale, block, rounding)
        _check_input(x, block, name)
        res = kernels.fake_quantize_nvfp4(x, scale, block, dtype or x.dtype, compile)
        if res is not None:
            out, finite = res
            check_finite_flag(x, finite, name, "quantize_nvfp4", nonfinite)
            return out
    if rounding == "nearest" and amax_reduce is None and x.device.type == "cpu" and x.numel() \
            and (scale == "row" or x.numel() > 4 * formats.SWEEP_ELEMENTS) \
            and not (torch.is_grad_enabled() and x.requires_grad):  # the eager sweep (finite input)
        # (a per-tensor scale takes two sweeps: below a few ranges, e.g. one expert's weight, the
        # tensor is cache-resident anyway and the one-call path is as fast or faster)
        _check_options(scale, block, rounding)
        _check_input(x, block, name)
        out = _fake_sweep(x, scale, block, dtype or x.dtype)
        if out is not None:
            check_finite_flag(x, torch.ones((), dtype=torch.bool), name, "quantize_nvfp4", nonfinite)
            return out
    q, _, s_blk32, s_dec = nvfp4_core(x, scale, block, rounding, generator, name, nonfinite, amax_reduce)
    out = q.mul_(s_blk32).mul_(s_dec)  # (code · s_blk) · S_dec, left to right
    return out.reshape(x.shape).to(dtype or x.dtype)
