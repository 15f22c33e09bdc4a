"""Row-invariant numerics: every row's result depends only on that row (and its prefix).

The ``numerics`` argument's ``invariance`` level (``numerics.py``: the model's value, passed to
every op here as an explicit argument) picks the ops:

- ``standard``: the plain kernels (a row's bits may depend on its batch).
- ``batch``: fixed-shape kernel calls (``tiled.py``): GEMMs over fixed row tiles, attention over
  fixed key blocks combined in block order, row sums by ATen's ``sum`` on each row alone
  (:func:`last_dim_sum`), ATen's softmax / log-softmax (row-local kernels) and the SiLU below. A
  row's bits do not depend on its batch size or position, padding, micro-batch split, or KV cache
  vs full forward — at one tensor-parallel layout, on one machine and build.
- ``exact``: every GEMM's sum is exact (no order), and the row sums and attention's reductions
  are fixed trees: the bits are independent of the layout (and of the vector width) too:

- GEMMs: FP4 ones are summed exactly (``exact_gemm.exact_fp4_gemm``), the others (``linear``:
  attention projections, router, LM head, bf16-mode experts) by exact float64 GEMMs on 24-bit
  fixed-point limbs (``exact_gemm.exact_linear``; experts without autograd in one call over all
  their rows, :func:`grouped_linear`). Exact sums have no order.
- Row reductions (RMSNorm's mean square, softmax/log-softmax sums, attention's dot products and
  its sums over keys) are :func:`tree_sum` at ``exact`` (``batch`` sums rows with ATen): an
  adjacent-pair tree over absolute indices built from elementwise IEEE additions, so its order
  depends only on the index, and trailing zeros (masked keys, a longer padded row) do not change a
  nonzero result.
- Attention (:func:`attention`) indexes keys by *position* (each row's keys shifted left past its
  padding), so a query at position p sums the same keys in the same tree in a KV-cache decode step
  and in a causal full forward, whatever the batch's padding. It runs the same trees laid out with
  the reduced index first in bit-reversed order (:func:`_halving_tree`: each level adds two
  contiguous halves), over query chunks that stop at their last position (no B·H·T·T·D tensor).
- Elementwise transcendentals: ATen's ``exp``, ``log``, ``rsqrt``, ``cos``, ``sin`` give the same
  bits for an element whatever its position in the tensor (their vector kernels handle the tail);
  ``silu``/``sigmoid`` do not (a scalar tail loop rounds differently on AVX2/AVX-512), so
  :func:`silu` is ``x / (1 + exp(−x))``. ``tests/unit/test_batch_invariant.py`` checks all of them.

The level is the ``numerics`` argument's ``invariance`` (None: standard). float64 models (the
verification mode) keep the standard kernels: the fixed-point GEMM would round their inputs.
Training through the mode works (every op here is differentiable; ``linear``'s backward is the
plain one) but is slower; see ``benchmarks/bench_batch_invariant.py`` for the cost.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_fp4.fp4 import triton_batch
from megatron_fp4.fp4.exact_gemm import exact_grouped_linear, exact_linear
from megatron_fp4.fp4.tiled import row_sum, same_values, stamp


def enabled(numerics, x: Optional[torch.Tensor] = None) -> bool:
    """Whether ``numerics`` (a ``Numerics`` or None) runs a row-invariant level, ``batch`` or
    ``exact`` (for ``x``'s dtype: never float64): the row-local norms, softmax and SiLU here."""
    return numerics is not None and numerics.invariant_for(x)


def exact(numerics, x: Optional[torch.Tensor] = None) -> bool:
    """Whether ``numerics`` runs the ``exact`` level (exact GEMM sums, tree attention)."""
    return numerics is not None and numerics.exact_for(x)


def tiled(numerics, x: Optional[torch.Tensor] = None) -> bool:
    """Whether ``numerics`` runs the ``batch`` level (fixed-shape GEMM tiles, blocked attention: ``tiled.py``)."""
    return numerics is not None and numerics.tiled_for(x)


def tree_sum(t: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum over ``dim`` by an adjacent-pair tree: level by level ``t[2i] + t[2i+1]`` (a +0 appended
    to an odd length). Node i of level L always covers indices [i·2^L, (i+1)·2^L), so appending
    zeros never changes a nonzero result; ``+ 0.0`` at the end makes a zero result +0."""
    t = t.movedim(dim, -1)
    while t.shape[-1] > 1:
        if t.shape[-1] % 2:
            t = F.pad(t, (0, 1))
        t = t[..., 0::2] + t[..., 1::2]
    out = t.squeeze(-1) + 0.0 if t.shape[-1] == 1 else t.new_zeros(t.shape[:-1])
    return out.unsqueeze(dim) if keepdim else out


def last_dim_sum(t: torch.Tensor, numerics=None) -> torch.Tensor:
    """A row-invariant sum over the last dim (keepdim): at the ``batch`` level ATen's ``sum`` on each
    row alone (``tiled.row_sum``), at ``exact`` the :func:`tree_sum` (an order fixed by the index
    alone, whatever the machine's vector width)."""
    return row_sum(t, keepdim=True) if tiled(numerics, t) else tree_sum(t, -1, keepdim=True)


class _ExactLinear(torch.autograd.Function):
    """Forward: the exact batch-invariant GEMM; backward: the plain ``F.linear`` gradients."""

    @staticmethod
    def forward(ctx, x, weight, bias, cache):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return exact_linear(x, weight, bias, cache)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        dw = dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, numerics=None) -> torch.Tensor:
    """``F.linear``: exact at the ``exact`` level, row-tiled at ``batch``."""
    if tiled(numerics, x):  # fixed row tiles: the Triton kernel where numerics.triton serves it, else tiled.py
        return triton_batch.linear(x, weight, bias, numerics.triton, numerics.weight_packs())
    if not exact(numerics, x):
        return F.linear(x, weight, bias)
    return _ExactLinear.apply(x, weight, bias, numerics.weight_cache)


def grouped_linear(x: torch.Tensor, weights, counts, numerics=None) -> torch.Tensor:
    """Consecutive runs of ``counts[e]`` rows of ``x`` times ``weights[e]ᵀ``, without autograd: in
    the mode each row's bits are those of :func:`linear` on that run alone (``exact_grouped_linear``)."""
    if tiled(numerics, x):
        return triton_batch.grouped_linear(x, weights, counts, numerics.triton, numerics.weight_packs())
    if not exact(numerics, x):
        return torch.cat([F.linear(r, w) for r, w, n in zip(x.split(list(counts)), weights, counts) if n])
    return exact_grouped_linear(x, weights, counts, numerics.weight_cache)


class _Silu(torch.autograd.Function):
    """Forward ``x / (1 + exp(−x))``; backward SiLU's derivative from ``sigmoid`` (autograd through
    the forward formula gives inf/inf = NaN where exp(−x) overflows, x < −88 in fp32)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        # x / (1 + exp(−x)) in one fresh buffer (the same ops, in place on it: same bits, one
        # allocation where four were: each a pass of page faults at an expert's width)
        t = torch.neg(x).exp_().add_(1.0)
        return torch.div(x, t, out=t)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return dy * (s * (1.0 + x * (1.0 - s)))


def silu(x: torch.Tensor, numerics=None) -> torch.Tensor:
    """SiLU; at a row-invariant level ``x / (1 + exp(−x))`` (position-independent bits, see the
    module doc)."""
    if not enabled(numerics, x):
        return F.silu(x)
    if torch.is_grad_enabled() and x.requires_grad:
        return _Silu.apply(x)
    t = torch.neg(x).exp_().add_(1.0)  # _Silu's forward (the same ops) without an autograd node
    return torch.div(x, t, out=t)


def softmax(x: torch.Tensor, numerics=None) -> torch.Tensor:
    """Softmax over the last dim (in x's dtype). At ``batch``: ATen's own kernel, which reduces each
    row alone (threads take whole rows; a row's max, sum and log run over that row, the per-row
    results of a chunk through the same vector function, its tail included) — checked like the
    other row kernels in ``tests/unit/test_numerics_levels.py``. At ``exact``: a :func:`tree_sum`
    denominator (an order fixed by the index alone, whatever the vector width)."""
    if not enabled(numerics, x) or tiled(numerics, x):
        return torch.softmax(x, dim=-1, dtype=x.dtype)
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / tree_sum(e, -1, keepdim=True)


def log_softmax(x: torch.Tensor, numerics=None) -> torch.Tensor:
    """Log-softmax over the last dim: ATen's kernel at ``batch`` (row-local, see :func:`softmax`);
    at ``exact`` ``(x − max) − log(tree_sum(exp(x − max)))``."""
    if not enabled(numerics, x) or tiled(numerics, x):
        return torch.log_softmax(x, dim=-1)
    shifted = x - x.amax(-1, keepdim=True)
    return shifted - torch.log(tree_sum(torch.exp(shifted), -1, keepdim=True))


def mean_square(x: torch.Tensor, numerics=None) -> torch.Tensor:
    """``x.pow(2).mean(-1, keepdim=True)``; at a row-invariant level a :func:`last_dim_sum` divided by the size."""
    if not enabled(numerics, x):
        return x.pow(2).mean(-1, keepdim=True)
    return last_dim_sum(x * x, numerics) / x.shape[-1]


_last_pad: tuple = ()  # (stamp of the attention_mask, batch, device, pad, stamp of pad) of the last call


def leading_pad(attention_mask: Optional[torch.Tensor], batch: int, device) -> torch.Tensor:
    """Number of padding slots before each row's first real token (0 without a mask). Every layer
    of a forward asks with the same mask: the last answer is kept and returned as it is while the
    mask holds the same values (``tiled.same_values``: the same object unwritten, its base included,
    or equal values) — the next layers' calls then find ``tiled.block_attention``'s per-forward plan
    by the pad's identity. Only read."""
    global _last_pad
    last, device = _last_pad, torch.device(device)
    if last and last[1] == batch and last[2] == device and same_values(last[4], last[3]) and (
            last[0] is None if attention_mask is None else last[0] is not None and same_values(last[0], attention_mask)):
        return last[3]
    if attention_mask is None:
        pad = torch.zeros(batch, dtype=torch.long, device=device)
    else:
        pad = (attention_mask.long().cumsum(-1) == 0).sum(-1)
    _last_pad = (None if attention_mask is None else stamp(attention_mask), batch, device, pad, stamp(pad))
    return pad


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _halving_tree(t: torch.Tensor) -> torch.Tensor:
    """:func:`tree_sum` over dim 0 of ``t`` [2^m, ...] stored in bit-reversed index order: the
    natural pairs (2i, 2i+1) of a level sit at positions p and p + half, so each level adds two
    contiguous halves, and the result is the one of the adjacent-pair tree."""
    while t.shape[0] > 1:
        h = t.shape[0] // 2
        t = t[:h] + t[h:]
    return t[0] + 0.0


def _bits_first(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` zero-padded along ``dim`` to ``size`` (a power of two), moved to dim 0 in bit-reversed
    index order (the size split into binary axes, reversed: one permuting copy)."""
    dim = dim % t.dim()
    n = t.shape[dim]
    if size > n:
        t = torch.cat([t, t.new_zeros(*t.shape[:dim], size - n, *t.shape[dim + 1:])], dim)
    m = size.bit_length() - 1
    rest = (*t.shape[:dim], *t.shape[dim + 1:])
    if m == 0:
        return t.movedim(dim, 0)
    split = t.reshape(*t.shape[:dim], *(2,) * m, *t.shape[dim + 1:])  # axis dim + i = bit m-1-i
    order = [dim + m - 1 - j for j in range(m)] + [a for a in range(split.dim()) if not dim <= a < dim + m]
    return split.permute(order).reshape(size, *rest)


ATTENTION_CHUNK = 1 << 20  # elements of one query chunk's product tensor (bounds memory, stays in cache)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
              pad: torch.Tensor, numerics=None, *, scale: Optional[float] = None, window: int = 0,
              sinks: Optional[torch.Tensor] = None, kv_blocks=None) -> torch.Tensor:
    """Causal attention by position (the contract below): at the ``batch`` level of ``numerics``
    over fixed key blocks (``tiled.block_attention``), otherwise (``exact``, or no ``numerics``)
    by :func:`tree_attention`. The families' variants (`model/gpt_oss.py`, `model/deepseek_v3.py`):
    ``scale`` the softmax scale (default D^-0.5), ``window`` > 0 a sliding window (a query at p sees
    keys p − window < j ≤ p), ``sinks`` [H] a per-head logit joining every row's softmax and
    dropped after it; the values' dim may differ from the keys'. ``kv_blocks``: at the ``batch``
    level the KV cache's ``tiled.BlockedKV`` (``tiled.cache_blocks``; the same bits, no gather)."""
    variant = {key: value for key, value in (("scale", scale), ("window", window or None), ("sinks", sinks),
                                             ("kv_blocks", kv_blocks))
               if value is not None}  # only the variant's arguments (the plain call is Qwen3-MoE's)
    if tiled(numerics, q):  # fixed key blocks: the Triton kernel where numerics.triton serves it, else tiled.py
        return triton_batch.attention(q, k, v, positions, pad, numerics.triton, **variant)
    variant.pop("kv_blocks", None)
    return tree_attention(q, k, v, positions, pad, **variant)


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   pad: torch.Tensor, scale: Optional[float] = None, window: int = 0,
                   sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention by position. q [B, H, Tq, D]; k [B, KV, Tk, D], v [B, KV, Tk, Dv] (KV
    divides H: query head h reads kv head h // (H / KV)) in slot order with ``pad[b]`` padding
    slots before row b's first real key; positions [B, Tq] of the queries (`attention`: scale,
    window, sinks; a sink joins the softmax's max and, as one more term, its denominator).

    Keys are shifted left by ``pad`` so key index = position; a query at position p attends to
    indices ≤ p. Scores (over D), the softmax denominator and the weighted sum of values (over key
    indices) are :func:`tree_sum` reductions over a fixed index tree, so a KV-cache step and a full
    forward give the query the same bits. Queries run in chunks; a chunk reads only the keys up to
    its largest position (the keys past it are masked: exactly zero leaves of the key trees, which
    :func:`tree_sum` may drop), so a causal forward forms about half the B·H·T·T·D products, a
    chunk at a time. Both trees run over dim 0 in bit-reversed order (:func:`_halving_tree`)."""
    B, H, Tq, D = q.shape
    KV, Tk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    rep = H // KV
    scale = D ** -0.5 if scale is None else scale
    n_keys = int(positions.max()) + 1 if positions.numel() else 1
    if bool(pad.any()):  # row b's key j sits in slot pad[b] + j (clamped: past the end is future anyway)
        idx = (pad[:, None] + torch.arange(n_keys, device=k.device)[None, :]).clamp(max=Tk - 1)  # [B, n_keys]
        rows = torch.arange(B, device=k.device)[:, None]
        k, v = k[rows, :, idx].transpose(1, 2), v[rows, :, idx].transpose(1, 2)  # [B, KV, n_keys, D]
    else:
        k, v = k[:, :, :n_keys], v[:, :, :n_keys]
    Dp = _pow2_at_least(D)
    qt = _bits_first(q.reshape(B, KV, rep, Tq, D), -1, Dp)[..., None]  # [Dp, B, KV, rep, Tq, 1]
    kt = _bits_first(k, -1, Dp)[:, :, :, None, None, :]  # [Dp, B, KV, 1, 1, n_keys]
    per_query = Dp * B * H * max(n_keys, D)
    step = max(1, ATTENTION_CHUNK // per_query)
    outs = []
    for t0 in range(0, Tq, step):
        pos = positions[:, t0:t0 + step]
        nk = int(pos.max()) + 1
        scores = _halving_tree(qt[:, :, :, :, t0:t0 + step] * kt[..., :nk]) * scale  # [B, KV, rep, tq, nk]
        key_pos = torch.arange(nk, device=k.device)[None, None, None, None, :]
        future = key_pos > pos[:, None, None, :, None]
        if window:
            future = future | (key_pos <= pos[:, None, None, :, None] - window)
        scores = scores.masked_fill(future, float("-inf"))
        top = scores.amax(-1, keepdim=True)
        if sinks is not None:
            sink = sinks.to(scores.dtype).view(1, KV, rep, 1, 1)
            top = torch.maximum(top, sink)
        e = torch.exp(scores - top)
        Kp = _pow2_at_least(nk)
        et = _bits_first(e, -1, Kp)[..., None]  # [Kp, B, KV, rep, tq, 1]
        vt = _bits_first(v[:, :, :nk], 2, Kp)[:, :, :, None, None, :]  # [Kp, B, KV, 1, 1, Dv]
        denominator = _halving_tree(et)
        if sinks is not None:
            denominator = denominator + torch.exp(sink - top)
        outs.append(_halving_tree(et * vt) / denominator)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 3)
    return out.reshape(B, H, Tq, Dv)
