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
  data-dependent check can fail, so none is made (``Split.bound``), and since every row's unit is
  ``2^-10`` the scaling by ``2^(exp_x + exp_w)`` is a Python float (``Split.unit``). An exact sum is
  the same whatever GEMM forms it, so the terms of ``Q̃(x)`` share one GEMM per weight.
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
element), split into two 12-bit limbs, and multiplied by exact float64 GEMMs
(``hi·hi``: terms ≤ 2^24, ``lo·lo``: ≤ 2^22, ``(hi+lo)·(hi+lo)``: ≤ 6144², from which the cross
term ``hi·lo + lo·hi`` is an exact difference; exact for K < 2^27); the limb results are combined
by fixed elementwise float64 operations. Deterministic per row, and more accurate than an fp32
GEMM (float64 combination of the exactly formed sums).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from megatron_fp4.fp4.mxfp4 import mxfp4_core
from megatron_fp4.fp4.formats import pow2_fp32
from megatron_fp4.fp4.nvfp4 import nvfp4_core

CHUNK = 1024  # K terms per float64 GEMM: the NVFP4 bound 1024 · 2752512² < 2^53 holds with this
_TWO53 = 2.0 ** 53
NVFP4_UNIT_EXP = -10  # E2M1 (multiples of 1/2) × E4M3 (multiples of 2^-9)
NVFP4_INT_MAX = 6 * 448 * 2 ** -NVFP4_UNIT_EXP  # |code · s_blk| ≤ 6 · 448 = 2752512 units of 2^-10
_NVFP4_EXP = torch.full((1,), NVFP4_UNIT_EXP, dtype=torch.int64)  # every NVFP4 row's exp (expanded, never written)


def cached_for_weight(cache: Optional[dict], weight: torch.Tensor, tag, compute):
    """``compute()``, a function of ``weight``'s values and ``tag`` alone (no graph through it),
    reused through ``cache`` (``Numerics.weight_cache``: a dict, or None for no reuse).

    Entries are keyed by the weight's memory and guarded by its version counter (``tensor._version``,
    bumped by every in-place op on it or its base): the same bits, computed once instead of at
    every decode step. Writes through ``.data`` do not bump the counter, so keep a cache only where
    weights cannot change that way (the rollout engine: its ``generate`` calls, under its weights
    lock; ``load_weights`` copies in place and empties the store; the vLLM plugin clears its store
    on every weight load)."""
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
    # known by construction (NVFP4), None: read from the data. `bound`: max |ints| can reach;
    # `unit`: every row's exp (so 2^exp is a Python float, no tensor op)
    bound: Optional[float] = None
    unit: Optional[int] = None
    _amax: Optional[torch.Tensor] = field(default=None, repr=False)  # memo of :meth:`abs_max`
    _scale64: Optional[torch.Tensor] = field(default=None, repr=False)  # memo of :meth:`scale_f64`

    def rows(self, start: int, stop: int) -> "Split":
        """Rows [start, stop) (a split's rows are independent)."""
        return Split(self.ints[start:stop], self.exp[start:stop],
                     None if self.scale is None else self.scale[start:stop], self.deq[start:stop],
                     self.bound, self.unit)

    def abs_max(self) -> torch.Tensor:
        """max |ints| over the whole split (memoized: a cached weight split computes it once)."""
        if self._amax is None:
            self._amax = self.ints.abs().amax()
        return self._amax

    def scale_f64(self) -> Optional[torch.Tensor]:
        """``scale`` as float64 (exact; memoized, so a cached weight split converts it once). A
        per-tensor scale (one value expanded over the rows) stays a stride-0 expansion."""
        if self.scale is not None and self._scale64 is None:
            one = self.scale.dim() == 1 and self.scale.shape[0] > 0 and self.scale.stride(0) == 0
            self._scale64 = self.scale[:1].double().expand(self.scale.shape) if one else self.scale.double()
        return self._scale64

    @property
    def max_int(self) -> torch.Tensor:
        return self.ints.abs().amax(-1) if self.ints.shape[-1] else self.ints.new_zeros(self.ints.shape[0])


