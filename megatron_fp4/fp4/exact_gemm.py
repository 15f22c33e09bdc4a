"""Exact simulated GEMMs: sums formed without rounding, so their order cannot matter.

An operand row is held as a :class:`Split`: integers ``ints`` (float64 holding integer values),
a power-of-two unit ``2^exp`` per row and an optional fp32 global scale per row, with
``value = ints · 2^exp · scale``. For two splits ``a`` (rows M) and ``b`` (rows N) the exact sum
``S[m, n] = Σ_k a.ints[m, k] · b.ints[n, k]`` is an integer; :func:`exact_dot` forms it exactly
and returns ``fl64(S) · 2^(a.exp + b.exp)`` (``fl64`` = round to nearest float64; the identity when
``|S| < 2^53``).

**Why it is exact.** A float64 GEMM forms each output by float64 products and additions (in an
order and split the BLAS picks). If every term and every partial sum is an integer of magnitude
``≤ 2^53``, none of them rounds, so *any* order gives ``S``. Per K-chunk of ``c`` terms the
partial sums are bounded by ``c · max|a_m| · max|b|``; :func:`exact_dot` checks
``c · max|a.ints[m]| · max|b.ints| ≤ 2^53`` per row ``m`` (the bound is read from the block scales,
through the integers they produce), accumulates the chunk results in int64 (exact while
``(K / c) · 2^53 < 2^63``, i.e. ``K ≤ 2^20``) and computes the rows that fail the check exactly with
Python integers (slow, rare: only MXFP4 rows whose block exponents span ≳ 35 binades). The result
is a function of the exact ``S`` alone: the same bits for any row order, batch size, K split, BLAS,
thread count or machine.

**FP4 operands** (:func:`split_fp4`): a quantized element is ``code · s_blk · S_dec``.

- NVFP4: ``code · s_blk`` is an E2M1 value (a multiple of 1/2, ≤ 6) times an E4M3 value (a
  multiple of 2^-9, ≤ 448): a multiple of ``2^-10`` of magnitude ≤ 2688, i.e. an integer
  ``≤ 2752512 < 2^21.4`` in units ``2^-10``. The global scale ``S_dec`` (per row or per tensor)
  is factored out. Per 1024-term chunk: ``1024 · 2752512² < 2^52.8 ≤ 2^53``: always exact, no
  data-dependent check can fail.
- MXFP4: ``code · 2^e`` with E8M0 exponents ``e``; units are ``2^(e_min(row) − 1)`` (the row's
  smallest nonzero block exponent), integers ``2·code · 2^(e − e_min) < 2^(4 + span)``. Rows whose
  exponent span breaks the bound take the Python-integer path.

**Rounding of the FP4 GEMM** (:func:`exact_fp4_gemm`, MoEResQ's ``Q̃(x)·Q(W)ᵀ`` with
``Q̃(x) = Q(x) + Q(x − Q(x))``): with ``S1``, ``S2`` the exact sums of the two terms, ``g1``,
``g2`` their global-scale products (``S_dec,x · S_dec,W``, exact in float64),

    y = fl_out( fl64( fl64(v1·g1) + fl64(v2·g2) ) + b )        v_i = fl64(S_i) · 2^(unit)

every step an IEEE float64 operation on exact inputs, then one rounding to the output dtype. So
``|y − y*| ≤ ½ ulp_out(y) + 4·2^-53·(|S1·g1| + |S2·g2| + |b|)`` with ``y*`` the exact real value
(tested against ``fractions`` in ``tests/unit/test_fp4_exact_gemm.py``). The default fp32 path
rounds each dequantized operand (``code·s_blk·S_dec``) and every partial sum instead.

**Non-FP4 rows** (:func:`exact_linear`, the batch-invariant ``F.linear``): each row of ``x`` and
``W`` is rounded once to 24-bit fixed point relative to its own largest element
(``round(x · 2^-(E − 24))``, ``E`` = the exponent of the row's max: an absolute error ≤
``2^-25 · 2^E ≤ u_fp32 · max|x_row|`` per element, the size of one fp32 rounding of the largest
element), split into two 12-bit limbs, and multiplied by three exact float64 GEMMs
(``hi·hi``: terms ≤ 2^24, ``[hi, lo]·[lo, hi]``: ≤ 2^23, ``lo·lo``: ≤ 2^22; exact for K < 2^28);
the limb results are combined by fixed elementwise float64 operations. Deterministic per row, and
more accurate than an fp32 GEMM (float64 combination of the exactly formed sums).
"""
from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from megatron_fp4.fp4.mxfp4 import mxfp4_core
from megatron_fp4.fp4.formats import pow2_fp32
from megatron_fp4.fp4.nvfp4 import nvfp4_core

CHUNK = 1024  # K terms per float64 GEMM: the NVFP4 bound 1024 · 2752512² < 2^53 holds with this
_TWO53 = 2.0 ** 53
NVFP4_UNIT_EXP = -10  # E2M1 (multiples of 1/2) × E4M3 (multiples of 2^-9)


