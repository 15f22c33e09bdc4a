"""MoEResQ over all experts of a layer in one autograd call, with per expert the bits of the loop.

``grouped_moeresq_linear(x, weight, counts, ...)``: rows ``x[offs[e]:offs[e+1]]`` times ``weight[e]ᵀ``
for every expert ``e``, equal bit for bit to ``moeresq_linear(x_e, weight[e], name=names[e],
segments=segments[e])`` per expert (forward, dgrad, wgrad), because per element it runs the same ops
in the same order on the same operands:

- ``Q(W)`` per expert through the same ``_Site`` and cache key as the loop (``_cached_weight``).
- ``Q̃_row(X)`` (forward) and ``Q̃_row(dY)`` (dgrad): where the format is *row-local* (nearest
  rounding; MXFP4, or NVFP4 with per-row scale and 1-D blocks) a row's codes depend on that row
  alone, so one quantizer call over every expert's rows gives each row its per-expert bits. Any
  other format (stochastic rounding, whose streams are keyed by expert; a per-tensor scale) is
  quantized expert by expert exactly as the loop does.
- ``Q̃_col`` (wgrad, blocks along tokens, every run of ``segments`` alone): for row-local formats
  every run is transposed into one zero-padded ``(runs, features, L)`` buffer, ``L`` the longest
  padded run, and quantized in one call. A (run, feature) row then holds the run's own padded row
  followed by all-zero blocks, which leave the row's amax and its other blocks unchanged (zero
  blocks get scale 0, codes 0); runs of very unequal length go to separate buffers of similar
  lengths (`_buckets`). Each expert's operand is then cut back to the exact
  ``(features, Σ padded runs)`` layout the loop builds, so its GEMM has the same shape, strides and
  values. Other formats go run by run through ``moeresq._col_quantize``.
- The GEMMs are per expert ``torch.mm`` on the same operand layouts as the loop's
  ``F.linear`` / ``@`` (which lower to the same ``mm``).

Autograd: the same split layout as ``moeresq_linear`` (``_ForwardGemm`` handing ``dY`` to a dgrad half
and a wgrad half), with the stacked weight as the wgrad half's input: its gradient is the stack of
per-expert ``dW`` (zeros for an expert without rows), what ``unbind`` views give in the loop.
Outside the batch-invariant mode and the Triton kernels only (the caller checks `can_group_resq`).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_fp4.fp4 import invariant, tiled, triton_batch, triton_fp4
from megatron_fp4.fp4.grad_fusion import claim_fused, finish_fused, fused_grad_of
from megatron_fp4.fp4.moeresq import (
                                      _ForwardGemm, _Site, _accumulate_dtype, _cached_weight, _col_quantize, _link, _no_autocast,
                                      _rows32, _runs,
                                      )
from megatron_fp4.fp4.numerics import STANDARD, Numerics
from megatron_fp4.fp4.recipe import OperandFormat, Recipe, row_local
from megatron_fp4.fp4.tensor_cut import TensorCut

# Columnwise runs share one zero-padded buffer while its size stays within this many times their
# own padded sizes (runs of very unequal length go to buckets of similar lengths).
MAX_PAD_RATIO = 1.5


def _buckets(pads: list) -> list:
    """Indices of ``pads`` in buckets, longest first, each bucket's ``len · longest`` at most
    ``MAX_PAD_RATIO`` times its sum (a bucket of one has no padding)."""
    buckets, total = [], 0
    for i in sorted(range(len(pads)), key=lambda i: -pads[i]):
        if buckets and (len(buckets[-1]) + 1) * pads[buckets[-1][0]] <= MAX_PAD_RATIO * (total + pads[i]):
            buckets[-1].append(i)
            total += pads[i]
        else:
            buckets.append([i])
            total = pads[i]
    return buckets



def can_group_resq(recipe: Recipe, x: torch.Tensor, numerics: Numerics = STANDARD) -> bool:
    """Whether `grouped_moeresq_linear` gives the loop's bits for ``x``: FP4 modes, outside the
    ``exact`` level (exact GEMMs; at the ``batch`` level each expert's GEMM runs over fixed row
    tiles, as the loop's) and the Triton kernels
    (their own columnwise path)."""
    return (recipe.mode in ("fp4", "fp4_resq") and not invariant.exact(numerics, x)
            and not triton_fp4.use_triton(x, numerics.triton) and x.shape[0] > 0)


class _Group:
    """Per-expert sites and row ranges of one grouped call (captured in forward)."""

    def __init__(self, recipe: Recipe, names, counts, segments, name: str, device, numerics: Numerics, cut=None):
        segs = segments or [None] * len(counts)
        self.recipe, self.counts, self.name = recipe, [int(n) for n in counts], name
        self.sites = [_Site.at(recipe, names[e], numerics, device, _runs(segs[e], n), cut=cut)
                      for e, n in enumerate(self.counts)]
        self.ranges, start = [], 0
        for n in self.counts:
            self.ranges.append((start, start + n))
            start += n
        self.active = [e for e, n in enumerate(self.counts) if n]
        self.whole = _Site.at(recipe, name, numerics, device, cut=cut)  # names all-rows calls
        self.tiled = invariant.tiled(numerics)  # the batch level: forward GEMMs over fixed row tiles
        self.triton = numerics.triton  # ... by the Triton kernel where it serves (`triton_batch.mm`)
        self.packs = numerics.weight_packs()  # where oneDNN's packed weights are kept (`tiled._onednn_weight`)

    def rows(self, t: torch.Tensor, e: int) -> torch.Tensor:
        a, b = self.ranges[e]
        return t[a:b]

    def quantize_rows(self, t: torch.Tensor, fmt: OperandFormat, operand: str, scratch: bool = False):
        """Q̃_row of every expert's rows of ``t`` (fp32), each with its expert's bits."""
        comp = self.recipe.compensated
        if row_local(fmt):
            return self.whole.quantize(t, fmt, operand, comp, scratch=scratch)
        out = torch.empty(t.shape, dtype=torch.float32, device=t.device)
        for e in self.active:
            self.rows(out, e).copy_(self.sites[e].quantize(self.rows(t, e), fmt, operand, comp))
        return out

    def quantize_cols(self, t: torch.Tensor, fmt: OperandFormat, operand: str) -> dict:
        """{expert: Q̃_col of its rows of ``t``}, the loop's ``_col_quantize`` layout and bits."""
        if not row_local(fmt):
            return {e: _col_quantize(self.sites[e], self.rows(t, e), fmt, operand) for e in self.active}
        runs = [(e, a) for e in self.active for a in self._runs_of(t, e)]
        pads = [a.shape[0] + (-a.shape[0]) % fmt.block_size for _, a in runs]
        q = [None] * len(runs)
        for bucket in _buckets(pads):
            width = pads[bucket[0]]
            buf = t.new_empty(len(bucket), t.shape[1], width, dtype=torch.float32)
            for j, i in enumerate(bucket):
                if runs[i][1].shape[0] < width:  # the padding: zeros (a zero-filled buffer was a pass more)
                    buf[j, :, runs[i][1].shape[0]:].zero_()
                # A transposing copy into a strided slice (a run shorter than the bucket's width) is
                # ATen's element-by-element path, ~4x slower than its blocked transpose into a
                # contiguous buffer followed by a row copy (issue 37); a run as wide as the bucket
                # takes the transpose directly.
                dst, src = buf[j, :, :runs[i][1].shape[0]], runs[i][1].t()
                dst.copy_(src if dst.is_contiguous() else src.contiguous())
            qb = self.whole.quantize(buf.view(-1, width), fmt, operand + " (columnwise)", self.recipe.compensated,
                                     scratch=True).view(buf.shape)
            for j, i in enumerate(bucket):
                q[i] = qb[j, :, :pads[i]]
        out = {}
        for e in self.active:
            parts = [q[i] for i, (owner, _) in enumerate(runs) if owner == e]
            out[e] = (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]).contiguous()
        return out

    def _runs_of(self, t: torch.Tensor, e: int) -> list:
        segs = self.sites[e].segments
        rows = self.rows(t, e)
        return list(rows.split(list(segs))) if segs is not None else [rows]


