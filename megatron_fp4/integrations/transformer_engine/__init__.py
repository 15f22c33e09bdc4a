"""Optional Transformer Engine backend for NVFP4 quantization, checked against our portable quantizer.

    cap = te_available()            # Capability(ok, reason); falsy with a reason on CPU
    t = te_quantize_nvfp4(x)        # TE's NVFP4Quantizer -> our FP4Tensor (codes, E4M3 block scales, S_dec)
    report = compare_with_portable(x)   # bit-equality against megatron_fp4.fp4.quantize_nvfp4

Honesty note: this path is **untested in this repository's CI** (no GPU, no Transformer Engine);
it was written against TE's public NVFP4 API (`transformer_engine.pytorch.NVFP4Quantizer`, the
quantizer behind `transformer_engine.common.recipe.NVFP4BlockScaling`, TE >= 2.7, Blackwell
sm_100+) and is exercised by `tools/gpu_check.py` on a GPU machine. What CPU tests do cover: the
capability check, the clear RuntimeError, and `fp4_tensor_from_te_storage` (the unpacking and
un-padding of TE's storage) on synthetic storage built from our own quantizer.

What is compared: TE's 1-D (1×16) row-wise quantization with a per-tensor global amax, no random
Hadamard transform, round-to-nearest — the same arithmetic as our
``quantize_nvfp4(x, scale='tensor', block='1d')``. Our default activation recipe uses a per-row
global scale (batch invariant), which TE does not offer; 2-D weight tiles and TE's
stochastic-rounding / RHT options are not wrapped here. Nothing in this module quantizes by
itself (ground rule 2): the reference is always `megatron_fp4.fp4.quantize_nvfp4`.
"""
from __future__ import annotations

import inspect
from typing import NamedTuple

import torch

from megatron_fp4.fp4 import FP4Tensor, quantize_nvfp4, unpack_fp4
from megatron_fp4.fp4.formats import FLT_MAX
from megatron_fp4.fp4.nvfp4 import E4M3_MAX

MIN_CAPABILITY = (10, 0)  # NVFP4 tensor-core formats: Blackwell (sm_100) and newer


class Capability(NamedTuple):
    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


def te_available(device=None) -> Capability:
    """Whether TE's NVFP4 quantizer can run here; `reason` says why not (or what was found)."""
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch as te
    except Exception as e:  # ImportError, or a broken CUDA build raising at import
        return Capability(False, f"transformer_engine is not importable ({type(e).__name__}: {e})")
    if not torch.cuda.is_available():
        return Capability(False, "no CUDA device (torch.cuda.is_available() is False)")
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < MIN_CAPABILITY:
        return Capability(False, f"GPU compute capability sm_{cap[0]}{cap[1]} < sm_100: NVFP4 needs Blackwell or newer")
    check = getattr(te, "is_nvfp4_available", None)
    if check is not None:
        try:
            ok, reason = check(return_reason=True)
        except TypeError:
            ok, reason = bool(check()), ""
        if not ok:
            return Capability(False, f"transformer_engine reports NVFP4 unavailable: {reason}")
    if _quantizer_class() is None:
        return Capability(False, "this transformer_engine has no NVFP4Quantizer (TE >= 2.7 is needed)")
    return Capability(True, f"transformer_engine {getattr(transformer_engine, '__version__', '?')} on sm_{cap[0]}{cap[1]}")


def _quantizer_class():
    try:
        from transformer_engine.pytorch import NVFP4Quantizer
        return NVFP4Quantizer
    except ImportError:
        pass
    try:
        from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer
        return NVFP4Quantizer
    except ImportError:
        return None


def _make_quantizer():
    import transformer_engine_torch as tex

    cls = _quantizer_class()
    wanted = dict(fp4_dtype=tex.DType.kFloat4E2M1, rowwise=True, columnwise=False, with_amax_reduction=False,
                  amax_reduction_group=None, with_rht=False, with_post_rht_amax=False, with_2d_quantization=False,
                  stochastic_rounding=False)
    params = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in wanted.items() if k in params})


def global_decode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_dec from a global amax, as in our NVFP4 definition (S_enc = min(448·6/amax, FLT_MAX),
    1 when amax is 0): the conversion of TE's stored amax into `FP4Tensor.global_scale`."""
    amax = amax.to(torch.float32).reshape(())
    s_enc = torch.clamp(torch.tensor(E4M3_MAX * 6.0, device=amax.device) / amax, max=FLT_MAX)
    s_enc = torch.where(amax == 0, torch.ones_like(s_enc), s_enc)
    return 1.0 / s_enc


