"""Portable comparison rules for the numeric tests (why each tolerance holds on every CPU).

Machines differ in their kernels: MKL takes other GEMM paths on AMD than on Intel, ATen picks its
vector unit at run time (``ATEN_CPU_CAPABILITY``), and the number of intra-op threads changes how
reductions are split. A tolerance measured on one machine encodes that machine. The rules here are
derived from rounding-error bounds instead:

- **float64 runs** (``Config.dtype = "fp64"``): every reduction-order or kernel difference is a
  relative ~1e-16 effect per op (unit roundoff 2^-53 ≈ 1.1e-16, times sums of at most ~10^3 terms
  and a few dozen ops in series, i.e. ≲ 1e-12 on gradients). AdamW's update g/(√v+ε) passes an
  absolute gradient error δ on as at most lr·δ/ε per element (at |g| ≈ 0), i.e. lr·1e-11; after a few
  steps parameters and losses agree to ≲ 1e-12 relative. ``FP64_REL`` = 1e-10 leaves a 100× margin
  and still catches any real bug (a wrong micro-batch, a missed reduction: ≥ 1e-4).
  FP4 operands are quantized from fp32 (as the formats define), so a ~1e-16 difference in the fp64
  input changes the fp32 value only if it straddles an fp32 rounding boundary (probability ~2e-9 per
  element) and then an FP4 code only if that ulp straddles an FP4 boundary (~1e-6): FP4 layouts meet
  the same bound except with negligible probability.
- **fp32 sums in another order**: the single process accumulates micro-batch gradients
  g = ((g0+g1)+g2)+g3 while dp adds (g0+g1)+(g2+g3). Each g_i is computed by the same kernels on the
  same shapes, so only the order of the n-term sum differs, and both results lie within
  γ_{n−1}·Σ|g_i| of the exact sum (γ_k = k·u/(1−k·u), u = 2^-24), elementwise: they differ by at most
  ``sum_order_bound``.
- **bitwise** only where it holds by construction: the same kernels on the same shapes, memory
  layout and thread count. Reference runs that are compared bitwise with a distributed child (one
  intra-op thread) run with one thread too (``single_thread``): ATen splits reductions by thread.
"""
from __future__ import annotations

import contextlib

import torch

FP64_REL = 1e-10


def rel(a, b) -> float:
    """Relative Frobenius error ‖a − b‖ / ‖b‖, computed in float64."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def gamma(k: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's γ_k = k·u / (1 − k·u): the relative error bound of a k-operation recursive sum."""
    u = torch.finfo(dtype).eps / 2
    return k * u / (1 - k * u)


def sum_order_bound(abs_terms_sum: torch.Tensor, num_terms: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Elementwise bound on |Σ_a − Σ_b| for two summation orders of the same ``num_terms`` terms,
    given Σ|terms| (each order is within γ_{n−1}·Σ|terms| of the exact sum)."""
    return 2 * gamma(max(num_terms - 1, 1), dtype) * abs_terms_sum.to(torch.float64)


@contextlib.contextmanager
def single_thread():
    """Run the block with one intra-op thread (what every distributed test child uses)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def log_softmax_bound(max_abs: float, num: int, dtype: torch.dtype = torch.float32) -> float:
    """Bound on |log_softmax(x)_i − exact| for one evaluation in `dtype` of a row of `num` entries
    with max|x| = M (`max_abs`), u the unit roundoff. The shift x_i − max is off by ≤ 2uM; that
    error enters each exp as a relative 2uM, exp itself rounds within 2u (libm / SLEEF: 1 ulp),
    and the positive sum s ∈ [1, n] adds γ_{n−1} relative; log s is then off by that relative error
    (an absolute error) plus u·log n of rounding; the final subtraction adds the shift's 2uM and
    u·(2M + log n). In all u·(6M + 2·log n + 2) + γ_{n−1}; doubled for margin. An input rounding of
    δ per entry moves every output by at most 2δ more (log-softmax is 2-Lipschitz in max-norm)."""
    import math
    u = torch.finfo(dtype).eps / 2
    return 2 * (u * (6 * max_abs + 2 * math.log(num) + 2) + gamma(max(num - 1, 1), dtype))