@_no_autocast
def _forward(g: _Group, x2: torch.Tensor, weight: torch.Tensor):
    """(output [N, out] in x's dtype, {expert: Q(W_e)})."""
    r = g.recipe
    wqs = {}
    for e in g.active:
        w, site = weight[e], g.sites[e]
        wqs[e] = _cached_weight(site, w, False, lambda at, w=w: at.quantize(w, r.weight, "weight", False))
    xq = g.quantize_rows(x2, r.input, "input")
    acc = _accumulate_dtype(x2.dtype)
    if g.tiled and g.active:
        xa = xq.to(acc)
        ws = [wqs.get(e, wqs[g.active[0]]).to(acc) for e in range(len(g.counts))]  # (an idle expert's: never read)
        if not triton_batch.serves(g.triton, xa, ws[0]):
            # The batch level's portable GEMMs: every expert's rows in one padded layout, each run the
            # calls `tiled_mm` of its rows alone makes (`tiled.tiled_grouped_linear`: the loop's bits,
            # one pad and one gather instead of a pad, an output and a copy per expert).
            return tiled.tiled_grouped_linear(xa, ws, g.counts, g.packs).to(x2.dtype), wqs
    out = torch.empty(x2.shape[0], weight.shape[1], dtype=acc, device=x2.device)  # every row is an expert's
    for e in g.active:
        if g.tiled:
            g.rows(out, e).copy_(triton_batch.mm(g.rows(xq, e).to(acc), wqs[e].to(acc).t(), g.triton, g.packs))
        else:
            torch.mm(g.rows(xq, e).to(acc), wqs[e].to(acc).t(), out=g.rows(out, e))
    return out.to(x2.dtype), wqs


