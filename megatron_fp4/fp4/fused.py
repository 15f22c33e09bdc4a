"""Optional ``torch.compile``d fake-quantization: the NVFP4/MXFP4 quantize-dequantize in one fused pass.

The eager path (``nvfp4.py``, ``mxfp4.py``) is the reference: a dozen elementwise passes over the
tensor. Here the same arithmetic, written once more as one traced function, is compiled by inductor
into a kernel that reads the input twice (block amaxes, then the elements) and writes the output
once. It is used by ``fake_quantize_nvfp4`` / ``fake_quantize_mxfp4`` (nearest rounding only;
stochastic rounding and ``quantize_*`` stay eager) when

- switched on: ``MEGATRON_FP4_COMPILE=1`` in the environment, or :func:`set_fp4_compile` (True),
- the tensor lives on the CPU (inductor's C++ backend is the one whose bits are tested against the
  eager path; on other devices the eager path runs),
- autograd is not recording through the input (fake-quant inside MoEResQ runs under no-grad).

It is off by default: the first call of each variant (format, scale mode, block shape, dtypes)
compiles for seconds, which training amortizes and short jobs or test suites do not.

Bit-exactness notes (each pinned by ``tests/unit/test_fp4_fused.py`` against the eager path):

- Divisions by constants are written with a tensor operand: inductor turns ``c / t`` into
  ``c * (1 / t)`` and ``t / c`` into ``t * (1 / c)``, each a second rounding.
- The E2M1 grid step is chosen by compares (``round_e2m1_select``): inductor lowers a float↔int32
  bit view to a scalar loop, compares vectorize.
- The compiled C++ keeps IEEE semantics that matter here (``-ffp-contract=off``, no unsafe math);
  reductions are maxima, exact in any order.

Compilation uses ``dynamic=True`` so the varying token counts of MoE experts reuse one kernel. If
compilation fails (no C++ compiler, an inductor error), a warning is issued once and the eager
path is used from then on.
"""
from __future__ import annotations

import os
import types
import warnings

import torch

_ENV = "MEGATRON_FP4_COMPILE"
_state = {"enabled": os.environ.get(_ENV, "0").strip().lower() in ("1", "true", "yes", "on"), "broken": None}
_compiled: dict = {}


def set_fp4_compile(enabled: bool) -> None:
    """Switch the compiled fake-quant path on or off for this process (overrides the env var)."""
    _state["enabled"] = bool(enabled)


def fp4_compile_enabled() -> bool:
    """Whether fake-quant calls try the compiled path (switched on and not disabled by a failure)."""
    return _state["enabled"] and _state["broken"] is None


def use_fused(x: torch.Tensor, rounding: str) -> bool:
    return (fp4_compile_enabled() and rounding == "nearest" and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and x.requires_grad) and not torch.compiler.is_compiling())


def _nvfp4_body(xb: torch.Tensor, scale: str, two_d: bool, out_dtype: torch.dtype):
    from megatron_fp4.fp4.e2m1 import round_e2m1_select
    from megatron_fp4.fp4.nvfp4 import nvfp4_scales

    xf = xb.to(torch.float32)
    block_amax = xf.abs().amax(dim=(2, 4) if two_d else (-1,), keepdim=True)
    amax, _, s_blk32, s_dec, enc_blk = nvfp4_scales(block_amax, scale)
    y = (xf * enc_blk).clamp(-6.0, 6.0)
    out = round_e2m1_select(y) * s_blk32 * s_dec  # (code · s_blk) · S_dec, left to right
    return out.to(out_dtype), torch.isfinite(amax).all()


def _mxfp4_body(xb: torch.Tensor, scale_mode: str, out_dtype: torch.dtype):
    from megatron_fp4.fp4.e2m1 import round_e2m1_select
    from megatron_fp4.fp4.formats import pow2_fp32
    from megatron_fp4.fp4.mxfp4 import shared_exponent

    xf = xb.to(torch.float32)
    block_amax = xf.abs().amax(dim=-1, keepdim=True)
    e = shared_exponent(block_amax, scale_mode)
    y = (xf * pow2_fp32(-e)).clamp(-6.0, 6.0)
    out = round_e2m1_select(y) * pow2_fp32(e)
    return out.to(out_dtype), torch.isfinite(block_amax.amax())


def _get(key, body):
    fn = _compiled.get(key)
    if fn is None:
        # One code object per variant (format, options, dtypes): dynamo keeps its cache of compiled
        # graphs on the code object, and all variants in one cache would pass its recompile limit.
        tag = "_".join(str(k).replace("torch.", "") for k in key)
        code = body.__code__.replace(co_name=f"{body.__name__}_{tag}", co_qualname=f"{body.__name__}_{tag}")
        fresh = types.FunctionType(code, body.__globals__, code.co_name, body.__defaults__, body.__closure__)
        fn = _compiled[key] = torch.compile(fresh, dynamic=True)
    return fn


def _run(key, body, args):
    """The compiled result, or None when compilation failed (then the caller runs eager)."""
    try:
        return _get(key, body)(*args)
    except Exception as err:  # a backend failure, never an input error: inputs are validated first
        _state["broken"] = f"{type(err).__name__}: {err}"
        warnings.warn(f"megatron_fp4: compiled FP4 fake-quant disabled, using the eager path ({_state['broken']})",
                      RuntimeWarning, stacklevel=3)
        return None


def _blocked(x: torch.Tensor, shape, static_dims) -> torch.Tensor:
    """Contiguous block-layout alias (or copy) of ``x`` for the compiled function, guarded lightly:

    - not a view (``detach``): dynamo guards a view input on its base's sizes and strides;
    - contiguous: one stride pattern, one kernel (eager copies non-contiguous input too);
    - the element dims (16/32) static: else "duck sizing" ties a block count that happens to be
      16 to them, and the next shape recompiles.
    """
    xb = x.reshape(shape)
    if not xb.is_contiguous():
        xb = xb.contiguous()
    xb = xb.detach()
    for d in static_dims:
        torch._dynamo.mark_static(xb, d)
    return xb


def fake_quantize_nvfp4_fused(x: torch.Tensor, scale: str, block: str, out_dtype: torch.dtype):
    """Compiled ``fake_quantize_nvfp4`` of a validated ``x``: (output, all-finite flag) or None."""
    n = x.shape[-1]
    if block == "1d":
        xb = _blocked(x, (-1, n // 16, 16), (2,))
    else:
        m = x.shape[-2]
        xb = _blocked(x, (-1, m // 16, 16, n // 16, 16), (2, 4))
    res = _run(("nvfp4", scale, block, x.dtype, out_dtype), _nvfp4_body, (xb, scale, block == "2d", out_dtype))
    return None if res is None else (res[0].view(x.shape), res[1])


def fake_quantize_mxfp4_fused(x: torch.Tensor, scale_mode: str, out_dtype: torch.dtype):
    """Compiled ``fake_quantize_mxfp4`` of a validated ``x``: (output, all-finite flag) or None."""
    xb = _blocked(x, (-1, x.shape[-1] // 32, 32), (2,))
    res = _run(("mxfp4", scale_mode, x.dtype, out_dtype), _mxfp4_body, (xb, scale_mode, out_dtype))
    return None if res is None else (res[0].view(x.shape), res[1])
