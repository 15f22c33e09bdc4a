"""NVFP4 / MXFP4 bit-exactness against a pure-Python reference written from the definitions.

The reference (``_ref_*``) uses Python floats and rounds to fp32 with ``struct`` after every step
the definition performs in fp32 (a product or quotient of two fp32 numbers computed in double and
rounded once is the correctly rounded fp32 result), E4M3 from an explicit enumeration of all 256
codes, E2M1 from the value table. Everything is compared with tolerance 0 (bits).
"""
from __future__ import annotations

import math
import struct

import pytest
import torch

from megatron_fp4.fp4 import (
                              FP4Tensor, fake_quantize_mxfp4, fake_quantize_nvfp4, pack_codes, quantize_mxfp4, quantize_nvfp4, unpack_fp4,
                              )

FLT_MAX = 3.4028234663852886e38
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def f32(v: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def _e4m3_table():
    """(value, code) for all finite non-negative E4M3FN codes: 4 exponent bits (bias 7), 3 mantissa."""
    out = []
    for code in range(128):
        e, m = code >> 3, code & 7
        if e == 15 and m == 7:
            continue  # NaN
        out.append(((m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7), code))
    return out


E4M3 = _e4m3_table()


def e4m3_rne_satfinite(v: float) -> float:
    assert v >= 0
    if v >= 448.0:
        return 448.0
    best = min(E4M3, key=lambda vc: (abs(vc[0] - v), vc[1] & 1))  # nearest, tie → even mantissa
    return best[0]


def e2m1_code(y: float) -> int:
    a = min(abs(y), 6.0)
    mag = min(range(8), key=lambda c: (abs(E2M1[c] - a), c & 1))  # nearest, tie → even code
    return mag | (8 if math.copysign(1.0, y) < 0 else 0)


def _ref_nvfp4_blocks(rows, blocks, tensor_amax_rows):
    """rows: list of lists (fp32 values); blocks: list of lists of (r, c) index groups;
    tensor_amax_rows: groups of rows sharing a global amax. Returns codes, scales per block, S_dec per row."""
    n_r, n_c = len(rows), len(rows[0])
    codes = [[0] * n_c for _ in range(n_r)]
    deq = [[0.0] * n_c for _ in range(n_r)]
    s_dec_of_row, s_enc_of_row = {}, {}
    for group in tensor_amax_rows:
        amax = max(abs(rows[r][c]) for r in group for c in range(n_c))
        s_enc = 1.0 if amax == 0 else min(f32(2688.0 / amax), FLT_MAX)
        for r in group:
            s_enc_of_row[r], s_dec_of_row[r] = s_enc, f32(1.0 / s_enc)
    scales = []
    for idx in blocks:
        r0 = idx[0][0]
        s_enc, s_dec = s_enc_of_row[r0], s_dec_of_row[r0]
        bamax = max(abs(rows[r][c]) for r, c in idx)
        s_blk = e4m3_rne_satfinite(f32(bamax * f32(s_enc * f32(1.0 / 6.0))))
        denom = f32(s_blk * s_dec)
        enc = FLT_MAX if denom == 0 else min(f32(1.0 / denom), FLT_MAX)
        for r, c in idx:
            y = max(-6.0, min(6.0, f32(rows[r][c] * enc)))
            code = e2m1_code(y)
            codes[r][c] = code
            val = math.copysign(E2M1[code & 7], -1.0 if code & 8 else 1.0)
            deq[r][c] = f32(f32(val * s_blk) * s_dec)
        scales.append(s_blk)
    return codes, scales, [s_dec_of_row[r] for r in range(n_r)], deq


def ref_nvfp4(x2d: torch.Tensor, scale: str, block: str):
    rows = x2d.to(torch.float32).tolist()
    n_r, n_c = len(rows), len(rows[0])
    groups = [[r] for r in range(n_r)] if scale == "row" else [list(range(n_r))]
    if block == "1d":
        blocks = [[(r, c) for c in range(b * 16, b * 16 + 16)] for r in range(n_r) for b in range(n_c // 16)]
    else:
        blocks = [[(r, c) for r in range(i * 16, i * 16 + 16) for c in range(j * 16, j * 16 + 16)]
                  for i in range(n_r // 16) for j in range(n_c // 16)]
    return _ref_nvfp4_blocks(rows, blocks, groups)


def tricky_rows(dtype=torch.float32) -> torch.Tensor:
    """8 rows × 64 (4 NVFP4 blocks / 2 MX blocks a row) covering the cases of the definition."""
    g = torch.Generator().manual_seed(0)
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, 0.1]
    rows = torch.zeros(8, 64)
    # Row 0: amax 2688 gives S_enc = 1, so a block with amax 6 has s_blk = 1 and E2M1 ties are exact.
    rows[0, :16] = torch.tensor(ties)
    rows[0, 16:32] = torch.tensor(ties) / 2  # amax 3: s_blk 0.5, scaled values are the ties again
    rows[0, 32] = 2688.0
    rows[0, 48:64] = torch.linspace(-7.0, 7.0, 16)
    rows[1] = torch.randn(64, generator=g)
    rows[2] = torch.randn(64, generator=g) * torch.logspace(-6, 3, 64)  # block amaxes across E4M3 range
    rows[3, 5] = 1e30  # single huge outlier: other blocks get subnormal/zero E4M3 scales
    rows[3, 16:] = torch.randn(48, generator=g) * 1e-3
    rows[4] = torch.randn(64, generator=g) * 1e-30  # tiny row
    rows[5, 16:32] = torch.randn(16, generator=g)  # all-zero blocks around a non-zero one
    # Row 6 (found by search): with this amax, block_amax · (S_enc · fp32(1/6)) and block_amax · S_enc / 6
    # round to different E4M3 scales, so the row pins TE's order of fp32 operations.
    rows[6, :16] = -torch.rand(16, generator=g) * 40.0
    rows[6, 0] = 40.316925048828125
    for b, bamax in enumerate([0.0002636517456267029, 0.0016697943210601807, 0.0004394196148496121]):
        rows[6, (b + 1) * 16:(b + 2) * 16] = torch.linspace(-bamax, bamax / 3, 16)
    # Row 7: block amaxes near E4M3 rounding midpoints (amax 2688 again → S_enc 1).
    rows[7, 0] = 2688.0
    for b, mid in enumerate([1.0625, 0.0029296875, 13.0, 0.015625 * 1.0625]):
        if b:
            rows[7, b * 16:(b + 1) * 16] = torch.linspace(-1, 1, 16) * mid * 6.0
    return rows.to(dtype)


def _check_nvfp4(x, scale, block):
    q = quantize_nvfp4(x, scale=scale, block=block)
    x2 = x.reshape(-1, x.shape[-1]) if block == "1d" else x
    codes, scales, s_dec, deq = ref_nvfp4(x2, scale, block)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == x.shape
    assert q.block_scales.dtype == torch.float8_e4m3fn
    assert q.codes.reshape(x2.shape).tolist() == codes
    assert q.block_scales.float().flatten().tolist() == scales
    g = q.global_scale.flatten().tolist()
    assert g == (s_dec if scale == "row" else s_dec[:1])
    assert q.dequantize().reshape(x2.shape).tolist() == deq
    assert torch.equal(fake_quantize_nvfp4(x, scale=scale, block=block, dtype=torch.float32), q.dequantize())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", ["row", "tensor"])
def test_nvfp4_1d_bit_exact(dtype, scale):
    _check_nvfp4(tricky_rows(dtype), scale, "1d")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_2d_bit_exact(dtype):
    x = torch.cat([tricky_rows(dtype), tricky_rows(dtype).flip(0) * 3]).reshape(16, 64)
    _check_nvfp4(x, "tensor", "2d")
    _check_nvfp4(x.t().contiguous()[:32].t(), "tensor", "2d")  # non-contiguous 16×32 view


def test_nvfp4_non_contiguous_and_leading_dims():
    base = tricky_rows()
    view = torch.stack([base, base * 2]).transpose(0, 1)  # (8, 2, 64), non-contiguous
    assert not view.is_contiguous()
    _check_nvfp4(view, "row", "1d")
    q = quantize_nvfp4(view)
    assert q.block_scales.shape == (8, 2, 4) and q.global_scale.shape == (8, 2)
    strided = torch.randn(4, 128)[:, ::2]
    assert torch.equal(quantize_nvfp4(strided).codes, quantize_nvfp4(strided.contiguous()).codes)


def test_nvfp4_zero_and_tie_cases_by_hand():
    x = tricky_rows()
    q = quantize_nvfp4(x, scale="row")
    # Row 0, block 0: S_enc = 1, s_blk = 1, so codes are E2M1 RNE of the tie values themselves.
    expected = [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12, 12, 14, 14, 0]
    assert q.codes[0, :16].tolist() == expected
    assert q.block_scales[0, 0].float().item() == 1.0 and q.global_scale[0].item() == 1.0
    z = quantize_nvfp4(torch.zeros(3, 32), scale="tensor")
    assert z.codes.eq(0).all() and z.block_scales.float().eq(0).all() and z.global_scale.item() == 1.0
    assert torch.isfinite(z.dequantize()).all() and z.dequantize().eq(0).all()


def test_e4m3_reference_matches_torch_cast():
    """torch's fp32→float8_e4m3fn cast is RNE with saturation; check it against the enumeration."""
    vals = sorted(v for v, _ in E4M3)
    probes = [0.0, 1e-12, 448.0, 449.0, 463.9, 464.0, 1e6]
    for a, b in zip(vals, vals[1:]):
        mid = (a + b) / 2  # exact ties (fp32-representable) and points just around them
        probes += [mid, f32(mid * (1 - 2 ** -20)), f32(mid * (1 + 2 ** -20)), a]
    t = torch.tensor(probes, dtype=torch.float32)
    ours = [e4m3_rne_satfinite(v) for v in t.tolist()]
    assert t.to(torch.float8_e4m3fn).float().tolist() == ours


def ref_mxfp4(x2d: torch.Tensor, mode: str):
    rows = x2d.to(torch.float32).tolist()
    codes, exps = [], []
    for row in rows:
        crow, erow = [], []
        for b in range(0, len(row), 32):
            blk = row[b:b + 32]
            amax = max(abs(v) for v in blk)
            if mode == "floor":
                e = -10 ** 6 if amax == 0 else max(k for k in range(-160, 130) if 2.0 ** k <= amax) - 2
            else:
                v = f32(amax / 6.0)
                e = -10 ** 6 if v == 0 else min(k for k in range(-160, 130) if 2.0 ** k >= v)
            e = max(-127, min(127, e))
            erow.append(e)
            crow += [e2m1_code(max(-6.0, min(6.0, f32(v / 2.0 ** e)))) for v in blk]
        codes.append(crow)
        exps.append(erow)
    return codes, exps


@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_bit_exact(mode, dtype):
    x = tricky_rows(dtype)
    x[1, :32] = torch.tensor([6.0] + [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4 + [-5.0, -0.25, -2.5]).to(dtype)
    x[4, 32:] = torch.full((32,), 1e-40).to(dtype)  # subnormal fp32 amax: exponent clamps to -127
    x[5, :32] = 3e38  # near FLT_MAX: exponent 125
    view = torch.stack([x, -x], dim=1)  # (8, 2, 64), non-contiguous after transpose below
    view = view.transpose(0, 1)
    q = quantize_mxfp4(view, scale_mode=mode)
    codes, exps = ref_mxfp4(view.reshape(-1, 64), mode)
    assert q.block_scales.dtype == torch.float8_e8m0fnu and q.global_scale is None
    assert q.codes.reshape(-1, 64).tolist() == codes
    assert (q.block_scales.view(torch.uint8).to(torch.int32) - 127).reshape(-1, 2).tolist() == exps
    deq = [[math.copysign(E2M1[c & 7], -1.0 if c & 8 else 1.0) * 2.0 ** e
            for c_blk, e in zip((crow[:32], crow[32:]), erow) for c in c_blk] for crow, erow in zip(codes, exps)]
    assert q.dequantize().reshape(-1, 64).tolist() == [[f32(v) for v in r] for r in deq]
    assert torch.equal(fake_quantize_mxfp4(view, scale_mode=mode, dtype=torch.float32), q.dequantize())
    zero = quantize_mxfp4(torch.zeros(2, 32), scale_mode=mode)
    assert zero.block_scales.view(torch.uint8).eq(0).all() and zero.codes.eq(0).all()  # smallest scale 2^-127


def test_pack_roundtrip_and_nibble_order():
    codes = torch.tensor([[1, 2, 15, 8, 0, 7, 9, 6]], dtype=torch.uint8)
    q = FP4Tensor(codes, torch.ones(1, 1).to(torch.float8_e8m0fnu), None, "mxfp4")
    packed = q.pack()
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (1, 4)
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x8F, 0x70, 0x69]]  # even element = low nibble
    assert torch.equal(unpack_fp4(packed), codes)
    x = torch.randn(3, 5, 64)
    for q in (quantize_nvfp4(x), quantize_mxfp4(x)):
        back = FP4Tensor.from_packed(q.pack(), q.block_scales, q.global_scale)
        assert back.format == q.format and torch.equal(back.dequantize(), q.dequantize())
    assert pack_codes(quantize_nvfp4(x).codes).shape == (3, 5, 32)


@pytest.mark.parametrize("fn", [quantize_nvfp4, quantize_mxfp4])
def test_non_finite_raises_with_name_and_count(fn):
    x = torch.randn(4, 64)
    x[1, 3], x[2, 40], x[3, 0] = float("nan"), float("inf"), -float("inf")
    with pytest.raises(ValueError, match=r"'act' has 3 non-finite element"):
        fn(x, name="act")


def test_non_multiple_shapes_raise():
    with pytest.raises(ValueError, match=r"dim 1 .* size 40, which is not a multiple of 16"):
        quantize_nvfp4(torch.randn(2, 40))
    with pytest.raises(ValueError, match=r"dim 1 .* size 48, which is not a multiple of 32"):
        quantize_mxfp4(torch.randn(2, 48))
    with pytest.raises(ValueError, match=r"dim 0 .* size 8, which is not a multiple of 16"):
        quantize_nvfp4(torch.randn(8, 32), scale="tensor", block="2d")
    with pytest.raises(ValueError, match="block='2d' needs scale='tensor'"):
        quantize_nvfp4(torch.randn(16, 32), scale="row", block="2d")