@_no_autocast
def _dgrad(g: _Group, dy: torch.Tensor, wqs: dict, x_shape, x_dtype) -> torch.Tensor:
    dy2 = _rows32(dy)
    if g.recipe.quantize_backward:
        own = dy2.untyped_storage().data_ptr() != dy.untyped_storage().data_ptr()
        dy2 = g.quantize_rows(dy2, g.recipe.grad_output, "grad_output", scratch=own)
    acc = _accumulate_dtype(x_dtype)
    dx = torch.empty(x_shape, dtype=acc, device=dy.device)
    for e in g.active:
        torch.mm(g.rows(dy2, e).to(acc), wqs[e].to(acc), out=g.rows(dx, e))
    return dx.to(x_dtype)


@_no_autocast
def _wgrad(g: _Group, dy: torch.Tensor, x2: torch.Tensor, w_shape, w_dtype,
           dest: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The stacked weight gradient [E, out, in]; into ``dest`` (the optimizer's zeroed gradient
    buffer, granted by `fp4/grad_fusion.py`) when given, with the bits of accumulating into it."""
    dy2, r = _rows32(dy), g.recipe
    if dest is None:
        dw = torch.empty(w_shape, dtype=w_dtype, device=dy.device)
        for e in range(w_shape[0]):
            if not g.counts[e]:
                dw[e].zero_()
    else:  # zero already
        dw = dest
    if not r.quantize_backward:
        for e in g.active:
            dw[e] = (g.rows(dy2, e).t() @ g.rows(x2, e).to(dy2.dtype)).to(w_dtype)
            if dest is not None:
                finish_fused(dw[e])
        return dw
    dyt = g.quantize_cols(dy2, r.grad_output, "grad_output")
    xt = g.quantize_cols(x2, r.input, "input")
    for e in g.active:
        a, b = dyt[e].to(dy2.dtype), xt[e].t().to(dy2.dtype)
        if w_dtype == dy2.dtype:  # the GEMM writes the stacked gradient: no per-expert temporary and copy
            torch.mm(a, b, out=dw[e])
        else:
            dw[e] = (a @ b).to(w_dtype)
        if dest is not None:
            finish_fused(dw[e])
    return dw


class _GroupedDgradHalf(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g: _Group, wqs: dict, out_shape):
        # Q(W) through save_for_backward, not as a ctx attribute: saved-tensor hooks (recompute,
        # offloading, the memory planner's count) see what the graph holds.
        ctx.g, ctx.experts, ctx.x_meta = g, list(wqs), (x.shape, x.dtype)
        ctx.save_for_backward(*wqs.values())
        return _link(out_shape, x.dtype, x.device)

    @staticmethod
    def backward(ctx, dy):
        wqs = dict(zip(ctx.experts, ctx.saved_tensors))
        return _dgrad(ctx.g, dy, wqs, *ctx.x_meta), None, None, None


class _GroupedWgradHalf(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, x2, g: _Group, out_shape, out_dtype):
        ctx.save_for_backward(x2)
        ctx.g, ctx.w_meta = g, (weight.shape, weight.dtype)
        ctx.fused = fused_grad_of(weight, ctx.needs_input_grad[0])
        return _link(out_shape, out_dtype, x2.device)

    @staticmethod
    def backward(ctx, dy):
        (x2,) = ctx.saved_tensors
        dest = claim_fused(ctx)
        dw = _wgrad(ctx.g, dy, x2, *ctx.w_meta, dest=dest)
        return (None if dest is not None else dw), None, None, None, None


def grouped_moeresq_linear(x: torch.Tensor, weight: torch.Tensor, counts: Sequence[int], *, recipe: Recipe,
                           names: Sequence[str], name: str = "",
                           segments: Optional[Sequence[Optional[Sequence[int]]]] = None,
                           numerics: Numerics = STANDARD, cut: Optional[TensorCut] = None) -> torch.Tensor:
    """``x`` [N, in] (rows grouped by expert, ``counts[e]`` rows for expert e) times ``weight[e]ᵀ``
    (``weight`` [E, out, in]) -> [N, out], per expert the bits of ``moeresq_linear(..., name=names[e],
    segments=segments[e])`` (see the module docstring). ``name`` names the all-rows quantizer calls
    in non-finite errors. ``cut``: every expert's tensor-parallel slice (``tensor_cut.py``, expert-tensor
    parallel). Needs `can_group_resq(recipe, x, numerics)`."""
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"grouped_moeresq_linear: x {tuple(x.shape)} must be [N, in] and weight "
                         f"{tuple(weight.shape)} [E, out, in] with the same in")
    if len(counts) != weight.shape[0] or len(names) != weight.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_moeresq_linear: counts={list(counts)} and {len(names)} names must give one "
                         f"entry per expert ({weight.shape[0]}), counts summing to the {x.shape[0]} rows")
    if segments is not None and len(segments) != weight.shape[0]:
        raise ValueError(f"grouped_moeresq_linear: segments must hold one entry per expert ({weight.shape[0]}), "
                         f"got {len(segments)}")
    g = _Group(recipe, names, counts, segments, name, x.device, numerics, cut)
    out_shape = (x.shape[0], weight.shape[1])
    with torch.no_grad():
        y, wqs = _forward(g, x.detach(), weight.detach())
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return y
    dgrad_link = _GroupedDgradHalf.apply(x, g, wqs, out_shape)
    wgrad_link = _GroupedWgradHalf.apply(weight, x.detach(), g, out_shape, x.dtype)
    return _ForwardGemm.apply(dgrad_link, wgrad_link, lambda: y)