_WEIGHT_CACHE = contextvars.ContextVar("megatron_fp4_weight_cache", default=None)


@contextmanager
def cached_weights(store: Optional[dict] = None):
    """Inside the block, GEMMs reuse what they derive from a weight alone (``Q(W)``, its
    exact-GEMM split, :func:`exact_linear`'s fixed-point limbs) across calls: the same bits, computed
    once instead of at every decode step. Entries are keyed by the weight's memory and guarded by
    its version counter (``tensor._version``, bumped by every in-place op on it or its base), and
    dropped when the block ends. Writes through ``.data`` do not bump the counter, so hold the block
    only where weights cannot change that way (the rollout engine: one ``generate`` call, under its
    weights lock). ``store``: a dict of the caller's that keeps the entries across blocks (the
    caller clears it whenever it writes the weights by other means, e.g. the vLLM plugin on load)."""
    token = _WEIGHT_CACHE.set({} if store is None else store)
    try:
        yield
    finally:
        _WEIGHT_CACHE.reset(token)


def cached_for_weight(weight: torch.Tensor, tag, compute):
    """``compute()``, a function of ``weight``'s values and ``tag`` alone (no graph through it),
    reused inside :func:`cached_weights`."""
    cache = _WEIGHT_CACHE.get()
    if cache is None:
        return compute()
    key = (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, weight.device, tag)
    hit = cache.get(key)
    if hit is not None and hit[1] == weight._version:
        return hit[2]
    value = compute()
    cache[key] = (weight, weight._version, value)  # holding `weight` keeps its memory from being reused
    return value


@dataclass
class Split:
    """``value[r, k] = ints[r, k] · 2^exp[r] · (scale[r] if scale is not None else 1)``."""

    ints: torch.Tensor  # (rows, K) float64, integer-valued
    exp: torch.Tensor  # (rows,) int64
    scale: Optional[torch.Tensor]  # (rows,) fp32 global decode scale, or None
    deq: torch.Tensor  # (rows, K) fp32: the dequantized operand (same bits as fake_quantize)
    _amax: Optional[torch.Tensor] = field(default=None, repr=False)  # memo of :meth:`abs_max`

    def abs_max(self) -> torch.Tensor:
        """max |ints| over the whole split (memoized: a cached weight split computes it once)."""
        if self._amax is None:
            self._amax = self.ints.abs().amax()
        return self._amax

    @property
    def max_int(self) -> torch.Tensor:
        return self.ints.abs().amax(-1) if self.ints.shape[-1] else self.ints.new_zeros(self.ints.shape[0])


def pow2_f64(e: torch.Tensor) -> torch.Tensor:
    """2^e as float64 for integer ``e`` in [−1022, 1023], from the bit pattern (exact)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def split_fp4(x: torch.Tensor, fmt, generator=None, name: str = "x", nonfinite=None) -> Split:
    """Quantize 2-D ``x`` (rows, K) in ``fmt`` (an ``OperandFormat``) into a :class:`Split`.

    The codes and scales are the ones ``fake_quantize`` produces (same core, same generator use),
    and ``deq`` has its bits."""
    rows, k = x.shape
    if fmt.format == "nvfp4":
        q, _, s_blk32, s_dec = nvfp4_core(x, fmt.scale, fmt.block, fmt.rounding, generator, name, nonfinite)
        mant = q.mul_(s_blk32)  # code · s_blk: exact in fp32 (2 × 4 significant bits)
        deq = (mant * s_dec).reshape(rows, k)  # (code · s_blk) · S_dec, the fake-quant bits
        ints = mant.reshape(rows, k).double().mul_(2.0 ** -NVFP4_UNIT_EXP)
        exp = torch.full((rows,), NVFP4_UNIT_EXP, dtype=torch.int64, device=x.device)
        scale = s_dec.reshape(-1).expand(rows) if s_dec.numel() == 1 else s_dec.reshape(rows)
        return Split(ints, exp, scale, deq)
    q, e = mxfp4_core(x, fmt.mx_scale_mode, fmt.rounding, generator, name, nonfinite)
    deq = (q * pow2_fp32(e)).reshape(rows, k)
    nonzero = (q != 0).any(-1, keepdim=True)
    e_min = torch.where(nonzero, e, torch.full_like(e, 1 << 20)).amin(dim=(1, 2))
    e_min = torch.where(e_min == 1 << 20, torch.zeros_like(e_min), e_min)  # all-zero row
    shift = torch.where(nonzero, e - e_min[:, None, None], torch.zeros_like(e))
    ints = (q.double() * 2.0).mul_(pow2_f64(shift)).reshape(rows, k)
    return Split(ints, (e_min - 1).to(torch.int64), None, deq)


def _python_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact ``fl64(a · bᵀ)`` for integer-valued float64 rows, in Python integers (the fallback)."""
    A = [[int(v) for v in row] for row in a.tolist()]
    B = [[int(v) for v in row] for row in b.tolist()]
    out = [[float(sum(x * y for x, y in zip(ra, rb))) for rb in B] for ra in A]  # int→float: RNE
    return torch.tensor(out, dtype=torch.float64, device=a.device).reshape(a.shape[0], b.shape[0])