def pow2_f64(e: torch.Tensor) -> torch.Tensor:
    """2^e as float64 for integer ``e`` in [−1022, 1023], from the bit pattern (exact)."""
    return ((e.to(torch.int64) + 1023) * (1 << 52)).view(torch.float64)  # the shift as an exact int64 product


def split_fp4(x: torch.Tensor, fmt, generator=None, name: str = "x", nonfinite=None) -> Split:
    """Quantize 2-D ``x`` (rows, K) in ``fmt`` (an ``OperandFormat``) into a :class:`Split`.

    The codes and scales are the ones ``fake_quantize`` produces (same core, same generator use),
    and ``deq`` has its bits."""
    rows, k = x.shape
    if fmt.format == "nvfp4":
        q, _, s_blk32, s_dec = nvfp4_core(x, fmt.scale, fmt.block, fmt.rounding, generator, name, nonfinite)
        mant = q.mul_(s_blk32)  # code · s_blk: exact in fp32 (2 × 4 significant bits)
        deq = (mant * s_dec).reshape(rows, k)  # (code · s_blk) · S_dec, the fake-quant bits
        # ints = mant · 2^10, exact in fp32 (|mant| ≤ 2688, a multiple of 2^-10), written as float64
        ints = torch.mul((mant.detach() if mant.requires_grad else mant).reshape(rows, k), 2.0 ** -NVFP4_UNIT_EXP,
                         out=torch.empty(rows, k, dtype=torch.float64, device=x.device))
        exp = _NVFP4_EXP.expand(rows) if x.device.type == "cpu" else torch.full(
            (rows,), NVFP4_UNIT_EXP, dtype=torch.int64, device=x.device)
        scale = s_dec.reshape(-1).expand(rows) if s_dec.numel() == 1 else s_dec.reshape(rows)
        return Split(ints, exp, scale, deq, float(NVFP4_INT_MAX), NVFP4_UNIT_EXP)
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


