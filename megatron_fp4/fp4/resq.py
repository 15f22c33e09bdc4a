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
from megatron_fp4.fp4.formats import Sweep
from megatron_fp4.fp4.mxfp4 import fake_quantize_mxfp4, mxfp4_rows
from megatron_fp4.fp4.nvfp4 import fake_quantize_nvfp4, nvfp4_rows
from megatron_fp4.fp4.recipe import OperandFormat, row_local


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
    if compensated and _sweeps(x, fmt, compile, amax_reduce, kernels):
        out = _resq_sweep(x, fmt)
        if out is not None:
            if nonfinite is not None:  # the records of the two quantizations below, under their names
                what = "quantize_" + fmt.format
                nonfinite.record(name, what, torch.ones((), dtype=torch.bool))
                nonfinite.record(name + " residual", what, torch.ones((), dtype=torch.bool))
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


def _sweeps(x: torch.Tensor, fmt: OperandFormat, compile, amax_reduce, kernels) -> bool:
    """Whether the ResQ runs as one eager sweep (``_resq_sweep``): a row-local format (nearest
    rounding), valid CPU input with nothing to differentiate, no tensor-parallel reduction, and no
    compiled kernels to serve it: those of a ResQ of NVFP4 1-D blocks were tried first, and the
    fake-quant kernels of the two calls it replaces would not serve (under ``auto`` the two calls
    are counted towards their warm-up as before, ``fused.eager_serves``)."""
    if not (row_local(fmt) and fmt.rounding == "nearest" and amax_reduce is None and x.device.type == "cpu"
            and x.dim() and x.numel() and x.shape[-1] % fmt.block_size == 0 and x.is_floating_point()
            and x.dtype.itemsize >= 2 and not (torch.is_grad_enabled() and x.requires_grad)):
        return False
    if not fused.use_fused(x, fmt.rounding, compile, kernels):
        return True
    n = x.shape[-1]
    key = (("nvfp4", fmt.scale, fmt.block) if fmt.format == "nvfp4" else ("mxfp4", fmt.mx_scale_mode)) \
        + (torch.float32, torch.float32)  # the two calls' variant: Q(fp32 x), Q(fp32 residual)
    return fused.eager_serves(key, x, (-1, n // fmt.block_size, fmt.block_size), compile, 2, kernels)


def _resq_sweep(x: torch.Tensor, fmt: OperandFormat):
    """``Q(x) + Q(x − Q(x))`` (fp32) of a row-local format, one range of rows at a time: per range
    ``q = Q(x)`` into the output, ``r = x − q`` and ``Q(r)`` in scratch, ``q += Q(r)``: the ops of the
    two fake quantizations, the subtraction and the addition of ``portable_resq_quantize`` on each
    element, in its order (so its bits), with the residual never a full-size tensor. None when
    ``x`` or its residual holds a NaN/Inf: the two-call path then reports it and writes its bits."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    if fmt.format == "nvfp4":
        rows = nvfp4_rows
    else:
        def rows(src, dst, sw):
            return mxfp4_rows(src, dst, sw, fmt.mx_scale_mode)
    with Sweep(x2.shape[0], n, x.device) as sw:
        seen = []
        for a, b in sw.spans:
            src, q = sw.fp32(x2[a:b]), out[a:b]
            seen.append(rows(src, q, sw).max())
            r = torch.sub(src, q, out=sw.f32[0][:b - a])  # src is x's rows or already this buffer
            seen.append(rows(r, sw.f32[1][:b - a], sw).max())
            q.add_(sw.f32[1][:b - a])
        return out.view(x.shape) if sw.finite(seen) else None


def sqnr_db(x: torch.Tensor, fmt: OperandFormat) -> float:
    """Signal-to-quantization-noise ratio of ``fake_quantize(x, fmt)`` in dB (float64 sums)."""
    xd = x.to(torch.float64)
    noise = (fake_quantize(x, fmt).to(torch.float64) - xd).pow(2).sum().item()
    signal = xd.pow(2).sum().item()
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise)
