"""Triton fake-quantization on CUDA: NVFP4/MXFP4 ``Q(x)`` and the MoEResQ operand ``Q(x) + Q(x − Q(x))``.

The kernels (``triton_kernels.py``) reproduce the portable quantizers (``nvfp4.py``, ``mxfp4.py``)
bit for bit: same formats, options, stochastic-rounding draws (``torch.rand`` on the caller's
generator, the same shapes and order as the reference: ``Q(x)`` first, then its residual), error
messages and deferred non-finite flags. What they save is passes over memory: the reference runs
~15 eager ops per ``Q``; here an NVFP4 operand is two or three kernels (row amax of x, of the
residual, then the output) and an MXFP4 operand one.

Where it runs (:func:`use_triton`) is the caller's ``mode``, the model's ``Numerics.triton`` (config
``fp4.triton``; ``MEGATRON_FP4_TRITON`` overrides it while the config loads):

- ``auto`` (default): CUDA tensors when ``triton`` imports; CPU tensors take the portable path.
- ``off``: never (``Numerics(triton="off")``: fixed when the numerics are built).
- ``interpret``: CUDA and CPU tensors; CPU tensors run under Triton's interpreter (slow: tests), which
  needs ``TRITON_INTERPRET=1`` in the environment before triton is imported.

Each variant (format, options, dtypes, layout) is checked once against the portable path on its
first real input; a mismatch or a launch failure warns once and switches that variant — or, for a
failure, the whole Triton path — back to the portable code (the reference stays the definition).
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings

import torch

from megatron_fp4.fp4.formats import check_finite_flag, check_input, check_multiple
from megatron_fp4.fp4.numerics import TRITON_MODES
from megatron_fp4.fp4.recipe import OperandFormat

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# What this process learnt about the device, never a numerics choice (each variant is verified to
# give the portable path's bits before it serves): a launch failure, verified / rejected variants.
_state = {"broken": None, "verified": set(), "rejected": set(), "served": 0}


@functools.lru_cache(maxsize=None)
def triton_importable() -> tuple[bool, str]:
    """(whether ``import triton`` works, why not)."""
    try:
        import triton  # noqa: F401
    except Exception as err:  # ImportError, or a broken install raising anything
        return False, f"triton is not importable ({type(err).__name__}: {err})"
    return True, ""


def use_triton(x: torch.Tensor, mode: str = "auto") -> bool:
    """Whether the quantizer entry points hand ``x`` to the Triton kernels under ``mode`` (module docstring)."""
    if mode not in TRITON_MODES:
        raise ValueError(f"triton mode={mode!r} is not one of {TRITON_MODES}")
    if mode == "off" or _state["broken"] is not None:
        return False
    if x.device.type != "cuda" and not (mode == "interpret" and x.device.type == "cpu" and interpreting()):
        return False
    if (torch.is_grad_enabled() and x.requires_grad) or torch.compiler.is_compiling():  # not differentiable
        return False
    return triton_importable()[0]


def interpreting() -> bool:
    """Whether Triton runs kernels under its interpreter (``TRITON_INTERPRET=1`` when triton was imported)."""
    import triton
    knobs = getattr(triton, "knobs", None)  # triton < 3.4 reads the environment variable only
    return bool(knobs.runtime.interpret) if knobs is not None else os.environ.get("TRITON_INTERPRET") == "1"


def kernels():
    """The kernel module (compiled, or interpreted when :func:`interpreting`)."""
    from megatron_fp4.fp4 import triton_kernels
    return triton_kernels


def _validate(shape, dtype, fmt: OperandFormat, name: str) -> None:
    """The reference's option and input errors, in its order, for an operand of ``shape``/``dtype``."""
    meta = torch.empty(shape, dtype=dtype, device="meta")
    if fmt.format == "nvfp4":
        from megatron_fp4.fp4 import nvfp4
        nvfp4._check_options(fmt.scale, fmt.block, fmt.rounding)
        nvfp4._check_input(meta, fmt.block, name)
    else:
        from megatron_fp4.fp4 import mxfp4
        mxfp4._check_options(fmt.mx_scale_mode, fmt.rounding)
        check_multiple(meta, -1, 32, name, "quantize_mxfp4")
        check_input(meta, name)


