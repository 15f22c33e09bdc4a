"""The ``batch`` numerics level on Triton: fixed-tile GEMMs and fixed-key-block attention.

The device code and the invariance argument are in ``triton_batch_kernels.py``; this is the host
side. The entry points mirror ``tiled.py``'s and take the model's ``Numerics.triton`` mode
(``auto`` | ``off`` | ``interpret``, as the FP4 quantizers, ``triton_fp4.py``):

- :func:`linear` (``tiled.tiled_linear``), :func:`mm` (``tiled.tiled_mm``), :func:`grouped_linear`
  (``tiled.tiled_grouped_linear``) and :func:`attention` (``tiled.block_attention``) run the Triton
  kernels where :func:`serves` says so — CUDA tensors under ``auto``, also CPU tensors under
  ``interpret`` in a process that runs Triton's interpreter — and ``tiled.py``'s portable ops
  otherwise (``off``, other devices and dtypes, triton not importable). The caller's mode is the
  only input to that choice besides the tensors (no ContextVar, global or environment variable
  decides it; a launch failure raises, below): every call site of one
  model passes the same ``numerics.triton``, so the paths that must agree bitwise (the trainer's
  autograd forward, the rollout's no-grad forward, a decode step and a prefill) run one kernel set.
- Kernel configuration: one per input dtype (:data:`GEMM_CONFIG`, :data:`ATTENTION_CONFIG`), never
  a function of the row count, batch or sequence length.
- Autograd: the forward is the kernel, the backward ``tiled.py``'s (one plain GEMM per gradient;
  the flash-style attention backward from the saved log-sum-exp) — gradients sum over the batch,
  so no tiling makes them batch invariant.
- Inputs: fp32 or bf16 (both operands the same dtype), accumulation in fp32, the output in the
  input dtype; under autocast fp32 operands are cast to its dtype first, as ``torch.mm`` would
  take them. Other dtypes (fp16; fp64, the verification mode) take the portable ops.

A launch failure (a compiler or driver error) raises :class:`TritonBatchLaunchError`, naming the
fix (``numerics.triton: off`` for the trainer and every rollout), and never switches this process to
the portable ops: those give other bits, so a silent switch in one process (the trainer, say) would
break its agreement with the others (the rollout) that kept the kernels. Unlike the FP4 quantizers
(``triton_fp4.py``, bit-exact to the portable ones, so their fallback changes no bit), which
kernels compute a ``batch``-level call is decided by the model's ``Numerics.triton`` and the
tensors alone.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megatron_fp4.fp4 import tiled
from megatron_fp4.fp4.grad_fusion import fused_grad_of
from megatron_fp4.fp4.numerics import TRITON_MODES
from megatron_fp4.fp4.triton_fp4 import interpreting, pow2_at_least, triton_importable

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per input dtype: fixed, whatever M, N, K.
GEMM_CONFIG = {torch.bfloat16: (64, 128, 64, 4, 3), torch.float32: (64, 64, 32, 4, 3)}
# (BLOCK_M queries, BLOCK_N = the key block in positions, num_warps, num_stages) per input dtype.
# BLOCK_N is the fixed KV split size: the same as the portable path's (tiled.KEY_BLOCK).
ATTENTION_CONFIG = {torch.bfloat16: (64, tiled.KEY_BLOCK, 4, 2), torch.float32: (32, tiled.KEY_BLOCK, 4, 2)}
DTYPES = tuple(GEMM_CONFIG)

_state = {"launches": 0}  # a counter only (tests: the kernels did serve); it decides nothing


class TritonBatchLaunchError(RuntimeError):
    """A ``batch``-level Triton kernel failed to compile or launch (see :func:`_launch`)."""


def kernels():
    """The device-code module (compiled, or interpreted when :func:`interpreting`)."""
    from megatron_fp4.fp4 import triton_batch_kernels
    return triton_batch_kernels


def serves(mode: str, *tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels compute a call on ``tensors`` (floating operands first) under ``mode``."""
    if mode not in TRITON_MODES:
        raise ValueError(f"triton mode={mode!r} is not one of {TRITON_MODES}")
    if mode == "off" or not tensors:
        return False
    x = tensors[0]
    # the device first: on CPU (outside the interpreter) nothing else needs looking at
    if x.device.type != "cuda" and not (mode == "interpret" and x.device.type == "cpu" and _interpreting()):
        return False
    if x.dtype not in DTYPES or any(t.dtype != x.dtype or t.device != x.device for t in tensors[1:]):
        return False
    if torch.compiler.is_compiling():
        return False
    return True


