"""The portable ResQ quantizer: ``Q(x)`` and ``Q(x) + Q(x − Q(x))`` on the reference quantizers.

The reference the Triton kernels (``triton_fp4.py``) are checked against, and what
``moeresq.resq_quantize`` runs where they do not serve. It imports no accelerator: moeresq.py picks
between the two, triton_fp4.py imports this module for its check (no import circle).
"""
from __future__ import annotations

import functools
import math
from contextlib import ExitStack

import torch

from megatron_fp4.fp4 import fused, fused_resq  # the compiled paths (the caller's `kernels`)
from megatron_fp4.fp4.mxfp4 import fake_quantize_mxfp4
from megatron_fp4.fp4.nvfp4 import fake_quantize_nvfp4
from megatron_fp4.fp4.recipe import OperandFormat


def _no_autocast(fn):
    """Run a numeric step with autocast off: the simulation fixes its own dtypes (fp32 / fp64
    GEMMs, see ``moeresq.py``), which torch.autocast would silently lower to bf16."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with ExitStack() as stack:
            for dev in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
                stack.enter_context(torch.autocast(dev, enabled=False))
            return fn(*args, **kwargs)
    return run


def _fq32(x, fmt: OperandFormat, generator=None, name: str = "x", nonfinite=None, compile=None,
          amax_reduce=None, kernels=None) -> torch.Tensor:
    """``amax_reduce``: NVFP4's global amax reduced over a tensor-parallel cut (MXFP4 has none);
    ``kernels``: the caller's compiled kernels (``Numerics.kernels``; None: the process's, ``fused.PROCESS``)."""
    kernels = fused.PROCESS if kernels is None else kernels
    if fmt.format == "nvfp4":
        return fake_quantize_nvfp4(x, scale=fmt.scale, block=fmt.block, rounding=fmt.rounding, generator=generator,
                                   name=name, dtype=torch.float32, nonfinite=nonfinite, compile=compile,
                                   amax_reduce=amax_reduce, kernels=kernels)
    return fake_quantize_mxfp4(x, scale_mode=fmt.mx_scale_mode, rounding=fmt.rounding, generator=generator,
                               name=name, dtype=torch.float32, nonfinite=nonfinite, compile=compile, kernels=kernels)


def fake_quantize(x: torch.Tensor, fmt: OperandFormat, generator=None, name: str = "x",
                  compile: str | None = None) -> torch.Tensor:
    """Quantize-dequantize ``x`` in ``fmt``; returns ``x.dtype`` (``compile``: see ``Recipe.compile``)."""
    return _fq32(x, fmt, generator, name, compile=compile).to(x.dtype)


def portable_resq_quantize(x: torch.Tensor, fmt: OperandFormat, compensated: bool = True, generator=None,
                           name: str = "x", nonfinite=None, compile: str | None = None,
                           scratch: bool = False, amax_reduce=None, kernels=None) -> torch.Tensor:
    """``Q(x) + Q(x − Q(x))`` (or ``Q(x)`` when not compensated) in fp32, on the portable quantizers.

    ``scratch``: the caller hands over ``x`` (a buffer of its own, unused afterwards), which may then
    hold the residual: a fresh tensor of this size costs about a pass of its own (page faults).
    ``amax_reduce``: a tensor-parallel slice's global amax reduction (``tensor_cut.py``), applied to
    ``x`` and to its residual, each of which spans the cut."""
    if compensated and amax_reduce is None and fmt.format == "nvfp4" and fmt.block == "1d" \
            and fused.use_fused(x, fmt.rounding, compile, kernels):  # one compiled call (fused_resq.py)
        out = fused_resq.resq_nvfp4_fused(x, fmt.scale, name, nonfinite, compile, kernels)
        if out is not None:
            return out
    xf = x.to(torch.float32)
    q = _fq32(xf, fmt, generator, name, nonfinite, compile, amax_reduce, kernels)
    if not compensated:
        return q
    if q.requires_grad or xf.requires_grad:  # in-place ops below would break autograd's saved tensors
        return q + _fq32(xf - q, fmt, generator, name + " residual", nonfinite, compile, amax_reduce, kernels)
    reuse = (xf is not x or scratch) and xf.is_contiguous()
    r = torch.sub(xf, q, out=xf) if reuse else xf - q
    return q.add_(_fq32(r, fmt, generator, name + " residual", nonfinite, compile, amax_reduce, kernels))


def sqnr_db(x: torch.Tensor, fmt: OperandFormat) -> float:
    """Signal-to-quantization-noise ratio of ``fake_quantize(x, fmt)`` in dB (float64 sums)."""
    xd = x.to(torch.float64)
    noise = (fake_quantize(x, fmt).to(torch.float64) - xd).pow(2).sum().item()
    signal = xd.pow(2).sum().item()
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise)