def _draw_shape(shape, fmt: OperandFormat):
    """The shape the reference draws its uniforms in (its block layout): same numel and order."""
    n, numel = shape[-1], math.prod(shape)
    if fmt.format == "mxfp4":
        return (numel // n, n // 32, 32)
    if fmt.block == "1d":
        return (numel // n, n // 16, 16)
    m = shape[-2]
    return (numel // (m * n), m // 16, 16, n // 16, 16)


def pow2_at_least(n: int, lo: int) -> int:
    """The smallest power of two ≥ n, at least ``lo`` (a Triton block size)."""
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def quantize(x: torch.Tensor, fmt: OperandFormat, *, compensated: bool = False, generator=None, name: str = "x",
             nonfinite=None, out_dtype: torch.dtype = torch.float32, columns: bool = False) -> torch.Tensor:
    """``Q(x)`` (or ``Q(x) + Q(x − Q(x))`` when ``compensated``) in ``fmt`` by the Triton kernels.

    Same contract as the portable ``fake_quantize_nvfp4`` / ``fake_quantize_mxfp4`` (and
    ``moeresq.resq_quantize`` when compensated), including errors and SR draws. ``columns``: ``x``
    is 2-D (tokens, features) and is quantized transposed, in blocks of consecutive tokens with the
    token dim zero-padded to the block size, returning (features, padded tokens) like
    ``moeresq._col_quantize`` (read through strides: no transposing copy). CPU tensors run under
    Triton's interpreter. No dispatch checks and no fallback: :func:`dispatch` does those."""
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # launch on x's GPU
        return _quantize(x, fmt, compensated, generator, name, nonfinite, out_dtype, columns)


def _quantize(x_in, fmt, compensated, generator, name, nonfinite, out_dtype, columns):
    check_input(x_in, name)
    # fp16 / fp64 become fp32 first, as the portable path reads them (one kernel variant fewer each)
    x = x_in if x_in.dtype in (torch.float32, torch.bfloat16) else x_in.to(torch.float32)
    bs = fmt.block_size
    if columns:
        if x.dim() != 2:
            raise ValueError(f"columnwise quantization of '{name}' needs a 2-D (tokens, features) tensor, "
                             f"got shape {tuple(x.shape)}")
        n_rows, c_valid = x.shape[1], x.shape[0]
        n_cols = c_valid + (-c_valid) % bs
        sxr, sxc = x.stride(1), x.stride(0)
        shape = (n_rows, n_cols)
    else:
        shape = tuple(x.shape)
        x = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # a view when the strides allow
    _validate(shape, x.dtype, fmt, name)
    if not columns:
        n_rows, n_cols = x.shape
        c_valid, (sxr, sxc) = n_cols, x.stride()
    interpret = x.device.type == "cpu"
    if interpret and not interpreting():
        raise ValueError(f"Triton FP4 kernels on a CPU tensor ('{name}') need Triton's interpreter: set "
                         "TRITON_INTERPRET=1 before triton is imported, or use the portable quantizers")
    k = kernels()
    mx, sr = fmt.format == "mxfp4", fmt.rounding == "stochastic"
    tile_r = 16 if (not mx and fmt.block == "2d") else 1
    in_bf16 = x.dtype == torch.bfloat16
    xk = x.view(torch.int16) if in_bf16 else x
    out_bf16 = out_dtype == torch.bfloat16
    out = torch.empty(shape, dtype=torch.bfloat16 if out_bf16 else torch.float32, device=x.device)
    dev = x.device
    u1 = u2 = None
    if sr:
        u1 = torch.rand(_draw_shape(shape, fmt), generator=generator, device=dev, dtype=torch.float32)
        if compensated:
            u2 = torch.rand(_draw_shape(shape, fmt), generator=generator, device=dev, dtype=torch.float32)
    if interpret:  # few, large programs: the interpreter pays per program, not per element
        block_r, block_c = max(tile_r, min(64, pow2_at_least(n_rows, 1))), min(256, pow2_at_least(n_cols, bs))
    else:  # fixed tiles: one compiled variant per option set, whatever the shape
        block_r, block_c = 32, 128
    grid_r, grid_c = -(-n_rows // block_r), -(-n_cols // block_c)
    launch = dict(BLOCK_R=block_r, BLOCK_C=block_c, enable_fp_fusion=False)  # no FMA contraction
    what = "quantize_mxfp4" if mx else "quantize_nvfp4"
    dummy = out  # unused pointer arguments
    amax1 = amax2 = dummy
    s_amax = 1
    if not mx:
        amax1, bad1 = _row_amax(k, xk, None, None, (n_rows, n_cols, c_valid, sxr, sxc, 1), tile_r, sr, in_bf16,
                                grid_r, launch)
        if fmt.scale == "tensor":
            amax1, s_amax = amax1.amax(), 0
        check_finite_flag(x_in, torch.logical_not(bad1.any()), name, what, nonfinite)
        if compensated:
            amax2, bad2 = _row_amax(k, xk, amax1, u1, (n_rows, n_cols, c_valid, sxr, sxc, s_amax), tile_r, sr,
                                    in_bf16, grid_r, launch)
            if fmt.scale == "tensor":
                amax2 = amax2.amax()
            check_finite_flag(x_in, torch.logical_not(bad2.any()), name + " residual", what, nonfinite)
    bad = torch.zeros((grid_r, grid_c, 2), dtype=torch.int32, device=dev) if mx else dummy
    k.fake_quant_kernel[(grid_r, grid_c)](
        xk, out.view(torch.int16) if out_bf16 else out, amax1, amax2,
        dummy if u1 is None else u1, dummy if u2 is None else u2, bad,
        n_rows, n_cols, c_valid, sxr, sxc, s_amax,
        MX=mx, BS=bs, TILE_R=tile_r, SR=sr, RCEIL=mx and fmt.mx_scale_mode == "rceil", RESQ=compensated,
        CHECK=mx, IN_BF16=in_bf16, OUT_BF16=out_bf16, **launch)
    if mx:
        flags = bad.view(-1, 2).any(dim=0)
        check_finite_flag(x_in, torch.logical_not(flags[0]), name, what, nonfinite)
        if compensated:
            check_finite_flag(x_in, torch.logical_not(flags[1]), name + " residual", what, nonfinite)
    if out_dtype not in (torch.float32, torch.bfloat16):
        out = out.to(out_dtype)
    return out


def _row_amax(k, xk, amax1, u1, dims, tile_r, sr, in_bf16, grid_r, launch):
    """Per-row max |x| (``amax1`` None) or max |x − Q(x)| (NVFP4), and per-row non-finite flags."""
    n_rows = dims[0]
    out = torch.empty(n_rows, dtype=torch.float32, device=xk.device)
    bad = torch.empty(n_rows, dtype=torch.int32, device=xk.device)
    residual = amax1 is not None
    k.row_amax_kernel[(grid_r,)](xk, amax1 if residual else out, u1 if u1 is not None else out, out, bad, *dims,
                                 RESIDUAL=residual, SR=sr and residual, TILE_R=tile_r, IN_BF16=in_bf16, **launch)
    return out, bad.bool()


def dispatch(x: torch.Tensor, fmt: OperandFormat, compensated: bool, generator=None, name: str = "x",
             nonfinite=None, columns: bool = False, mode: str = "auto"):
    """The hook of the portable entry points: ``Q̃(x)`` (fp32) from the Triton kernels, or None when
    the caller should run the portable path (not wanted here, variant rejected, launch failure).

    The first input of each variant is also quantized by the portable path (same generator state)
    and must give the same bits; a variant that does not is rejected with a warning. Input errors
    (shapes, dtypes, non-finite values) raise exactly as the portable quantizers do."""
    if x.dtype not in _DTYPES or x.numel() == 0 or not use_triton(x, mode):  # empty: an expert without tokens
        return None
    key = (fmt, compensated, columns, x.dtype, x.device.type)
    if key in _state["rejected"]:
        return None
    stream = generator
    if stream is None and fmt.rounding == "stochastic":  # the draws come from the device's default generator
        stream = torch.default_generator if x.device.type == "cpu" else \
            torch.cuda.default_generators[x.device.index if x.device.index is not None else torch.cuda.current_device()]
    saved = stream.get_state() if stream is not None else None
    try:
        out = quantize(x, fmt, compensated=compensated, generator=generator, name=name, nonfinite=nonfinite,
                       columns=columns)
    except ValueError:  # the user's input (same errors as the portable path)
        raise
    except Exception as err:  # a compiler / driver failure: never again in this process
        _state["broken"] = f"{type(err).__name__}: {err}"
        _warn(f"Triton FP4 kernels disabled, using the portable quantizers ({_state['broken']})")
        if saved is not None:
            stream.set_state(saved)
        return None
    if key not in _state["verified"] and bool(torch.isfinite(x).all()):
        ref = _portable(x, fmt, compensated, _replay(stream, saved), name, columns)
        if not _same_bits(out, ref):
            _state["rejected"].add(key)
            _warn(f"Triton FP4 kernel {key[:4]} is not bit-exact with the portable quantizers on this device; "
                  "using the portable path for it")
            return ref
        _state["verified"].add(key)
    _state["served"] += 1
    return out


def served() -> int:
    """How many operands :func:`dispatch` has served from the Triton kernels in this process."""
    return _state["served"]


def _replay(generator, state):
    if generator is None:
        return None
    g = torch.Generator(device=generator.device)
    g.set_state(state)
    return g


def _portable(x, fmt, compensated, generator, name, columns):
    from megatron_fp4.fp4.resq import portable_resq_quantize  # the reference (loads the quantizers)

    if columns:
        pad = (-x.shape[0]) % fmt.block_size
        x = torch.nn.functional.pad(x.t(), (0, pad)).contiguous()
    return portable_resq_quantize(x, fmt, compensated, generator, name)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.int32),
                                                                     b.contiguous().view(torch.int32))


def _warn(msg: str) -> None:
    warnings.warn("megatron_fp4: " + msg, RuntimeWarning, stacklevel=3)
