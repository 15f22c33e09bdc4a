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


_verified: set = set()


def _probe_like(xb: torch.Tensor) -> torch.Tensor:
    """Hard inputs in ``xb``'s block layout: E2M1 ties and grid points, saturation, and the same
    block at scales from 2^-133 to 2^17 (subnormal fp32 values and subnormal / zero E4M3 scales)."""
    base = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -2.5, -5.0, -6.0, 0.1, 7.0])
    rows = torch.stack([base * 2.0 ** k for k in range(-133, 20, 3)])  # [51, 16]
    width = xb.shape[-1] if xb.dim() == 3 else 16
    flat = rows.repeat(1, max(1, width // 16))[:, :width]
    if xb.dim() == 3:  # (rows, blocks, block): one block per row
        probe = flat[:, None, :].expand(-1, xb.shape[1], -1)
    else:  # (batch, 16-row tiles, 16, 16-col tiles, 16): the rows stacked into 16×16 tiles
        tiles = flat[:48].reshape(3, 1, 16, 1, 16)
        probe = tiles.expand(-1, xb.shape[1], -1, xb.shape[3], -1)
    return probe.to(xb.dtype).contiguous()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8),
                                                                     b.view(-1).view(torch.uint8))


def _disable(reason: str) -> None:
    _state["broken"] = reason
    warnings.warn(f"megatron_fp4: compiled FP4 fake-quant disabled, using the eager path ({reason})",
                  RuntimeWarning, stacklevel=4)


def _run(key, body, args):
    """The compiled result, or None when compilation failed (then the caller runs eager).

    The first call of each variant also runs the uncompiled body on the same input and on hard
    probe inputs and requires the same bits: the C++ inductor generates depends on the machine's
    vector unit (``ATEN_CPU_CAPABILITY``), and a kernel that is not bit-exact there is not used."""
    try:
        fn = _get(key, body)
        out = fn(*args)
        if key not in _verified:
            for xb in (args[0], _probe_like(args[0])):
                got, want = (out if xb is args[0] else fn(xb, *args[1:])), body(xb, *args[1:])
                if not _same_bits(got[0], want[0]):
                    _disable(f"the compiled {key[0]} kernel is not bit-exact on this CPU's kernel set "
                             f"({torch.backends.cpu.get_cpu_capability()})")
                    return None
            _verified.add(key)
        return out
    except Exception as err:  # a backend failure, never an input error: inputs are validated first
        _disable(f"{type(err).__name__}: {err}")
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