def fp4_tensor_from_te_storage(rowwise_data: torch.Tensor, rowwise_scale_inv: torch.Tensor, amax: torch.Tensor,
                               shape) -> FP4Tensor:
    """Our `FP4Tensor` from TE NVFP4 row-wise storage of a tensor of `shape`.

    rowwise_data: uint8 [M, N/2] packed codes, even element in the low nibble (TE's layout, ours too).
    rowwise_scale_inv: E4M3 block scales as uint8, possibly padded by TE (rows, columns) — sliced
    to [M, N/16]. amax: TE's per-tensor amax."""
    shape = torch.Size(shape)
    n = shape[-1]
    m = shape.numel() // n if n else 0
    data = rowwise_data.view(torch.uint8).reshape(-1, rowwise_data.shape[-1])[:m, : n // 2]
    scales = rowwise_scale_inv.view(torch.uint8).reshape(-1, rowwise_scale_inv.shape[-1])[:m, : n // 16]
    codes = unpack_fp4(data.contiguous()).reshape(shape)
    block_scales = scales.contiguous().view(torch.float8_e4m3fn).reshape(*shape[:-1], n // 16)
    return FP4Tensor(codes, block_scales, global_decode_scale(amax), "nvfp4", "1d")


def te_quantize_nvfp4(x: torch.Tensor) -> FP4Tensor:
    """Quantize `x` (CUDA, last dim a multiple of 16) with TE's NVFP4Quantizer (1-D blocks,
    per-tensor amax, no RHT, round-to-nearest). Raises RuntimeError when TE/NVFP4 is unavailable."""
    cap = te_available(x.device if x.is_cuda else None)
    if not cap:
        raise RuntimeError(f"Transformer Engine NVFP4 backend unavailable: {cap.reason}. Use "
                           f"megatron_fp4.fp4.quantize_nvfp4 (the portable reference) instead.")
    if not x.is_cuda:
        raise RuntimeError("te_quantize_nvfp4 needs a CUDA tensor; move x to the GPU or use quantize_nvfp4")
    if x.dim() < 1 or x.shape[-1] % 16:
        raise ValueError(f"te_quantize_nvfp4: last dim of x (shape {tuple(x.shape)}) must be a multiple of 16")
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    t = _make_quantizer()(x2)
    return fp4_tensor_from_te_storage(t._rowwise_data, t._rowwise_scale_inv, t._amax_rowwise, x.shape)


def compare_fp4_tensors(ours: FP4Tensor, theirs: FP4Tensor) -> dict:
    """Bitwise comparison of two NVFP4 `FP4Tensor`s (codes, E4M3 scale bytes, global scale, values)."""
    codes_diff = int((ours.codes.cpu() != theirs.codes.cpu()).sum())
    s_ours = ours.block_scales.cpu().view(torch.uint8)
    s_theirs = theirs.block_scales.cpu().view(torch.uint8)
    scale_diff = int((s_ours != s_theirs).sum()) if s_ours.shape == s_theirs.shape else -1
    g_ours, g_theirs = ours.global_scale.cpu().reshape(-1), theirs.global_scale.cpu().reshape(-1)
    global_equal = g_ours.shape == g_theirs.shape and torch.equal(g_ours.view(torch.int32), g_theirs.view(torch.int32))
    values_equal = torch.equal(ours.dequantize().cpu(), theirs.dequantize().cpu())
    report = {
        "shape": list(ours.shape), "mismatched_codes": codes_diff, "mismatched_block_scales": scale_diff,
        "codes_equal": codes_diff == 0, "block_scales_equal": scale_diff == 0, "global_scale_equal": global_equal,
        "dequantized_equal": values_equal,
    }
    report["equal"] = all(report[k] for k in ("codes_equal", "block_scales_equal", "global_scale_equal"))
    return report


def compare_with_portable(x: torch.Tensor) -> dict:
    """TE's NVFP4 quantization of `x` vs ours (`quantize_nvfp4(x, scale='tensor', block='1d')`),
    bit for bit. Raises RuntimeError when TE is unavailable."""
    theirs = te_quantize_nvfp4(x)
    ours = quantize_nvfp4(x, scale="tensor", block="1d")
    return compare_fp4_tensors(ours, theirs)


__all__ = ["Capability", "MIN_CAPABILITY", "te_available", "te_quantize_nvfp4", "fp4_tensor_from_te_storage",
           "global_decode_scale", "compare_fp4_tensors", "compare_with_portable"]