def exact_sum_products(a: torch.Tensor, b: torch.Tensor, chunk: int = CHUNK,
                       b_amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``fl64(a · bᵀ)`` for integer-valued float64 ``a`` (M, K), ``b`` (N, K), exactly (module doc).
    ``b_amax``: ``b.abs().amax()`` if already known."""
    M, K = a.shape
    c = max(1, min(chunk, K))
    assert -(-K // c) <= 1024, "exact_sum_products: K/chunk > 1024 chunks could overflow int64"
    if K == 0:
        return a.new_zeros(M, b.shape[0])
    b_amax = b.abs().amax() if b_amax is None else b_amax
    ok = ~(a.abs().amax(-1) * b_amax * c > _TWO53)  # NaN rows stay on the GEMM path (NaN out)
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
                finite = finite + part * 0.0  # NaN where a chunk is not finite (int64 cannot say so)
                total += torch.nan_to_num(part).to(torch.int64)
            res = total.to(torch.float64) + finite
        out[rows] = res
    bad = (~ok).nonzero().squeeze(-1)
    if bad.numel():
        out[bad] = _python_rows(a[bad], b)
    return out


def exact_dot(a: Split, b: Split, chunk: int = CHUNK) -> torch.Tensor:
    """``fl64(S) · 2^(a.exp + b.exp)`` (M, N) float64, ``S = a.ints · b.intsᵀ`` exactly."""
    s = exact_sum_products(a.ints, b.ints, chunk, b.abs_max() if b.ints.numel() else None)
    return s * pow2_f64(a.exp[:, None] + b.exp[None, :])


def _scale_product(a: Split, b: Split) -> Optional[torch.Tensor]:
    """(M, N) float64 ``scale_a · scale_b`` (exact: two fp32 values), None when neither has one."""
    if a.scale is None and b.scale is None:
        return None
    sa = a.scale.double() if a.scale is not None else a.ints.new_ones(a.ints.shape[0])
    sb = b.scale.double() if b.scale is not None else b.ints.new_ones(b.ints.shape[0])
    return sa[:, None] * sb[None, :]


def exact_fp4_gemm(x_terms: Sequence[Split], w: Split, bias: Optional[torch.Tensor], out_dtype: torch.dtype,
                   chunk: int = CHUNK) -> torch.Tensor:
    """``Σ_i x_terms[i] · wᵀ (+ bias)`` with the rounding of the module docstring; (M, N) in ``out_dtype``."""
    acc = None
    for t in x_terms:
        v = exact_dot(t, w, chunk)
        g = _scale_product(t, w)
        if g is not None:
            v = v * g
        acc = v if acc is None else acc + v
    if bias is not None:
        acc = acc + bias.double()
    return acc.to(out_dtype)


def _fixed_point_limbs(x: torch.Tensor):
    """Rows of ``x`` (rows, K) as 24-bit fixed point ``X · 2^exp`` (one RNE rounding per element),
    split into limbs ``X = hi · 2^12 + lo`` with |hi| ≤ 2^12, |lo| ≤ 2^11. Returns (hi, lo, exp)."""
    xd = x.double()
    amax = xd.abs().amax(-1) if x.shape[-1] else xd.new_zeros(x.shape[0])
    _, e = torch.frexp(torch.nan_to_num(amax, nan=0.0, posinf=0.0))  # amax < 2^e
    exp = e.to(torch.int64) - 24  # ≥ −173 for fp32 input: unit sums stay in float64's range
    xi = torch.round(xd * pow2_f64(-exp)[:, None])  # |xi| ≤ 2^24 (NaN/Inf pass through)
    hi = torch.round(xi * 2.0 ** -12)
    lo = xi - hi * 2.0 ** 12
    return hi, lo, exp


def _weight_limbs(weight: torch.Tensor):
    hi, lo, exp = _fixed_point_limbs(weight)
    return hi, lo, exp, torch.cat([lo, hi], 1)


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Batch-invariant ``F.linear`` (module docstring, "Non-FP4 rows"): (…, K) → (…, N) in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    xh, xl, xe = _fixed_point_limbs(x2)
    wh, wl, we, w_cross = cached_for_weight(weight, "fixed-point limbs", lambda: _weight_limbs(weight))
    hh = xh @ wh.t()
    cross = torch.cat([xh, xl], 1) @ w_cross.t()
    ll = xl @ wl.t()
    s = (hh * 2.0 ** 24 + cross * 2.0 ** 12) + ll
    y = s * pow2_f64(xe[:, None] + we[None, :])
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