def _chunked_products(a: torch.Tensor, b: torch.Tensor, c: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a · bᵀ`` by float64 GEMMs of ``c`` K-terms, chunk results summed in int64 (exact when every
    chunk's partial sums are integers ≤ 2^53; NaN where a chunk is not finite)."""
    K = a.shape[1]
    if K <= c:
        return torch.mm(a, b.t(), out=out)
    total = torch.zeros(a.shape[0], b.shape[0], dtype=torch.int64, device=a.device)
    finite = a.new_zeros(a.shape[0], b.shape[0])
    for k0 in range(0, K, c):
        part = a[:, k0:k0 + c] @ b[:, k0:k0 + c].t()
        finite = finite + part * 0.0  # NaN where a chunk is not finite (int64 cannot say so)
        total += torch.nan_to_num(part).to(torch.int64)
    res = total.to(torch.float64) + finite
    return res if out is None else out.copy_(res)


def exact_sum_products(a: torch.Tensor, b: torch.Tensor, chunk: int = CHUNK,
                       b_amax: Optional[torch.Tensor] = None, bound: Optional[float] = None,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``fl64(a · bᵀ)`` for integer-valued float64 ``a`` (M, K), ``b`` (N, K), exactly (module doc).
    ``b_amax``: ``b.abs().amax()`` if already known. ``bound``: a bound on ``max|a| · max|b|`` that
    holds by construction (two NVFP4 splits: ``NVFP4_INT_MAX²``); where ``c · bound ≤ 2^53`` every
    row passes the check, so none is made. ``out``: an (M, N) float64 buffer to write into."""
    M, K = a.shape
    c = max(1, min(chunk, K))
    assert -(-K // c) <= 1024, "exact_sum_products: K/chunk > 1024 chunks could overflow int64"
    if K == 0:
        return a.new_zeros(M, b.shape[0]) if out is None else out.zero_()
    if bound is not None and bound * c <= _TWO53:
        return _chunked_products(a, b, c, out)
    b_amax = b.abs().amax() if b_amax is None else b_amax
    ok = ~(a.abs().amax(-1) * b_amax * c > _TWO53)  # NaN rows stay on the GEMM path (NaN out)
    res = a.new_zeros(M, b.shape[0]) if out is None else out.zero_()
    rows = ok.nonzero().squeeze(-1)
    if rows.numel():
        res[rows] = _chunked_products(a[rows] if rows.numel() < M else a, b, c)
    bad = (~ok).nonzero().squeeze(-1)
    if bad.numel():
        res[bad] = _python_rows(a[bad], b)
    return res


def pair_bound(a: "Split", b: "Split") -> Optional[float]:
    """``a.bound · b.bound`` (None unless both are known by construction)."""
    return None if a.bound is None or b.bound is None else a.bound * b.bound


def term_sums(x_terms: Sequence["Split"], w: "Split", chunk: int = CHUNK, out: Optional[torch.Tensor] = None):
    """The exact sums ``x_terms[i].ints · w.intsᵀ`` (each (M, N) float64), all terms' rows in one GEMM
    (rows are independent: each sum is exact whatever the GEMM's shape). ``out``: a (M, T, N) float64
    buffer (T terms) to write into; the returned sums are its views ``out[:, i]``."""
    ints = x_terms[0].ints if len(x_terms) == 1 else torch.stack([t.ints for t in x_terms], 1)
    bound = None
    if all(pair_bound(t, w) is not None for t in x_terms):
        bound = max(pair_bound(t, w) for t in x_terms)
    M, T = x_terms[0].ints.shape[0], len(x_terms)
    flat = exact_sum_products(ints.reshape(M * T, -1), w.ints, chunk, w.abs_max() if bound is None and w.ints.numel() else None,
                              
                              bound, None if out is None else out.view(M * T, -1))
    return list(flat.view(M, T, -1).unbind(1))


def exact_fp4_terms(x_terms: Sequence[Split], sums: Sequence[torch.Tensor], w_exp, w_scale: Optional[torch.Tensor],
                    bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    """``Σ_i fl64(S_i)·2^(exp_x + exp_w)·(scale_x·scale_w) (+ bias)`` in ``out_dtype`` (module doc):
    ``sums[i]`` = the exact ``x_terms[i].ints · w.intsᵀ`` (M, N); the weight's row exponents
    ``w_exp`` (int64 tensor, or a Python int: every row's) and float64 global scales ``w_scale``
    (None: none) broadcast against (M, N), so rows of one call may belong to different weights
    (grouped experts). Each term is ``(S · 2^e) · (scale_x · scale_w)``: the power of two as a
    Python float where both exponents are known by construction (the same IEEE product), the
    scales' product exact (two fp32 values in float64)."""
    acc = None
    for t, s in zip(x_terms, sums):
        if t.unit is not None and isinstance(w_exp, int):
            v = s * 2.0 ** (t.unit + w_exp)
        else:
            v = s * pow2_f64(t.exp[:, None] + w_exp)
        if t.scale is not None or w_scale is not None:
            if t.scale is None:
                g = w_scale
            else:
                g = t.scale_f64()[:, None]
                g = g if w_scale is None else g * w_scale
            v.mul_(g)
        acc = v if acc is None else acc.add_(v)
    if bias is not None:
        acc = acc + bias.double()
    return acc.to(out_dtype)


def _w_exp(w: Split):
    """The weight's exponents as exact_fp4_terms takes them: a Python int when known, else (1, N)."""
    return w.unit if w.unit is not None else w.exp[None, :]


def exact_fp4_gemm(x_terms: Sequence[Split], w: Split, bias: Optional[torch.Tensor], out_dtype: torch.dtype,
                   chunk: int = CHUNK) -> torch.Tensor:
    """``Σ_i x_terms[i] · wᵀ (+ bias)`` with the rounding of the module docstring; (M, N) in ``out_dtype``."""
    sums = term_sums(x_terms, w, chunk)
    return exact_fp4_terms(x_terms, sums, _w_exp(w), None if w.scale is None else w.scale_f64()[None, :],
                           bias, out_dtype)


def _fixed_point_limbs(x: torch.Tensor):
    """Rows of ``x`` (rows, K) as 24-bit fixed point ``X · 2^exp`` (one RNE rounding per element),
    split into limbs ``X = hi · 2^12 + lo`` with |hi| ≤ 2^12, |lo| ≤ 2^11. Returns ``(limbs, exp)``:
    limbs (3, rows, K) float64 = ``[hi, lo, hi + lo]`` (every value an exactly held integer)."""
    xd = x.detach().to(torch.float64, copy=True)
    # the row max of |x| (a max: exact in any order; NaN propagates), read from the narrower input
    amax = torch.linalg.vector_norm(x.detach(), float("inf"), -1).double() if x.shape[-1] else xd.new_zeros(x.shape[0])
    _, e = torch.frexp(torch.nan_to_num(amax, nan=0.0, posinf=0.0))  # amax < 2^e
    exp = e.to(torch.int64) - 24  # ≥ −173 for fp32 input: unit sums stay in float64's range
    xi = torch.round(xd.mul_(pow2_f64(-exp)[:, None]))  # |xi| ≤ 2^24 (NaN/Inf pass through)
    limbs = xd.new_empty((3, *xd.shape))
    hi = torch.round(torch.mul(xi, 2.0 ** -12, out=limbs[0]), out=limbs[0])
    torch.add(xi, hi, alpha=-(2.0 ** 12), out=limbs[1])  # xi − hi·2^12: exact (integers < 2^25)
    torch.add(hi, limbs[1], out=limbs[2])
    return limbs, exp


FEW_ROWS = 32  # up to this many rows one GEMM of all four limb products (reads the weight limbs once)


def _weight_limbs(weight: torch.Tensor):
    """(``[hi | lo]`` transposed (K, 2N) contiguous float64, 2^exp (N,) float64) of a weight."""
    limbs, exp = _fixed_point_limbs(weight)
    return torch.cat([limbs[0], limbs[1]], 0).t().contiguous(), pow2_f64(exp)


def _limb_products(xl: torch.Tensor, weight: torch.Tensor, cache: Optional[dict]):
    """(hh, ll, cross) (M, N) float64, exact, and 2^exp_w (N,): ``xl`` (3, M, K) input limbs.

    Few rows (decode): one GEMM ``[hi; lo]·[hi | lo]`` (2M, 2N) holds the four products and reads
    the weight limbs once (memory-bound). Many rows (prefill, scoring): Karatsuba, three GEMMs,
    ``cross = (hi+lo)·(hi+lo) − hh − ll`` (compute-bound), on the cached limbs or, outside
    a ``cache``, on the weight's limbs as computed (no transposed copy)."""
    M = xl.shape[1]
    if M > FEW_ROWS and cache is None:
        limbs, exp = _fixed_point_limbs(weight)
        hh, ll = xl[0] @ limbs[0].t(), xl[1] @ limbs[1].t()
        return hh, ll, (xl[2] @ limbs[2].t()).sub_(hh).sub_(ll), pow2_f64(exp)
    wl, w_scale = cached_for_weight(cache, weight, "fixed-point limbs", lambda: _weight_limbs(weight))
    N = wl.shape[1] // 2
    wh, wlo = wl[:, :N], wl[:, N:]
    if M <= FEW_ROWS:
        p = xl[:2].reshape(2 * M, -1) @ wl
        return p[:M, :N], p[M:, N:], p[:M, N:] + p[M:, :N], w_scale
    hh, ll = xl[0] @ wh, xl[1] @ wlo
    return hh, ll, (xl[2] @ (wh + wlo)).sub_(hh).sub_(ll), w_scale


def _combine(x: torch.Tensor, xe: torch.Tensor, hh, ll, cross, w_scale, bias, n_out: int) -> torch.Tensor:
    """``fl(fl(hh·2^24 + cross·2^12) + ll) · 2^exp_x · 2^exp_w (+ bias)`` in x's dtype, shaped like x."""
    s = (hh * 2.0 ** 24).add_(cross, alpha=2.0 ** 12).add_(ll)
    y = s.mul_(pow2_f64(xe)[:, None]).mul_(w_scale)
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype).reshape(*x.shape[:-1], n_out)


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 cache: Optional[dict] = None) -> torch.Tensor:
    """Batch-invariant ``F.linear`` (module docstring, "Non-FP4 rows"): (…, K) → (…, N) in x's dtype.

    The three limb products ``hh = hi_x·hi_wᵀ``, ``ll = lo_x·lo_wᵀ`` and ``cross = hi_x·lo_wᵀ +
    lo_x·hi_wᵀ`` are exact integers (:func:`_limb_products`; with many rows ``cross`` is the exact
    difference ``(hi_x + lo_x)·(hi_w + lo_w)ᵀ − hh − ll``: every term ≤ 6144², every partial sum and
    difference an integer < 2^53 for K < 2^27, so exact in any order and split), then combined as
    ``s = (hh·2^24 + cross·2^12) + ll`` and scaled by ``2^exp_x · 2^exp_w`` (powers of two, exact)."""
    K = x.shape[-1]
    assert K < 2 ** 27, "exact_linear: K ≥ 2^27 would break the exact-sum bound"
    xl, xe = _fixed_point_limbs(x.reshape(-1, K))
    hh, ll, cross, w_scale = _limb_products(xl, weight, cache)
    return _combine(x, xe, hh, ll, cross, w_scale[None, :], bias, weight.shape[0])


def exact_grouped_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], counts: Sequence[int],
                         cache: Optional[dict] = None) -> torch.Tensor:
    """Rows of ``x`` (R, K) in consecutive runs of ``counts[e]``, run e times ``weights[e]ᵀ`` (N, K):
    each row gets the bits :func:`exact_linear` gives it (its limbs and products do not depend on
    the other rows), with the input limbs and the elementwise combination done once for all runs."""
    R, K = x.shape
    assert K < 2 ** 27 and sum(counts) == R and len(counts) == len(weights)
    N = weights[0].shape[0]
    xl, xe = _fixed_point_limbs(x)
    if max(counts) <= FEW_ROWS:
        return _combine(x, xe, *_few_rows_grouped(xl, weights, counts, cache), None, N)
    parts = [x.new_empty(R, N, dtype=torch.float64) for _ in range(3)]
    w_scale = x.new_empty(R, N, dtype=torch.float64)
    start = 0
    for w, n in zip(weights, counts):
        if n:
            rows = slice(start, start + n)
            *products, ws = _limb_products(xl[:, rows], w, cache)
            for out, part in zip(parts, products):
                out[rows] = part
            w_scale[rows] = ws
            start += n
    return _combine(x, xe, *parts, w_scale, None, N)


def _few_rows_grouped(xl: torch.Tensor, weights: Sequence[torch.Tensor], counts: Sequence[int], cache):
    """:func:`_limb_products` of every run with few rows (the decode step's experts), gathered:
    the ``[hi; lo]`` rows of each run sit together so each run is one GEMM on its weight's cached
    limbs, written in place; one reordering afterwards. Returns (hh, ll, cross, 2^exp_w) (R, N)."""
    R = xl.shape[1]
    order, scales, start = [], [], 0
    for n in counts:
        order += [*range(start, start + n), *range(R + start, R + start + n)]
        start += n
    order = torch.tensor(order, dtype=torch.long, device=xl.device)
    x2 = xl[:2].reshape(2 * R, -1).index_select(0, order)
    p = None
    start = 0
    for w, n in zip(weights, counts):
        if n:
            wl, ws = cached_for_weight(cache, w, "fixed-point limbs", lambda: _weight_limbs(w))
            p = x2.new_empty(2 * R, wl.shape[1]) if p is None else p
            torch.mm(x2[2 * start:2 * (start + n)], wl, out=p[2 * start:2 * (start + n)])
            scales.append(ws.expand(n, -1))
            start += n
    q = torch.empty_like(p).index_copy_(0, order, p)
    N = p.shape[1] // 2
    return q[:R, :N], q[R:, N:], q[:R, N:] + q[R:, :N], torch.cat(scales)
