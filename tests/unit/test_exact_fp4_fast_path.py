"""The exact FP4 GEMM's fast paths give the bits of the implementation they replaced.

``_Reference`` keeps that implementation verbatim (commit a3d0106: every sum checked row by row
against the 2^53 bound, one GEMM per term, powers of two and scales as (M, N) tensors). Why the
bits agree *by construction*, so the claim holds on any CPU, kernel set and thread count:

- the sums are exact integers below 2^53 (NVFP4: ``|ints| ≤ 6·448·2^10`` by construction, so
  ``1024 · bound² < 2^53`` per chunk; the old data-dependent check always passed there), and an
  exact sum is the same whatever GEMM shape forms it: the terms' rows stacked into one GEMM, or
  several weights' GEMMs sharing one quantized input, give the old per-term sums;
- the scaling is the same IEEE operations on the same operands: ``S · 2^e`` with ``2^e`` a Python
  float instead of a tensor of that value, ``(S·2^e) · (s_x·s_w)`` with a per-tensor ``s_w`` as one
  broadcast column instead of N equal ones.

The reference is compared on random data, rows at the magnitude bound, zero rows, subnormal
global scales, K past one chunk, MXFP4 rows that need the Python-integer path, and NaN rows
(deferred non-finite checks let them through).
"""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.fp4 import OperandFormat, Recipe, exact_experts, exact_gemm
from megatron_fp4.fp4.exact_gemm import split_fp4
from megatron_fp4.fp4.moeresq import moeresq_linear
from megatron_fp4.fp4.nonfinite import NonFiniteFlags
from megatron_fp4.fp4.numerics import Numerics

INV = Numerics(invariance="exact")
NV_ROW, NV_TILE = OperandFormat(), OperandFormat(scale="tensor", block="2d")
NV_TENSOR = OperandFormat(scale="tensor")
MX = OperandFormat(format="mxfp4", scale="tensor")


class _Reference:
    """The exact FP4 GEMM as it was (verbatim, names prefixed)."""

    @staticmethod
    def exact_sum_products(a, b, chunk=exact_gemm.CHUNK, b_amax=None):
        M, K = a.shape
        c = max(1, min(chunk, K))
        if K == 0:
            return a.new_zeros(M, b.shape[0])
        b_amax = b.abs().amax() if b_amax is None else b_amax
        ok = ~(a.abs().amax(-1) * b_amax * c > 2.0 ** 53)
        out = a.new_zeros(M, b.shape[0])
        rows = ok.nonzero().squeeze(-1)
        if rows.numel():
            a_ok = a[rows] if rows.numel() < M else a
            if K <= c:
                res = a_ok @ b.t()
            else:
                total = torch.zeros(a_ok.shape[0], b.shape[0], dtype=torch.int64, device=a.device)
                finite = a_ok.new_zeros(a_ok.shape[0], b.shape[0])
                for k0 in range(0, K, c):
                    part = a_ok[:, k0:k0 + c] @ b[:, k0:k0 + c].t()
                    finite = finite + part * 0.0
                    total += torch.nan_to_num(part).to(torch.int64)
                res = total.to(torch.float64) + finite
            out[rows] = res
        bad = (~ok).nonzero().squeeze(-1)
        if bad.numel():
            out[bad] = exact_gemm._python_rows(a[bad], b)
        return out

    @staticmethod
    def exact_fp4_terms(x_terms, sums, w_exp, w_scale, bias, out_dtype):
        acc = None
        for t, s in zip(x_terms, sums):
            v = s * exact_gemm.pow2_f64(t.exp[:, None] + w_exp)
            if t.scale is not None or w_scale is not None:
                sa = t.scale.double() if t.scale is not None else t.ints.new_ones(t.ints.shape[0])
                v = v * (sa[:, None] * (w_scale if w_scale is not None else t.ints.new_ones(s.shape[1])))
            acc = v if acc is None else acc + v
        if bias is not None:
            acc = acc + bias.double()
        return acc.to(out_dtype)

    @classmethod
    def exact_fp4_gemm(cls, x_terms, w, bias, out_dtype, chunk=exact_gemm.CHUNK):
        amax = w.abs_max() if w.ints.numel() else None
        sums = [cls.exact_sum_products(t.ints, w.ints, chunk, amax) for t in x_terms]
        return cls.exact_fp4_terms(x_terms, sums, w.exp[None, :], None if w.scale is None else w.scale.double()[None, :],
                                   bias, out_dtype)


def bits(t):
    return t.contiguous().view({torch.float32: torch.int32, torch.float64: torch.int64}.get(t.dtype, torch.int16))


def _terms(x, fmt, compensated, nonfinite=None):
    first = split_fp4(x, fmt, nonfinite=nonfinite)
    return [first] + ([split_fp4(x - first.deq, fmt, nonfinite=nonfinite, name="x residual")] if compensated else [])


