"""Exact simulated FP4 GEMMs (``fp4/exact_gemm.py``) against a pure-Python exact reference.

The reference reads the codes and scales from ``quantize_nvfp4`` / ``quantize_mxfp4`` (bit-exact
against the spec in test_fp4_formats.py), forms every sum with ``fractions.Fraction`` and applies
the documented rounding sequence with Python floats (IEEE float64, round to nearest) and numpy's
float32 conversion. The library must match it bit for bit and lie within the stated bound of the
exact real value. Exact sums make the bits independent of row order, batch size, K split and
kernels: those are checked bitwise, on any CPU, by construction.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from megatron_fp4.fp4 import OperandFormat, Recipe, fake_quantize, moeresq_linear, quantize_mxfp4, quantize_nvfp4
from megatron_fp4.fp4.e2m1 import codes_to_values
from megatron_fp4.fp4.exact_gemm import exact_fp4_gemm, exact_linear, split_fp4
from megatron_fp4.fp4.formats import block_scales_fp32
from megatron_fp4.fp4.numerics import Numerics

INV = Numerics(invariance="exact")  # the batch-invariant numerics, passed to the calls that run them

NV_IN, NV_W = OperandFormat(), OperandFormat(scale="tensor", block="2d")
MX = OperandFormat(format="mxfp4", scale="tensor")


def _quantize(x, fmt):
    if fmt.format == "nvfp4":
        return quantize_nvfp4(x, scale=fmt.scale, block=fmt.block)
    return quantize_mxfp4(x, scale_mode=fmt.mx_scale_mode)


def _mantissas(t):
    """Exact (code · block scale) per element as Fractions, and the global scale per row (Fraction)."""
    vals = codes_to_values(t.codes).double()
    s = block_scales_fp32(t.block_scales).double()
    rows, k = t.codes.shape
    if t.block == "2d":
        s = s.repeat_interleave(16, 0).repeat_interleave(16, 1)
    else:
        s = s.repeat_interleave(t.block_size, -1)
    mant = [[Fraction(a) * Fraction(b) for a, b in zip(ra, rb)] for ra, rb in zip(vals.tolist(), s.tolist())]
    if t.global_scale is None:
        g = [Fraction(1)] * rows
    else:
        gs = t.global_scale.double().reshape(-1).tolist()
        g = [Fraction(gs[0] if len(gs) == 1 else gs[r]) for r in range(rows)]
    return mant, g


def reference(x, w, bias, fmt_x, fmt_w, compensated):
    """(bits the documented rounding gives, exact real value, Σ|terms| for the bound) per output."""
    q = fake_quantize(x, fmt_x)
    terms = [_mantissas(_quantize(x, fmt_x))] + ([_mantissas(_quantize(x - q, fmt_x))] if compensated else [])
    mw, gw = _mantissas(_quantize(w, fmt_w))
    out, exact, mag = [], [], []
    for m in range(x.shape[0]):
        row_o, row_e, row_m = [], [], []
        for n in range(w.shape[0]):
            acc, ex, size = None, Fraction(0), Fraction(0)
            for mx, gx in terms:
                s = sum((a * b for a, b in zip(mx[m], mw[n])), Fraction(0))
                g = gx[m] * gw[n]
                v = float(s) * float(g)  # fl64(S) (unit scaling is exact), times g: one rounding
                acc = v if acc is None else acc + v
                ex += s * g
                size += abs(s * g)
            if bias is not None:
                acc += float(bias[n])
                ex += Fraction(float(bias[n]))
                size += abs(Fraction(float(bias[n])))
            row_o.append(np.float32(acc))
            row_e.append(ex)
            row_m.append(size)
        out.append(row_o), exact.append(row_e), mag.append(row_m)
    return torch.from_numpy(np.array(out, dtype=np.float32)), exact, mag


def run(x, w, bias, fmt_x, fmt_w, compensated, chunk=1024):
    terms = [split_fp4(x, fmt_x)]
    if compensated:
        terms.append(split_fp4(x - terms[0].deq, fmt_x))
    return exact_fp4_gemm(terms, split_fp4(w, fmt_w), bias, torch.float32, chunk)


def adversarial_nvfp4(rows=6, k=64, n=16, seed=0):
    """Rows whose blocks span 2^-30..2^10 (E4M3 block scales down to subnormals and 0), row global
    scales from 1e-30 to 1e30, and a cancelling pair of large elements."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x = x * torch.pow(2.0, torch.randint(-30, 11, (rows, k // 16), generator=g).float()).repeat_interleave(16, 1)
    x = x * torch.tensor([1e-30, 1.0, 1e30, 1.0, 3.0, 1e-3])[:rows, None]
    x[3, :2] = 1024.0  # cancels against w[:, 0] = -w[:, 1] below
    w = torch.randn(n, k, generator=g) * torch.pow(2.0, torch.randint(-12, 4, (n // 16 or 1, k // 16), generator=g).float()).repeat_interleave(16, 1)
    w[:, 1] = -w[:, 0]
    return x, w


def adversarial_mx(rows=4, k=96, n=8, seed=1):
    """MXFP4 rows whose block exponents span 2^-100..2^90 (the Python-integer path); row 0 holds
    two 2^90 elements in its first and last block that cancel (w[:, 95] = −w[:, 0]) around
    ordinary middle blocks, whose terms a float64 GEMM loses to the 2^90 partial sums."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x[0, :32], x[0, 64:] = 0.0, 0.0
    x[0, 0], x[0, 95] = 2.0 ** 90, 2.0 ** 90
    x[1] *= torch.pow(2.0, torch.tensor([90.0, -100.0, 0.0]).repeat_interleave(32))
    w = torch.randn(n, k, generator=g)
    w[:, 95] = -w[:, 0]
    return x, w


@pytest.mark.parametrize("case", ["nvfp4", "nvfp4_resq", "mxfp4_resq", "nvfp4_two_chunks"])
def test_exact_gemm_matches_fraction_reference_bitwise_and_bound(case):
    if case.startswith("nvfp4"):
        x, w = adversarial_nvfp4()
        fx, fw = NV_IN, NV_W
    else:
        x, w = adversarial_mx()
        fx = fw = MX
    comp = case.endswith("resq") or case == "nvfp4_two_chunks"
    bias = torch.randn(w.shape[0], generator=torch.Generator().manual_seed(3))
    y = run(x, w, bias, fx, fw, comp, chunk=32 if case == "nvfp4_two_chunks" else 1024)
    ref, exact, mag = reference(x, w, bias, fx, fw, comp)
    assert torch.equal(y.view(torch.int32), ref.view(torch.int32))
    for m in range(y.shape[0]):
        for n in range(y.shape[1]):
            yv = float(y[m, n])
            ulp = float(np.spacing(np.float32(abs(yv)))) if yv != 0 else 2.0 ** -149
            assert abs(Fraction(yv) - exact[m][n]) <= Fraction(ulp) / 2 + 4 * Fraction(2) ** -53 * mag[m][n]


def test_mx_fallback_keeps_what_a_float64_gemm_loses():
    x, w = adversarial_mx()
    y = run(x, w, None, MX, MX, compensated=False)
    ref, _, _ = reference(x, w, None, MX, MX, compensated=False)
    assert torch.equal(y, ref)
    naive = (fake_quantize(x, MX).double() @ fake_quantize(w, MX).double().t()).float()
    assert not torch.equal(naive[0], ref[0])  # the 2^90 cancellation swallows the small terms


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("mode", ["fp4", "fp4_resq"])
def test_exact_moeresq_forward_is_batch_invariant_bitwise(fmt, mode):
    """Row order, batch size and K split (chunk size) leave every bit unchanged."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 256, generator=g)
    x[:, 3] *= 50
    w = torch.randn(48, 256, generator=g) / 16
    recipe = Recipe.for_format(mode, fmt)
    full = moeresq_linear(x, w, recipe=recipe, numerics=INV)
    perm = torch.randperm(37, generator=g)
    assert torch.equal(moeresq_linear(x[perm], w, recipe=recipe, numerics=INV), full[perm])
    assert torch.equal(torch.cat([moeresq_linear(x[i:i + 1], w, recipe=recipe, numerics=INV)
                                  for i in range(37)]), full)
    assert torch.equal(moeresq_linear(x[:5].reshape(5, 1, 256), w, recipe=recipe,
                                      numerics=INV).reshape(5, -1), full[:5])
    fx = recipe.input
    comp = mode == "fp4_resq"
    ws = split_fp4(w, recipe.weight)
    for chunk in (16, 64, 100):
        terms = [split_fp4(x, fx)]
        if comp:
            terms.append(split_fp4(x - terms[0].deq, fx))
        assert torch.equal(exact_fp4_gemm(terms, ws, None, torch.float32, chunk), full)


def test_default_path_bits_unchanged_and_mode_close():
    """Off, the forward is the fp32 GEMM of the fake-quantized operands (the pre-existing bits),
    within Higham's γ_K·|Q(x)|·|Q(W)|ᵀ of the exact product of those fp32 operands; on, it is the
    exact product of the unrounded operands (code·s_blk·S_dec, which fp32 rounds by <= u each:
    2u·|Q(x)|·|Q(W)|ᵀ apart) rounded once to fp32 (u·|y|). The float64 reference itself is within
    γ_K(fp64) of its exact value."""
    from tests.numerics import gamma
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(24, 128, generator=g), torch.randn(32, 128, generator=g) / 11
    r = Recipe(mode="fp4")
    qx, qw = fake_quantize(x, r.input), fake_quantize(w, r.weight)
    off = moeresq_linear(x, w, recipe=r)
    assert torch.equal(off, qx @ qw.t())
    on = moeresq_linear(x, w, recipe=r, numerics=INV)
    exact, mag = qx.double() @ qw.double().t(), qx.double().abs() @ qw.double().abs().t()
    ref_err = gamma(128, torch.float64) * mag
    assert ((off.double() - exact).abs() <= gamma(128) * mag + ref_err).all()
    u = torch.finfo(torch.float32).eps / 2
    assert ((on.double() - exact).abs() <= u * exact.abs() + 2 * u * mag + ref_err).all()


def test_exact_linear_is_batch_invariant_and_accurate():
    """The non-FP4 batch-invariant GEMM: bitwise per row whatever the batch, and within
    u_fp32·(|x|·|w|)·4 of the float64 product (24-bit rounding of each operand row + final fp32)."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(29, 200, generator=g), torch.randn(40, 200, generator=g)
    x[:, 7] *= 1e4
    y = exact_linear(x, w)
    assert torch.equal(torch.cat([exact_linear(x[i:i + 1], w) for i in range(29)]), y)
    assert torch.equal(exact_linear(x.flip(0), w).flip(0), y)
    ref = x.double() @ w.double().t()
    scale = x.double().abs().amax(1, keepdim=True) * w.double().abs().sum(1)[None] \
        + x.double().abs().sum(1, keepdim=True) * w.double().abs().amax(1)[None]
    assert ((y.double() - ref).abs() <= 2.0 ** -24 * (scale + ref.abs()) * 2).all()