def _interpreting() -> bool:
    return triton_importable()[0] and interpreting()


def launches() -> int:
    """How many kernel launches this module made in this process (tests: the kernels did serve)."""
    return _state["launches"]


def _launch(what: str, fn, portable):
    """``fn()`` on the tensors' device; ``portable()`` where triton is not importable (a fact of the
    installation, the same for every call of the process). A compiler or driver failure raises:
    switching this process to the portable ops would change its bits and not its peers'."""
    if not triton_importable()[0]:
        return portable()
    try:
        out = fn()
    except (ValueError, torch.OutOfMemoryError):  # the caller's input, or memory: not the kernels' fault
        raise
    except Exception as err:
        raise TritonBatchLaunchError(
            f"megatron_fp4: the batch-level Triton {what} kernel failed ({type(err).__name__}: {err}). "
            "Falling back to the portable tiled ops here would give this process other bits than its "
            "rollout/trainer peers; set numerics.triton: off in the trainer's and every rollout's config "
            "(the portable tiled ops everywhere) or fix the Triton installation.") from err
    _state["launches"] += 1
    return out


def _on_device(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _bf16(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16


def _upcast(t: torch.Tensor) -> bool:
    """Whether the kernels multiply bf16 operands as exact fp32 copies: under the interpreter only,
    whose ``dot`` cannot multiply bf16 (it holds them as uint16). The products are exact either
    way (a bf16 · bf16 product fits fp32), so only the order inside one block's sum differs from
    the GPU's tensor-core MMA, which fixes that order by the tile shape just as well."""
    return _bf16(t) and t.device.type == "cpu"


def _out_arg(out: torch.Tensor) -> torch.Tensor:
    """The output as the kernels write it: bf16 as its int16 bits (rounded in the kernel)."""
    return out.view(torch.int16) if _bf16(out) else out


def gemm(x2: torch.Tensor, w: torch.Tensor, config: Optional[tuple] = None) -> torch.Tensor:
    """``x2`` [M, K] · ``w`` [N, K]ᵀ by the fixed-tile kernel (no autograd, no fallback). ``config``:
    another (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) than :data:`GEMM_CONFIG`'s, only for the
    checks (``tools/gpu_check_triton_batch.py`` shows that a tile chosen from M breaks invariance)."""
    M, K = x2.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"triton_batch.gemm: x is [{M}, {K}] but the weight is {list(w.shape)} (needs [N, {K}])")
    bm, bn, bk, warps, stages = GEMM_CONFIG[x2.dtype] if config is None else config
    out = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    with _on_device(x2):
        kernels().gemm_kernel[(triton_cdiv(M, bm), triton_cdiv(N, bn))](
            x2, w, _out_arg(out), M, N, K, x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), out.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION="ieee", OUT_BF16=_bf16(out), UPCAST=_upcast(out),
            num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_table(counts, block_m: int, device) -> tuple:
    """(expert, start, end) int32 per row tile of rows sorted by expert (``counts[e]`` rows each):
    each expert's rows cut into tiles of ``block_m`` from its first row, none spanning two experts."""
    experts, starts, ends, at = [], [], [], 0
    for e, n in enumerate(counts):
        for s in range(at, at + n, block_m):
            experts.append(e)
            starts.append(s)
            ends.append(at + n)
        at += n
    table = torch.tensor([experts, starts, ends], dtype=torch.int32)
    return tuple(table.to(device, non_blocking=True))


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, counts) -> torch.Tensor:
    """Consecutive runs of ``counts[e]`` rows of ``x`` [M, K] times ``w[e]``ᵀ (``w`` [E, N, K]), by
    the grouped kernel: a row's bits are :func:`gemm`'s on its run alone (no autograd, no fallback)."""
    counts = [int(n) for n in counts]
    M, K = x.shape
    E, N = w.shape[0], w.shape[1]
    if len(counts) != E or sum(counts) != M or min(counts, default=0) < 0:
        raise ValueError(f"triton_batch.grouped_gemm: counts {counts} must be {E} non-negative row counts "
                         f"summing to the {M} rows of x")
    if w.shape[2] != K:
        raise ValueError(f"triton_batch.grouped_gemm: x is [{M}, {K}] but the weights are {list(w.shape)}")
    bm, bn, bk, warps, stages = GEMM_CONFIG[x.dtype]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    te, ts, tend = tile_table(counts, bm, x.device)
    with _on_device(x):
        kernels().grouped_gemm_kernel[(te.shape[0], triton_cdiv(N, bn))](
            x, w, _out_arg(out), te, ts, tend, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
            w.stride(2), out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION="ieee",
            OUT_BF16=_bf16(out), UPCAST=_upcast(out), num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    return out


def attention_forward(q, k, v, positions, pad, scale: Optional[float] = None, window: int = 0,
                      sinks: Optional[torch.Tensor] = None, config: Optional[tuple] = None) -> tuple:
    """(out [B, H, Tq, Dv], lse [B, KV, rep·Tq] fp32) of ``tiled.block_attention``'s contract by the
    fixed-key-block kernel (no autograd, no fallback). ``config``: another (BLOCK_M, BLOCK_N, warps,
    stages) than :data:`ATTENTION_CONFIG`'s, only for the checks (a key block chosen from Tq breaks
    decode == prefill: ``tools/gpu_check_triton_batch.py``)."""
    B, H, Tq, D = q.shape
    KV, Tk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[3] != D or KV == 0 or H % KV:
        raise ValueError(f"triton_batch.attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} must be "
                         "[B, H, Tq, D], [B, KV, Tk, D], [B, KV, Tk, Dv] with KV dividing H")
    if tuple(positions.shape) != (B, Tq) or tuple(pad.shape) != (B,):
        raise ValueError(f"triton_batch.attention: positions {list(positions.shape)} must be [{B}, {Tq}] and "
                         f"pad {list(pad.shape)} [{B}]")
    if window < 0:
        raise ValueError(f"triton_batch.attention: window={window} must be >= 0 (0: none)")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    positions = positions if positions.stride(-1) == 1 else positions.contiguous()
    pad = pad.contiguous()
    block_m, block_n, warps, stages = ATTENTION_CONFIG[q.dtype] if config is None else config
    out = torch.empty(B, H, Tq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, Tq, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse.view(B, KV, (H // KV) * Tq)
    scale = D ** -0.5 if scale is None else float(scale)
    sink_arg = sinks.contiguous() if sinks is not None else lse
    with _on_device(q):
        kernels().attention_kernel[(triton_cdiv(Tq, block_m), B * H)](
            q, k, v, positions, pad, sink_arg, _out_arg(out), lse, H, Tq, Tk, D, Dv, scale, int(window),
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), positions.stride(0), out.stride(0), out.stride(1), out.stride(2),
            REP=H // KV, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=pow2_at_least(D, 16), BLOCK_DV=pow2_at_least(Dv, 16),
            WINDOW=bool(window), SINKS=sinks is not None, PRECISION="ieee", OUT_BF16=_bf16(out), UPCAST=_upcast(out),
            num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    return out, lse.view(B, KV, (H // KV) * Tq)


# ---- autograd: the kernels' forward, tiled.py's backward -------------------------------------

class _TritonMM(tiled._TiledMM):
    """``x2 @ wᵀ``: forward the fixed-tile kernel, backward :class:`tiled._TiledMM`'s."""

    @staticmethod
    def forward(ctx, x2, w):
        ctx.save_for_backward(x2, w)
        ctx.fused = fused_grad_of(w, ctx.needs_input_grad[1])
        return gemm(x2, w)


class _TritonGroupedLinear(tiled._TiledGroupedLinear):
    """The grouped kernel's forward, :class:`tiled._TiledGroupedLinear`'s backward."""

    @staticmethod
    def forward(ctx, x, weight, counts):
        ctx.save_for_backward(x, weight)
        ctx.counts = counts
        ctx.fused = fused_grad_of(weight, ctx.needs_input_grad[1])
        return grouped_gemm(x, weight, counts)


class _TritonAttention(tiled._BlockAttention):
    """The fixed-key-block kernel's forward (saving its log-sum-exp), ``tiled._BlockAttention``'s
    flash-style backward."""

    @staticmethod
    def forward(ctx, q, k, v, positions, pad, scale, window, sinks):
        out, lse = attention_forward(q, k, v, positions, pad, scale, window, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.positions, ctx.pad, ctx.scale, ctx.window = positions, pad, scale, window
        ctx.versions = tiled._versions(positions, pad)
        return out


def _autocast(*tensors) -> tuple:
    """``tensors`` as ``torch.mm`` / ``bmm`` would take them under autocast on their device (the
    portable ops' behaviour): fp32 operands cast to the autocast dtype (differentiably), the rest as is."""
    first = tensors[0]
    device = first.device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t is not None and t.dtype == torch.float32 else t for t in tensors)


def _grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ---- entry points: the kernels where they serve, tiled.py's ops otherwise ---------------------

def _linear2d(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    w = w if w.is_contiguous() else w.contiguous()
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    if _grad(x2, w):
        return _launch("GEMM", lambda: _TritonMM.apply(x2, w), lambda: tiled._tiled_linear2d(x2, w))
    return _launch("GEMM", lambda: gemm(x2, w), lambda: tiled._tiled_linear2d(x2, w))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           triton: str = "auto", packs: Optional[dict] = None) -> torch.Tensor:
    """``tiled.tiled_linear`` (``F.linear`` over fixed row tiles) by the Triton kernel where it
    :func:`serves` under the mode ``triton`` (``packs``: the portable path's, ``Numerics.weight_packs``)."""
    if not serves(triton, x, weight):
        return tiled.tiled_linear(x, weight, bias, packs)
    x, weight = _autocast(x, weight)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out = _linear2d(x2, weight)
    if x.dim() != 2:
        out = out.view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def mm(x2: torch.Tensor, wt: torch.Tensor, triton: str = "auto", packs: Optional[dict] = None) -> torch.Tensor:
    """``tiled.tiled_mm`` (``x2`` [M, K] @ ``wt`` [K, N]) by the Triton kernel where it serves."""
    if not serves(triton, x2, wt):
        return tiled.tiled_mm(x2, wt, packs)
    x2, wt = _autocast(x2, wt)
    return _linear2d(x2, wt.t())


def grouped_linear(x: torch.Tensor, weights, counts, triton: str = "auto", packs: Optional[dict] = None) -> torch.Tensor:
    """``tiled.tiled_grouped_linear`` (runs of ``counts[e]`` rows times ``weights[e]ᵀ``; ``weights`` a
    list or a stacked [E, out, in] tensor) by the grouped Triton kernel where it serves."""
    stacked = isinstance(weights, torch.Tensor)
    first = weights if stacked else (weights[0] if len(weights) else None)
    if first is None or not serves(triton, x, first) or (not stacked and any(
            w.dtype != x.dtype or w.device != x.device for w in weights)):
        return tiled.tiled_grouped_linear(x, weights, counts, packs)
    counts = tuple(int(n) for n in counts)
    portable = lambda: tiled.tiled_grouped_linear(x, weights, counts)  # noqa: E731
    w = weights if stacked else torch.stack(list(weights))  # a list: one [E, out, in] copy (differentiable)
    x, w = _autocast(x, w)
    x = x if x.stride(-1) == 1 else x.contiguous()
    if _grad(x, w):
        return _launch("grouped GEMM", lambda: _TritonGroupedLinear.apply(x, w, counts), portable)
    w = w if w.stride(-1) == 1 else w.contiguous()
    return _launch("grouped GEMM", lambda: grouped_gemm(x, w, counts), portable)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, pad: torch.Tensor,
              triton: str = "auto", scale: Optional[float] = None, window: int = 0,
              sinks: Optional[torch.Tensor] = None, kv_blocks=None) -> torch.Tensor:
    """``tiled.block_attention`` (causal attention by position over fixed key blocks) by the Triton
    kernel where it serves (the kernel's key block is the portable path's ``tiled.KEY_BLOCK``;
    ``kv_blocks``: the portable path's `tiled.BlockedKV` of the cache, unused by the kernel)."""
    if not serves(triton, q, k, v):
        return tiled.block_attention(q, k, v, positions, pad, scale, window, sinks, kv_blocks)
    portable = lambda: tiled.block_attention(q, k, v, positions, pad, scale, window, sinks)  # noqa: E731
    q, k, v = _autocast(q, k, v)
    if _grad(q, k, v, sinks):
        return _launch("attention", lambda: _TritonAttention.apply(q, k, v, positions, pad, scale, window, sinks),
                       portable)
    return _launch("attention", lambda: attention_forward(q, k, v, positions, pad, scale, window, sinks)[0], portable)