def _input(rows: int, k: int, seed: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    if kind == "adversarial":
        x[0] = 6.0 * 448.0  # every element at the NVFP4 magnitude bound (ints = NVFP4_INT_MAX)
        x[1 % rows] = 0.0  # an all-zero row (scale 1, codes 0)
        x[2 % rows] *= 1e-40  # subnormal fp32 inputs: a subnormal global scale
        grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])  # E2M1 rounding ties (x 2^j)
        x[3 % rows] = grid.repeat(k // 8 + 1)[:k] * 2.0 ** torch.randint(-3, 4, (k,), generator=g)
        x[4 % rows, ::2] *= 2.0 ** 30  # blocks of very different magnitude in one row
    return x


@pytest.mark.parametrize("fmt_x,fmt_w", [(NV_ROW, NV_TILE), (NV_TENSOR, NV_ROW), (MX, MX)])
@pytest.mark.parametrize("rows,k,n", [(1, 16 * 2, 5), (7, 64, 48), (5, 3072, 17)])
@pytest.mark.parametrize("kind", ["random", "adversarial"])
def test_exact_fp4_gemm_bits_equal_reference(fmt_x, fmt_w, rows, k, n, kind):
    """One stacked GEMM per weight and the scalar powers of two give the reference's bits."""
    if fmt_w.block == "2d" and n % 16:
        n += 16 - n % 16
    x = _input(rows, k, rows * k + n, kind)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    ws = split_fp4(w, fmt_w)
    bias = torch.randn(n)
    for compensated in (False, True):
        terms = _terms(x, fmt_x, compensated)
        for b, dtype in ((None, torch.float32), (bias, torch.bfloat16)):
            for chunk in (exact_gemm.CHUNK, 48):
                got = exact_gemm.exact_fp4_gemm(terms, ws, b, dtype, chunk)
                assert torch.equal(bits(got), bits(_Reference.exact_fp4_gemm(terms, ws, b, dtype, chunk)))


def test_mxfp4_rows_past_the_bound_take_the_python_path_as_before(monkeypatch):
    """MXFP4 rows whose block exponents span ≳ 35 binades fail the data-dependent check (no
    bound by construction): the same rows reach the Python-integer path, same bits."""
    x = torch.randn(4, 64)
    x[1, :32] *= 2.0 ** 60  # span of 60 binades in row 1
    w = torch.randn(6, 64)
    w[:, 32:] *= 2.0 ** 20
    terms, ws = _terms(x, MX, True), split_fp4(w, MX)
    seen = []
    python_rows = exact_gemm._python_rows
    monkeypatch.setattr(exact_gemm, "_python_rows", lambda a, b: seen.append(a.shape[0]) or python_rows(a, b))
    got = exact_gemm.exact_fp4_gemm(terms, ws, None, torch.float32)
    assert seen and all(s >= 1 for s in seen)
    assert torch.equal(bits(got), bits(_Reference.exact_fp4_gemm(terms, ws, None, torch.float32)))


def test_nan_rows_give_the_reference_bits():
    """A NaN input row (deferred non-finite check) stays NaN, the other rows keep their bits."""
    x = torch.randn(3, 32)
    x[1, 5] = float("nan")
    flags = NonFiniteFlags()
    terms, ws = _terms(x, NV_ROW, True, flags), split_fp4(torch.randn(8, 32), NV_TENSOR)
    got = exact_gemm.exact_fp4_gemm(terms, ws, None, torch.float32)
    ref = _Reference.exact_fp4_gemm(terms, ws, None, torch.float32)
    assert torch.isnan(got[1]).all() and torch.equal(bits(got), bits(ref))


def _reference_grouped(x, weights, counts, recipe, names):
    """The experts one by one through moeresq_linear's batch-invariant forward (the definition)."""
    outs, start = [], 0
    for w, n, name in zip(weights, counts, names):
        if n:
            outs.append(moeresq_linear(x[start:start + n], w, recipe=recipe, name=name, numerics=INV))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("fmt_w", [NV_TENSOR, NV_TILE, MX])
@pytest.mark.parametrize("counts", [[3, 0, 1, 5], [1, 1], [0, 9, 0]])
def test_grouped_experts_bits_equal_one_by_one(fmt_w, counts):
    fmt_x = MX if fmt_w.format == "mxfp4" else NV_ROW
    recipe = Recipe(mode="fp4_resq", input=fmt_x, weight=fmt_w)
    x = _input(sum(counts), 64, sum(counts), "adversarial")
    weights = list(torch.randn(len(counts), 32, 64, generator=torch.Generator().manual_seed(1)).unbind(0))
    names = [f"e{i}" for i in range(len(counts))]
    got = exact_experts.exact_grouped_fp4(x, weights, counts, recipe, names, "group", INV)
    assert torch.equal(bits(got), bits(_reference_grouped(x, weights, counts, recipe, names)))


def test_grouped_experts_one_gemm_per_expert(monkeypatch):
    """Both MoEResQ terms of an expert in one exact GEMM (the old code ran one per term)."""
    calls = []
    real = exact_experts.exact_sum_products
    monkeypatch.setattr(exact_experts, "exact_sum_products", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    counts = [2, 0, 3]
    recipe = Recipe(mode="fp4_resq", input=NV_ROW, weight=NV_TENSOR)
    x, weights = torch.randn(5, 32), list(torch.randn(3, 16, 32).unbind(0))
    exact_experts.exact_grouped_fp4(x, weights, counts, recipe, ["a", "b", "c"], "g", INV)
    assert calls == [(4, 32), (6, 32)]  # rows of both terms per non-empty expert


def test_nvfp4_sums_skip_the_data_dependent_check(monkeypatch):
    """NVFP4 operands are within the bound by construction: no per-row check (|a|, amax, nonzero)."""
    terms, ws = _terms(torch.randn(4, 64), NV_ROW, True), split_fp4(torch.randn(8, 64), NV_TENSOR)
    monkeypatch.setattr(torch.Tensor, "nonzero", lambda *a, **k: pytest.fail("data-dependent check ran"))
    exact_gemm.exact_fp4_gemm(terms, ws, None, torch.float32)


def _per_shard(x, weight, bias, shards, names, recipe, numerics):
    """The definition: each shard's moeresq_linear, outputs concatenated."""
    biases = bias.split(shards) if bias is not None else [None] * len(shards)
    return torch.cat([moeresq_linear(x, w, b, recipe=recipe, name=n, numerics=numerics)
                      for w, b, n in zip(weight.split(shards), biases, names)], -1)


@pytest.mark.parametrize("mode", ["fp4", "fp4_resq"])
@pytest.mark.parametrize("fmt_x,fmt_w", [(NV_ROW, NV_TENSOR), (NV_ROW, NV_TILE), (MX, MX)])
@pytest.mark.parametrize("level", ["exact", "batch", "standard"])
def test_shared_input_linear_bits_equal_per_shard(mode, fmt_x, fmt_w, level):
    """Fused q/k/v (three shards, one input): Q̃(x) once, the per-shard bits, with and without a
    weight cache, on random and adversarial rows (leading dims, bias, fp32 and bf16 input)."""
    recipe = Recipe(mode=mode, input=fmt_x, weight=fmt_w)
    shards, names = [64, 32, 32], ["l.q_proj", "l.k_proj", "l.v_proj"]
    weight = torch.randn(128, 64, generator=torch.Generator().manual_seed(2))
    weight[64:96] *= 1e3  # shards of very different magnitude: their own per-tensor scales
    bias = torch.randn(128)
    for kind in ("random", "adversarial"):
        x = _input(6, 64, 5, kind).reshape(2, 3, 64)
        for dtype, b in ((torch.float32, bias), (torch.bfloat16, None)):
            for cache in (None, {}):
                numerics = Numerics(invariance=level)  # batch: each shard's GEMM over its own row tiles
                numerics.weight_cache = cache
                xd = x.to(dtype)
                want = _per_shard(xd, weight, b, shards, names, recipe, numerics)
                assert exact_experts.can_share_input(recipe, xd, weight, numerics)
                for _ in range(2):  # the second call hits the cache (when there is one)
                    got = exact_experts.shared_input_linear(xd, weight, b, shards, names, recipe, "l.qkv", numerics)
                    assert got.shape == want.shape and torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("invariant_on", [True, False])
def test_shared_input_linear_quantizes_the_input_once(monkeypatch, invariant_on):
    """One Q̃(x) for all shards (per-shard calls made one each), the weights once per version."""
    from megatron_fp4.fp4 import moeresq
    seen = []
    for meth in ("split", "quantize"):
        real = getattr(moeresq._Site, meth)
        monkeypatch.setattr(moeresq._Site, meth, lambda self, a, fmt, op, *r, real=real, **k:
                            seen.append(op) or real(self, a, fmt, op, *r, **k))
    numerics = Numerics(invariance="exact" if invariant_on else "standard")
    numerics.weight_cache = {}
    recipe = Recipe(mode="fp4_resq")
    x, weight = torch.randn(4, 32), torch.randn(48, 32)
    for _ in range(2):
        exact_experts.shared_input_linear(x, weight, None, [16, 16, 16], ["q", "k", "v"], recipe, "qkv", numerics)
    assert seen.count("input") == 2 and seen.count("weight") == 3  # 2 calls; 3 shards quantized once


def test_shared_input_refused_where_it_would_change_bits():
    """Stochastic rounding (streams keyed by the shard's name), autograd, deferred checks: no sharing."""
    x, w = torch.randn(4, 32), torch.randn(48, 32)
    sr = OperandFormat(rounding="stochastic")
    assert not exact_experts.can_share_input(Recipe(mode="fp4_resq", input=sr), x, w, INV)
    assert not exact_experts.can_share_input(Recipe(mode="fp4_resq"), x.requires_grad_(), w, INV)
    assert not exact_experts.can_share_input(Recipe(mode="bf16"), x.detach(), w, INV)
