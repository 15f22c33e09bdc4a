"""The ``batch`` numerics level's kernels: every call has a fixed shape, so a row's bits depend only
on that row (and, for attention, its prefix), not on its batch, padding, micro-batch or KV cache.

- GEMMs (:func:`tiled_mm`): a row's bits are those of its weight's fixed row tile, the row computed
  in a [T, K] · [K, Nb] call, T = ``row_calls.row_tile`` ``(K, N)`` (:data:`ROW_TILE` rows for wide
  layers, up to :data:`MAX_ROW_TILE` for narrow ones, where a call's fixed cost outweighs its
  arithmetic), Nb a column block of ``row_calls.column_blocks`` (a large weight's columns cut so a
  block fits a core's L2: the LM head's 32 MB weight was streamed from memory once per row tile),
  column block outer. Both are functions of the weight's shape alone. The calls actually made take
  the heights of the weight's ``row_calls.row_plan``: the heights this machine's GEMM was measured
  to give every row the tile's bits at (a probe per call shape, dtype and thread count: on MKL a
  decode step's 2 rows in a 4-row call, a scoring run's 42 in one call), the tile itself where no
  other height does. A row's position inside its call does not change its bits (a GEMM reduces
  each output element over K in an order that depends on the shape, not the row index; checked on
  the default, AVX2 and native kernels in ``tests/unit/test_numerics_levels.py``). A weight of fewer
  than :data:`MIN_COLUMNS` output columns (a router over 8 experts) is computed as the first columns
  of its zero-padded copy (MKL's narrowest kernels kept no height but the tile). One batched call
  over all tiles is *not* used: with two threads MKL splits a lone tile's K across the threads but
  not a batch's (different bits for the same row, measured).
- Attention (:func:`block_attention`): queries in tiles of ROW_TILE, keys indexed by position in
  blocks of :data:`KEY_BLOCK`; each (query tile, key block) pair is one fixed-shape batched product
  for the scores and one for the weighted values, and the blocks are combined in block order by
  the online softmax (running max, rescaled sums). A query at position p reads blocks 0..p // KEY_BLOCK
  in a KV-cache decode step and in a causal full forward alike. In a forward of several query
  tiles a block wholly in the future of every query of a tile is skipped for that tile (it would
  add exact zeros: its weights are exp(−inf) = 0 and its rescale factor exp(0) = 1), so a causal
  forward does about half the work; the tiles that read a block are gathered (``index_select``)
  into one batched call. A decode step (one query tile per head) instead computes every key block
  of every head in one batched product each for the scores and the weighted values, the softmax's
  elementwise work once over all blocks, then combines the blocks in block order
  (:func:`_decode_forward`; a block in a shorter row's future enters as those exact identities):
  a fixed number of calls per step instead of a dozen per key block (a 2048-key step 3.3 → 2.2 ms). A block's mask
  is gathered from constant tables (an additive −inf bias, a 0/1 factor after the clamped exp:
  :func:`_block_mask`), and the block-sized buffers are reused across blocks. Every product is
  written through ``out=`` into a buffer the call allocated, and only those are changed in place
  (selective recompute keeps default-overload GEMM outputs only: `model/recompute.py`).
  A lone tile (a decode step's rep query heads of a kv head) takes the smallest height from its
  live rows up whose products give them the ROW_TILE-row bits (``row_calls.query_tile``, probed:
  4 rows instead of 16 for 2 heads on MKL), the same bits in a quarter of the work.
  The softmax's elementwise work runs only on a tile's live rows (a decode step's rep rows) and the
  block's visible key columns; everything derived from positions and padding alone is a plan built
  once per forward and reused by the layers (:func:`_plan`).
- The backward of a tiled GEMM is one plain GEMM per gradient (:class:`_TiledMM`): gradients sum
  over the batch, so no tiling makes them batch invariant, and autograd through every tile cost
  as many small ops as the forward. The weight gradient comes in the weight's layout, written
  into the optimizer's zeroed gradient buffer where it grants the claim (`fp4/grad_fusion.py`).
- Row sums (:func:`row_sum`: RMSNorm's mean square, softmax denominators) are ATen's ``sum`` on
  contiguous rows, a lone row beside a zero row, so each row is reduced alone by one thread in
  the same kernel whatever the row count.
"""
from __future__ import annotations

import functools
import threading
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_fp4.fp4.block_attention_grad import attention_backward
from megatron_fp4.fp4.grad_fusion import claim_fused, finish_fused, fused_grad_of
from megatron_fp4.fp4.row_calls import (BATCHED_MAX_HEIGHT, KEY_BLOCK, MAX_ROW_TILE, MIN_COLUMNS,  # noqa: F401
                                        ROW_TILE, RowPlan, column_blocks, fixed_plan, onednn_calls, onednn_linear,
                                        onednn_pack, query_tile, row_plan, row_tile, tall_rows)
from megatron_fp4.fp4.row_stream import stream_linear, stream_pack

MIN_VALUE_COLUMNS = 16  # the weighted-value GEMM's width at least (`block_attention`)


def value_width(dv: int) -> int:
    """Dw: the value columns block attention's weighted-value product reads (``dv`` values and zero
    columns to MIN_VALUE_COLUMNS − 1), before the ones column that sums the weights."""
    return max(dv, MIN_VALUE_COLUMNS - 1)

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)  # the grouped backward's dx


def _padded_rows(x2: torch.Tensor, height: int) -> torch.Tensor:
    """``x2`` [M, K] with zero rows appended to ``height`` rows (a fresh contiguous buffer), or
    ``x2`` itself where it has that height and is contiguous."""
    M = x2.shape[0]
    if height == M:
        return x2 if x2.is_contiguous() else x2.contiguous()
    return F.pad(x2, (0, 0, 0, height - M))


def _tiled_forward(x2: torch.Tensor, wt: torch.Tensor, packs: Optional[dict] = None) -> torch.Tensor:
    """The forward of :func:`tiled_mm` (no autograd): ``wt`` [K, N] the transpose of a row-major
    [N, K]. The rows padded to a height of the weight's :func:`row_plan` (the fixed tile's bits in
    fewer, fuller calls where the machine's GEMM gives them, `row_calls.py`), the calls' products
    written in place into one output (no concatenating copy). ``packs``: where a weight's oneDNN
    packed copy is kept (:func:`_onednn_weight`). A weight of fewer than MIN_COLUMNS output columns is
    computed as the first columns of its zero-padded MIN_COLUMNS-column copy: MKL's kernels for a
    narrower one round a row by its call's height (8 columns: no height but the fixed tile, up to
    128 rows, gave the tile's bits; 16: every multiple of 4, measured), so a decode step's router
    call would pad its rows to a 128-row tile."""
    M = x2.shape[0]
    K, N = wt.shape
    if N < MIN_COLUMNS:  # a narrow weight (a router's few experts): the first N columns of a wider one
        w = wt.t()  # (the padded copy kept in a rollout model's store, made per call elsewhere)
        pad = functools.partial(_zero_padded_rows, rows=MIN_COLUMNS)
        wide = pad(w) if packs is None else _kept(w, packs, "zero-padded", pad)
        return _tiled_forward(x2, wide.t())[:, :N].contiguous()
    plan = row_plan(K, N, x2.dtype, x2.device)
    out = _row_products(_padded_rows(x2, plan.height(M)), wt, None, plan, packs)
    return out[:M] if out.shape[0] != M else out


def _onednn_weight(w: torch.Tensor, packs: Optional[dict]) -> torch.Tensor:
    """What a oneDNN call reads for the row-major weight ``w``: its packed copy, made once per weight
    version and kept in ``packs`` (``Numerics.weight_packs``: a rollout model's weight cache), or
    ``w`` itself (no store). The same bits either way (`row_calls.row_plan` keeps oneDNN only where
    both forms agree). Kept as :func:`_kept` keeps it."""
    return w if packs is None else _kept(w, packs, "oneDNN pack", onednn_pack)


def _kept(w: torch.Tensor, packs: dict, tag: str, make) -> torch.Tensor:
    """``make(w)``, kept in ``packs`` under ``tag`` and made again only when ``w`` changes.

    An entry is keyed by ``w``'s memory and guarded by its version counter (an inference tensor has
    none and cannot change outside inference mode: the rollout stores are cleared at every weight
    load) and by a weak reference to that memory's storage (its Python object lives exactly as long
    as the memory, whatever views reach it: a weight comes here as a fresh view per call, and views
    made under inference mode have no ``_base``). When the memory is freed the entry goes with it,
    so a temporary (a contiguous or converted copy made per call) never piles up in a store kept
    across calls, and a new tensor at a freed one's address cannot meet its copy."""
    owner = w.untyped_storage()
    key = (w.data_ptr(), tuple(w.shape), w.stride(), w.dtype, w.device, tag)
    version = None if w.is_inference() else w._version
    hit = packs.get(key)
    if hit is not None and hit[0]() is owner and hit[1] == version:
        return hit[2]
    made = make(w)
    try:  # the store held weakly where it can be (`numerics.WeightStore`): a dropped store goes at once
        store = weakref.ref(packs)
    except TypeError:  # a plain dict: the callback holds it (freed by the cyclic GC if dropped uncleared)
        def store(packs=packs):
            return packs

    def forget(ref, key=key, store=store):
        entries = store()
        if entries is not None and entries.get(key, (None,))[0] is ref:
            del entries[key]

    packs[key] = (weakref.ref(owner, forget), version, made)
    return made


def _transposed(w: torch.Tensor) -> torch.Tensor:
    """The contiguous transpose of ``w`` [..., n, k]: [..., k, n] (``RowPlan.transposed_copy``'s operand)."""
    return w.transpose(-1, -2).contiguous()


def _zero_padded_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    """``w`` [n, k] with zero rows appended to ``rows`` rows (a fresh contiguous tensor)."""
    return torch.cat([w, w.new_zeros(rows - w.shape[0], w.shape[1])])


def _row_products(xp: torch.Tensor, wt: torch.Tensor, out: Optional[torch.Tensor], plan: RowPlan,
                  packs: Optional[dict] = None) -> torch.Tensor:
    """``out = xp @ wt`` (``xp`` [R, K], R a height of ``plan``; ``out`` [R, N] rows of a row-major
    [·, N], or None: a fresh one), returned: one [h, K] · [K, Nb] call per call height h of
    ``plan.calls(R)`` and column block (:func:`column_blocks`), each written into its place in ``out``.
    The column block is the outer loop: a weight block stays in cache across the row calls (their
    views made once, by ``split``). A oneDNN plan makes its calls over the whole weight (oneDNN
    blocks it itself; the heights past its probed ones verified, `row_calls.onednn_calls`), each
    product copied into its rows of ``out``. One call (R within the cap, one
    block: a decode step's) is made straight, its product the output where none was given. An ``mm``
    plan with ``transposed_copy`` reads, given a store ``packs``, the weight's contiguous transposed
    copy kept there (:func:`_kept`, :func:`_transposed`; ``wt`` already contiguous: that copy)."""
    if plan.kernel == "onednn":
        if plan.stream and packs is not None and xp.shape[0] <= plan.stream and xp.stride(-1) == 1 \
                and (out is None or out.stride(-1) == 1):  # a decode step's few rows: the row-streaming kernel
            return stream_linear(xp, _kept(wt.t(), packs, "row-stream pack", stream_pack), wt.shape[1], out)
        # taller calls (a prefill's): oneDNN, on its packed copy where the streaming kernel does not
        # serve the plan (where it does, the dense weight: the store keeps one copy of a weight, not two)
        w = _onednn_weight(wt.t(), None if plan.stream else packs)
        calls = onednn_calls(plan, *wt.shape, xp.dtype, w.is_mkldnn, xp.shape[0])
        if len(calls) == 1:
            y = onednn_linear(xp, w)
            return y if out is None else out.copy_(y)
        out = xp.new_empty(xp.shape[0], wt.shape[1]) if out is None else out
        for xt, ot in zip(xp.split(calls), out.split(calls)):
            ot.copy_(onednn_linear(xt, w))
        return out
    if plan.transposed_copy and packs is not None and not wt.is_contiguous():
        wt = _kept(wt.t(), packs, "transposed", _transposed)
    if plan.one_call(xp.shape[0]) and len(column_blocks(*wt.shape)) == 1:
        return torch.mm(xp, wt) if out is None else torch.mm(xp, wt, out=out)
    out = xp.new_empty(xp.shape[0], wt.shape[1]) if out is None else out
    calls = plan.calls(xp.shape[0])
    rows = xp.split(calls)
    for j, width in column_blocks(*wt.shape):
        w = wt if width == wt.shape[1] else wt[:, j:j + width]
        for xt, ot in zip(rows, (out if width == out.shape[1] else out[:, j:j + width]).split(calls)):
            torch.mm(xt, w, out=ot)
    return out


class _TiledMM(torch.autograd.Function):
    """``x2 @ wᵀ`` (``w`` [N, K] row-major). Forward: the fixed row tiles' bits (:func:`_tiled_forward`) per
    column block; backward: one GEMM per gradient (the gradients sum over the batch anyway, so their
    bits are not batch invariant at any tiling). The weight gradient is ``dyᵀ · x`` in ``w``'s own
    layout (contiguous [N, K]: autograd's accumulation into the parameter's gradient is a contiguous
    add), written straight into the optimizer's zeroed gradient buffer when it grants the claim
    (`fp4/grad_fusion.py`), with the bits of that accumulation."""

    @staticmethod
    def forward(ctx, x2, w, packs):
        ctx.save_for_backward(x2, w)
        ctx.fused = fused_grad_of(w, ctx.needs_input_grad[1])
        return _tiled_forward(x2, w.t(), packs)

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        dx = torch.mm(dy, w) if ctx.needs_input_grad[0] else None
        dest = claim_fused(ctx)
        dw = None
        if dest is not None:
            torch.mm(dy.t(), x2, out=dest)
            finish_fused(dest)
        elif ctx.needs_input_grad[1]:
            dw = torch.mm(dy.t(), x2)
        return dx, dw, None


def _tiled_linear2d(x2: torch.Tensor, w: torch.Tensor, packs: Optional[dict] = None) -> torch.Tensor:
    """``x2`` [M, K] @ ``w``ᵀ (``w`` [N, K]) by :func:`_tiled_forward`, through :class:`_TiledMM` with
    autograd. The weight is made row-major first (a GEMM kernel is chosen by layout as well as shape,
    and picks other bits); the parameter itself reaches :class:`_TiledMM` (its fused gradient)."""
    if not w.is_contiguous():
        w = w.contiguous()
    if torch.is_grad_enabled() and (x2.requires_grad or w.requires_grad):
        return _TiledMM.apply(x2, w, packs)
    return _tiled_forward(x2, w.t(), packs)


def tiled_mm(x2: torch.Tensor, wt: torch.Tensor, packs: Optional[dict] = None) -> torch.Tensor:
    """``x2`` [M, K] @ ``wt`` [K, N] with the bits of one [T, K] · [K, Nb] call per row tile and column
    block (T = :func:`row_tile`, Nb = :func:`column_blocks`; calls of the heights of :func:`row_plan`,
    :func:`_tiled_forward`; the backward is one plain GEMM per gradient,
    :class:`_TiledMM`: it is not batch invariant). The operands' memory layouts are made canonical
    (row-major tiles, ``wt`` the transpose of a row-major [N, K]): a GEMM kernel is chosen by layout
    as well as shape, and picks other bits. ``packs``: where oneDNN's packed weights are kept
    (``Numerics.weight_packs``; the same bits without)."""
    return _tiled_linear2d(x2, wt.t(), packs)


def row_sum(t: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """Sum over the last dim by ATen's ``sum`` on rows [R, N], each row reduced alone: with two or
    more output elements ATen splits a reduction over its outputs (threads take whole rows), with one
    it splits the row itself across threads, so a lone row is summed beside a zero row (the same
    kernel path for 1 row and many). A row's bits then depend only on the row (and N, the build)."""
    rows = t.reshape(-1, t.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    if rows.shape[0] == 1:
        out = torch.cat([rows, rows.new_zeros(1, rows.shape[1])]).sum(-1)[:1]
    else:
        out = rows.sum(-1)
    return out.view(*t.shape[:-1], 1) if keepdim else out.view(t.shape[:-1])


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 packs: Optional[dict] = None) -> torch.Tensor:
    """``F.linear`` by :func:`tiled_mm` (the bias added after, elementwise)."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out = _tiled_linear2d(x2, weight, packs)
    if x.dim() != 2:
        out = out.view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def tiled_grouped_linear(x: torch.Tensor, weights, counts, packs: Optional[dict] = None) -> torch.Tensor:
    """Consecutive runs of ``counts[e]`` rows of ``x`` times ``weights[e]ᵀ``, each run tiled alone.
    ``weights``: a list, or a stacked [E, out, in] tensor (with autograd: :class:`_TiledGroupedLinear`)."""
    if isinstance(weights, torch.Tensor) and torch.is_grad_enabled() and (x.requires_grad or weights.requires_grad):
        return _TiledGroupedLinear.apply(x, weights, tuple(int(n) for n in counts), packs)
    return _grouped_tiles(x, weights, [int(n) for n in counts], packs=packs)


LAYOUT_LIST_ROWS = 256  # a GroupedRows of at most this many rows builds its index from a Python list
# grouped runs of more rows than this (a scoring pass's, a training forward's) are read in place
# (`_runs_in_place`; both GEMMs of the no-grad expert MLP on oneDNN plans), fewer (a decode step's)
# laid out padded once (`GroupedRows`: one pad and one gather beat a copy per run there)
IN_PLACE_ROWS = 256


@functools.lru_cache(maxsize=256)
def _span_table(plans: tuple) -> tuple:
    """The span of a run of n rows under ``plans`` (the largest of their heights; 0 for none), for
    n = 0 .. the smallest cap: a lookup instead of a height per plan and run on every call."""
    return (0,) + tuple(max(p.height(n) for p in plans) for n in range(1, min(p.cap for p in plans) + 1))


class GroupedRows:
    """Runs of ``counts[e]`` rows laid out one after the other, run e over ``spans[e]`` rows (its
    height in every GEMM that reads the layout: the largest of their :class:`RowPlan` heights for
    ``counts[e]`` rows), zero rows after each run's own: ``starts[e]``, the padded height ``at``,
    and ``rows`` (run e's row i sits at ``starts[e]`` + i; None when no run needs padding).
    :meth:`pad` and :meth:`unpad` move rows in and out of it, once for both GEMMs of an expert MLP
    (:func:`tiled_grouped_mlp`) instead of once per GEMM."""

    __slots__ = ("counts", "spans", "starts", "at", "rows")

    def __init__(self, counts, plans, device):
        self.counts = [int(n) for n in counts]
        table = _span_table(tuple(plans))
        top = len(table)
        self.spans = [table[n] if n < top else max(p.height(n) for p in plans) for n in self.counts]
        self.starts, at = [], 0
        for span in self.spans:
            self.starts.append(at)
            at += span
        self.at, self.rows = at, None
        rows = sum(self.counts)
        if at != rows and rows <= LAYOUT_LIST_ROWS:  # few rows (a decode step's): one small tensor from a list
            self.rows = torch.tensor([start + i for n, start in zip(self.counts, self.starts) for i in range(n)],
                                     device=device)
        elif at != rows:  # padding rows after the runs' rows: run e's row i goes to its start + i
            shift, first = [], 0
            for n, start in zip(self.counts, self.starts):
                shift.append(start - first)
                first += n
            shift_counts = torch.tensor([shift, self.counts], device=device)
            self.rows = torch.arange(first, device=device) + torch.repeat_interleave(
                shift_counts[0], shift_counts[1], output_size=first)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [sum(counts), K] in the layout: a fresh [at, K] buffer, zero rows after each run's
        rows copied in."""
        if self.rows is None:
            return x.new_empty(self.at, x.shape[1]).copy_(x)
        return x.new_zeros(self.at, x.shape[1]).index_copy_(0, self.rows, x)

    def unpad(self, yp: torch.Tensor) -> torch.Tensor:
        """The runs' rows of ``yp`` [at, N], gathered back to [sum(counts), N]."""
        return yp if self.rows is None else yp.index_select(0, self.rows)


def _grouped_tiles(x: torch.Tensor, weights, counts: list, plan: Optional[RowPlan] = None,
                   packs: Optional[dict] = None) -> torch.Tensor:
    """The forward of :func:`tiled_grouped_linear`: every run's rows copied once into one zeroed
    buffer, each run padded to its height (:class:`GroupedRows`), the run's calls of the weight's
    :func:`row_plan` per column block into one output (:func:`_run_tiles`), the runs' rows gathered
    back (instead of a pad, an output and a concatenation per run). ``plan``: another plan than
    :func:`row_plan`'s (only for measuring one: ``bench_batch_invariant.py --expert-tiles``)."""
    n_out = weights[0].shape[0]
    if not any(counts):
        return x.new_zeros(0, n_out)
    if n_out < MIN_COLUMNS:  # narrow weights: the first columns of their zero-padded copies (`_tiled_forward`)
        wide = [_zero_padded_rows(w, MIN_COLUMNS) for w in weights]
        return _grouped_tiles(x, wide, counts, plan, packs)[:, :n_out].contiguous()
    plan = row_plan(x.shape[1], n_out, x.dtype, x.device) if plan is None else plan
    if sum(counts) > IN_PLACE_ROWS:
        return _runs_in_place(x, weights, counts, plan, packs)
    layout = GroupedRows(counts, (plan,), x.device)
    return layout.unpad(_run_tiles(layout.pad(x), weights, layout, plan, packs))


def _runs_in_place(x: torch.Tensor, weights, counts: list, plan: RowPlan,
                   packs: Optional[dict] = None) -> torch.Tensor:
    """:func:`_grouped_tiles` for many rows (a scoring pass's, a training forward's): each run's rows
    read and written in place — its whole cap-row calls and the rest cut to a multiple of the plan's
    quantum, calls of heights of the plan straight on ``x``'s rows into the output's — and only the
    run's last ``n mod quantum`` rows (or a run shorter than the plan's minimum) copied into a
    zero-padded call of the plan's height. Every call is one the plan allows, so every row has the
    bits the padded layout gives it (a row's bits do not depend on the other rows of a call of such a
    height), without a pad of every row and a gather of every output row (~1.3 ms a grouped GEMM of
    1536 rows at hidden 256) for one more weight pass per run with a tail. A oneDNN plan reads even
    the padding rows in place (:func:`_onednn_runs`)."""
    x = x if x.is_contiguous() else x.contiguous()
    out = x.new_empty(x.shape[0], weights[0].shape[0])
    if plan.kernel == "onednn":
        return _onednn_runs(x, weights, counts, plan, packs, out)
    K = x.shape[1]
    start = 0
    for wt, n in zip(_run_operands(weights, plan, packs), counts):
        if not n:
            continue
        body = plan.whole(n)
        if body:
            _row_products(x[start:start + body], wt, out[start:start + body], plan, packs)
        if body < n:
            tail = n - body
            xt = x.new_zeros(plan.height(tail), K)
            xt[:tail] = x[start + body:start + n]
            out[start + body:start + n] = _row_products(xt, wt, None, plan, packs)[:tail]
        start += n
    return out


def _onednn_runs(x: torch.Tensor, weights, counts: list, plan: RowPlan, packs: Optional[dict],
                 out: torch.Tensor) -> torch.Tensor:
    """:func:`_runs_in_place` on a oneDNN plan: each run's calls (:func:`_row_products` at the height
    its padded layout takes) read ``x`` [R, K] (contiguous) from the run's first row on, the rows past
    the run's own in a call being the next runs' rows instead of zeros, and write the products into
    ``out``'s rows from the run's first on (the rows past the run's own are the next runs', which
    write theirs after it). A row's bits do not depend on the other rows of a call of a height the
    plan allows (the probe and the verification put random rows there, aligned and misaligned), so
    every row has the padded layout's bits, without a zero-filled copy of every row (a scoring pass's
    6144 expert rows at hidden 1024: 25 MiB written, ~4 % of the pass); only a run whose calls would
    pass ``x``'s last row reads a zero-padded copy of its rows."""
    total, start = x.shape[0], 0
    for wt, n in zip(_run_operands(weights, plan, packs), counts):
        if not n:
            continue
        height, end = plan.height(n), start + n
        if start + height <= total:
            _row_products(x[start:start + height], wt, out[start:start + height], plan, packs)
        else:
            out[start:end] = _row_products(_padded_rows(x[start:end], height), wt, None, plan, packs)[:n]
        start = end
    return out


def _run_tiles(xp: torch.Tensor, weights, layout: GroupedRows, plan: RowPlan,
               packs: Optional[dict] = None) -> torch.Tensor:
    """``xp`` [at, K] in ``layout`` times each run's ``weights[e]ᵀ`` -> [at, N]: over the first
    ``plan.height(counts[e])`` rows of run e's span, the calls :func:`tiled_mm` of the run alone
    makes (:func:`_row_products`: the same shapes and output row stride, the weight (block) the
    transpose of a row-major [Nb, K]), so a row's bits are those of its run alone. Rows of a span
    past that height (another GEMM's plan set the span) are zeros."""
    n_out = weights[0].shape[0]
    table = _span_table((plan,))
    heights = [table[n] if n < len(table) else plan.height(n) for n in layout.counts]
    out = (xp.new_empty if heights == layout.spans else xp.new_zeros)(layout.at, n_out)
    wts = _run_operands(weights, plan, packs)
    if plan.batched and isinstance(wts, torch.Tensor) and xp.is_contiguous():
        return _batched_runs(xp, wts, out, layout, heights, plan, packs)
    x_runs, out_runs = xp.split(layout.spans), out.split(layout.spans)
    for wt, xr, outr, n, height in zip(wts, x_runs, out_runs, layout.counts, heights):
        if not n:
            continue
        if height != xr.shape[0]:
            xr, outr = xr[:height], outr[:height]
        _row_products(xr, wt, outr, plan, packs)
    return out


def _run_operands(weights, plan: RowPlan, packs: Optional[dict]):
    """Each run's [K, N] operand of ``weights`` (a stacked [E, N, K] tensor or a list of [N, K]), in
    the form its ``mm`` reads: a stacked weight on a plan with ``transposed_copy`` and a store gives
    its experts' copies in one kept [E, K, N] (one lookup, :func:`_kept`), any other stacked weight
    its transposed view [E, K, N] (of a contiguous stack) — both indexable, as :func:`_batched_runs`
    slices them — and a list its weights' transposed views, made as they are read."""
    if isinstance(weights, torch.Tensor):
        if plan.transposed_copy and packs is not None:
            return _kept(weights, packs, "transposed", _transposed)
        return (weights if weights.is_contiguous() else weights.contiguous()).transpose(1, 2)
    return ((w if w.is_contiguous() else w.contiguous()).t() for w in weights)


def _batched_runs(xp: torch.Tensor, wts: torch.Tensor, out: torch.Tensor, layout: GroupedRows, heights: list,
                  plan: RowPlan, packs: Optional[dict]) -> torch.Tensor:
    """:func:`_run_tiles` on a plan with ``batched``: consecutive runs of one height h up to
    BATCHED_MAX_HEIGHT, each filling its span, computed in one ``bmm`` of their rows [G, h, K] and
    weights ``wts[e0:e1]`` (the stacked [E, K, N] operand: the transposed copy or the transposed
    view), which gives each run its own ``mm`` call's bits (the probe's finding); any other run by
    its own calls. A decode step's experts then cost one call per GEMM instead of one per expert."""
    K, N = xp.shape[1], out.shape[1]
    counts, spans, starts = layout.counts, layout.spans, layout.starts
    E, e = len(counts), 0
    while e < E:
        n, h = counts[e], heights[e]
        if not n:
            e += 1
            continue
        f = e + 1
        if h == spans[e] and h <= BATCHED_MAX_HEIGHT:
            while f < E and counts[f] and heights[f] == h and spans[f] == h:
                f += 1
        s = starts[e]
        if f - e > 1:
            rows = slice(s, s + (f - e) * h)
            torch.bmm(xp[rows].view(f - e, h, K), wts[e:f], out=out[rows].view(f - e, h, N))
        else:
            _row_products(xp[s:s + h], wts[e], out[s:s + h], plan, packs)
        e = f
    return out


def _grouped_grads(ctx, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, starts, counts,
                   dx: Optional[torch.Tensor]):
    """The backward of a grouped linear: run e (rows ``starts[e]`` .. + ``counts[e]`` of ``x`` and
    ``dy``) gives ``dx`` its rows (when not None) and ``dw[e]`` (zeros for a run without rows), one
    GEMM per expert and gradient; into the optimizer's zeroed gradient buffer when it grants the
    claim (`fp4/grad_fusion.py`: no weight-sized temporary, no accumulation pass). Returns dw, or
    None where it went to that buffer or is not needed."""
    dest = claim_fused(ctx)
    dw = None
    if ctx.needs_input_grad[1]:
        dw = dest if dest is not None else torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    for e, (start, n) in enumerate(zip(starts, counts)):
        if not n:
            if dw is not None and dest is None:
                dw[e].zero_()
            continue
        dys = dy.narrow(0, start, n)
        if dx is not None:
            torch.mm(dys, weight[e], out=dx.narrow(0, start, n))
        if dw is not None:
            torch.mm(dys.t(), x.narrow(0, start, n), out=dw[e])
            if dest is not None:
                finish_fused(dw[e])
    return None if dest is not None else dw


class _TiledGroupedLinear(torch.autograd.Function):
    """Forward: :func:`tiled_grouped_linear`'s tiles (the no-grad bits); backward: per expert one
    GEMM per gradient (not batch invariant, as in :class:`_TiledMM`)."""

    @staticmethod
    def forward(ctx, x, weight, counts, packs):
        ctx.save_for_backward(x, weight)
        ctx.counts = counts
        ctx.fused = fused_grad_of(weight, ctx.needs_input_grad[1])
        return tiled_grouped_linear(x, weight.unbind(0), counts, packs)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        starts = [0]
        for n in ctx.counts[:-1]:
            starts.append(starts[-1] + n)
        if ctx.needs_input_grad[0] and _GROUPED_MM is not None and x.device.type == "cpu" \
                and x.dtype == weight.dtype == dy.dtype == torch.float32 \
                and weight.shape[1] % 4 == weight.shape[2] % 4 == 0:
            # dx by one grouped GEMM (the per-expert GEMMs the loop below runs, one call: at an
            # expert's width 64 the loop's calls cost 1.4× its time, measured; its operands' rows
            # 16-byte multiples); dw stays per expert (into the optimizer's buffer when it grants the claim).
            offs = torch.tensor(ctx.counts, device=x.device).cumsum(0).to(torch.int32)
            dx = _GROUPED_MM(dy.contiguous(), weight, offs=offs)
            return dx, _grouped_grads(ctx, dy, x, weight, starts, ctx.counts, None), None, None
        # Every row belongs to one expert, so dx is written whole.
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if ctx.needs_input_grad[0] else None
        return dx, _grouped_grads(ctx, dy, x, weight, starts, ctx.counts, dx), None, None


def tiled_grouped_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts, act,
                      packs: Optional[dict] = None) -> torch.Tensor:
    """An expert MLP over consecutive runs of ``counts[e]`` rows of ``x``, without autograd:
    ``act(h) @ w2[e]ᵀ`` with ``h = x @ w13[e]ᵀ`` (``w13`` [E, F2, H], ``w2`` [E, H, F]; ``act``
    [·, F2] -> [·, F] row by row, e.g. SwiGLU), each GEMM the bits of :func:`tiled_grouped_linear`
    (each run's calls of its weight's :func:`row_plan`). The rows are laid out once
    (:class:`GroupedRows`, a run over the larger of its two heights) for both GEMMs and ``act``,
    which also runs on the padding rows (zeros in, zeros out: what the second GEMM's padded calls
    hold), instead of a pad and a gather per GEMM. Under autograd the saved tensors would hold the
    padding rows (a count that depends on the routing): use :func:`tiled_grouped_linear` there."""
    if torch.is_grad_enabled() and (x.requires_grad or w13.requires_grad or w2.requires_grad):
        raise ValueError("tiled_grouped_mlp runs without autograd (torch.no_grad / inference_mode); "
                         "with autograd use tiled_grouped_linear for each GEMM")
    if not any(int(n) for n in counts):
        return x.new_zeros(0, w2.shape[1])
    if min(w13.shape[1], w2.shape[1]) < MIN_COLUMNS:  # a narrow weight: its grouped linear pads it
        counts = [int(n) for n in counts]
        return _grouped_tiles(act(_grouped_tiles(x, w13.unbind(0), counts, packs=packs)), w2.unbind(0), counts,
                              packs=packs)
    p13 = row_plan(w13.shape[2], w13.shape[1], x.dtype, x.device)
    p2 = row_plan(w2.shape[2], w2.shape[1], x.dtype, x.device)
    if p13.kernel == p2.kernel == "onednn" and x.shape[0] > IN_PLACE_ROWS:  # a scoring pass's many rows:
        counts = [int(n) for n in counts]  # each GEMM's calls read their rows in place (`_onednn_runs`)
        return _runs_in_place(act(_runs_in_place(x, w13, counts, p13, packs)), w2, counts, p2, packs)
    layout = GroupedRows(counts, (p13, p2), x.device)
    h = _run_tiles(layout.pad(x), w13, layout, p13, packs)
    return layout.unpad(_run_tiles(act(h), w2, layout, p2, packs))


def _zero_padded(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` in a fresh contiguous buffer zero-padded along ``dim`` to a multiple of ``size`` (at
    least one): one ``F.pad`` call."""
    n, dim = t.shape[dim], dim % t.dim()
    full = max(1, -(-n // size)) * size
    if full == n:
        return t.contiguous()
    return F.pad(t, [0, 0] * (t.dim() - 1 - dim) + [0, full - n])


EXP_FLOOR = -87.0  # exp's argument floor in block attention: exp(−87) ≈ 1.6e-38 is a normal fp32 number


def _masks(hidden: torch.Tensor, dtype: torch.dtype) -> tuple:
    """(bias, keep) of a bool mask of hidden keys: −inf / 0 where hidden, 0 / 1 elsewhere."""
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill(hidden, float("-inf")), \
        (~hidden).to(dtype)


@functools.lru_cache(maxsize=None)
def _mask_tables(dtype: torch.dtype, device: torch.device, cols: int = KEY_BLOCK) -> tuple:
    """(bias, keep) [KEY_BLOCK + 1, cols]: row r + 1 masks the keys of a block past offset r
    (column c > r), row 0 the whole block: a gather of rows replaces a compare and two masked_fills
    over each block's scores. ``cols``: the block's first columns only (contiguous: the keys some
    query can see, `block_attention`). Constants (only read), built once per dtype, device and width."""
    r = torch.arange(-1, KEY_BLOCK, device=device)[:, None]
    return _masks(torch.arange(cols, device=device)[None, :] > r, dtype)


def _block_mask(pj: torch.Tensor, j: int, window: int, dtype: torch.dtype, cols: int = KEY_BLOCK,
                out=None) -> tuple:
    """(bias, keep) [n, rows, cols] of the first ``cols`` keys of key block ``j`` for the query
    positions ``pj`` [n, rows]: bias −inf and keep 0 on the keys a query does not see (its future;
    with a ``window`` also those at or before position − window), 0 and 1 on the others. ``out``:
    two flat buffers of at least n·rows·cols elements to write them into."""
    if window:  # a sliding window: two bounds per query
        key_pos = torch.arange(j * KEY_BLOCK, j * KEY_BLOCK + cols, device=pj.device)
        hidden = (key_pos > pj[..., None]) | (key_pos <= pj[..., None] - window)
        return _masks(hidden, dtype)
    tables = _mask_tables(dtype, pj.device, cols)
    row = (pj - (j * KEY_BLOCK - 1)).clamp_(0, KEY_BLOCK).reshape(-1)  # offset in the block + 1
    shape = (*pj.shape, cols)
    if out is None:
        return tuple(t.index_select(0, row).view(shape) for t in tables)
    n = row.shape[0] * cols
    return tuple(torch.index_select(t, 0, row, out=o[:n].view(-1, cols)).view(shape) for t, o in zip(tables, out))


@functools.lru_cache(maxsize=16)
def _value_tail(rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[rows, width] zeros with a last column of ones: the columns block attention appends to the
    gathered values (`_Plan.tail`), built once per shape (a constant: only read)."""
    tail = torch.zeros(rows, width, dtype=dtype, device=device)
    tail[:, -1] = 1.0
    return tail


@functools.lru_cache(maxsize=64)
def _arange(n: int, device: torch.device) -> torch.Tensor:
    """``torch.arange(n)`` on ``device``, built once (a constant: only read)."""
    return torch.arange(n, device=device)


@functools.lru_cache(maxsize=64)
def _head_rows(batch: int, heads: int, per_head: int, device: torch.device) -> torch.Tensor:
    """[batch, heads, 1]: the first row of each (b, kv) head in :func:`_key_rows`' matrix, built once
    per shape (a decode step asks for the same one every step; a constant: only read)."""
    return (torch.arange(batch * heads, device=device) * per_head).view(batch, heads, 1)


def _key_rows(t: torch.Tensor) -> tuple:
    """(rows, per_head): ``t`` [B, KV, T, D] as a [R, D] matrix of its key rows, (b, kv)'s slot j at
    row (b·KV + kv)·per_head + j. A KV cache's filled prefix (a view of a [B, KV, capacity, D] buffer)
    is read in place, with per_head = capacity: no copy of the whole cache before the gather."""
    B, KV, T, D = t.shape
    s = t.stride()
    if s[3] == 1 and s[2] == D and s[1] % D == 0 and s[0] == KV * s[1] and B * KV > 0:
        per_head = s[1] // D
        return t.as_strided(((B * KV - 1) * per_head + T, D), (D, 1)), per_head
    return t.reshape(B * KV * T, D), T


MASK_CACHE_ELEMENTS = 1 << 20  # a plan keeps its blocks' masks up to this size (elements each), else builds them per call
PLANS_KEPT = 4  # plans remembered (layers of one forward with a window and without, a few concurrent callers)
_plans: list = []  # [(key, plan)], newest first; replaced whole, never mutated (threads may read it)


class _Block:
    """One key block of a plan: the tiles that read it (``sel``; None: every tile), their query
    positions ``pj`` [n, live] and (b, kv) heads ``oj``, the block's visible width ``cols`` and,
    when the plan keeps them, its masks (`_block_mask`)."""

    __slots__ = ("sel", "pj", "oj", "cols", "masks")

    def __init__(self, sel, pj, oj, cols):
        self.sel, self.pj, self.oj, self.cols, self.masks = sel, pj, oj, cols, None


class _Tall:
    """A plan's rows for :func:`_tall_forward`: every (b, kv) head's query rows position-major (row
    t·rep + g: query t of its g-th query head), padded to ``rows`` (a multiple of ROW_TILE, the
    padding rows at the head's last position), their positions ``pos`` [B·KV, rows]; key block j is
    read by rows ``starts[j]`` on of every head (a multiple of ROW_TILE: the first row of any head
    that sees the block; the positions rise along the rows, so the rows before it see none of it),
    over its ``cols`` visible keys; at most ``cap`` rows per product (`row_calls.tall_rows`); the
    blocks' masks kept when small (``masks``, else None)."""

    __slots__ = ("rows", "cap", "pos", "starts", "cols", "masks")

    @classmethod
    def of(cls, positions, B, KV, rep, Tq, nT, nK, n_keys, D, Dw, dtype, window) -> Optional["_Tall"]:
        """The rows of a forward, or None where its products or positions do not allow them."""
        cap = tall_rows(D, Dw + 1, dtype, positions.device)
        if cap < ROW_TILE or not bool((positions[:, 1:] >= positions[:, :-1]).all()):
            return None
        self = cls()
        R, rows = rep * Tq, nT * ROW_TILE
        pos = positions[:, None, :, None].expand(B, KV, Tq, rep).reshape(B * KV, R)
        if rows > R:
            pos = torch.cat([pos, pos[:, -1:].expand(B * KV, rows - R)], 1)
        firsts = (pos[:, :, None] < _arange(nK, pos.device) * KEY_BLOCK).sum(1).amin(0).tolist()
        self.rows, self.cap, self.pos = rows, cap, pos
        self.starts = [int(f) // ROW_TILE * ROW_TILE for f in firsts]
        self.cols = [min(KEY_BLOCK, n_keys - j * KEY_BLOCK) for j in range(nK)]
        self.masks = None
        if sum(B * KV * (rows - s) * c for s, c in zip(self.starts, self.cols)) <= MASK_CACHE_ELEMENTS:
            self.masks = [_block_mask(pos[:, s:], j, window, dtype, c)
                          for j, (s, c) in enumerate(zip(self.starts, self.cols))]
        return self


class _Plan:
    """What :func:`block_attention` derives from the positions and padding alone (the gathers'
    row indices, the query tiles' positions, which tiles read which key block, their masks): the
    same for every layer of a forward, so it is built once per forward (:func:`_plan`). Only read."""

    def __init__(self, positions, pad, B, KV, rep, Tq, Tk, k_rows, v_rows, D, Dv, dtype, vdtype, window):
        device = positions.device
        self.n_keys = n_keys = int(positions.max()) + 1 if positions.numel() else 1
        self.nK = nK = -(-n_keys // KEY_BLOCK)
        width = nK * KEY_BLOCK
        slot = torch.add(pad[:, None], _arange(width, device)).clamp_(max=Tk - 1)  # [B, width]
        self.R = R = rep * Tq  # query rows of a (b, kv) head
        self.nT = nT = max(1, -(-R // ROW_TILE))
        # A decode step (one query tile per (b, kv) head) gathers its keys block-major, [nK, B·KV,
        # KEY_BLOCK, ·]: key block j of every head is then one contiguous run, read by its products as
        # it is (the other layouts copy each block's [B·KV, KEY_BLOCK, ·] out of [B·KV, nK, ...]:
        # the same values in the same row-major operand, so the same bits).
        self.block_major = block_major = Tq == 1 and nT == 1 and nK > 1
        self.rows = self._rows(B, KV, k_rows, slot, block_major)
        self.v_at = self.rows if v_rows == k_rows else self._rows(B, KV, v_rows, slot, block_major)
        self.Dv = Dv
        self.Dw = Dw = value_width(Dv)
        self.tail = _value_tail(self.rows.shape[0], Dw + 1 - Dv, vdtype, device)  # zeros, ones column
        # The products run on whole fixed-shape tiles; the elementwise softmax work only on the
        # `live` leading rows of a tile (a decode step's rep rows, not its 16: the other rows are
        # zero padding, whose results are dropped) and on the key columns some query can see
        # (`cols`: the slots past the last position are in every query's future). The rest of the
        # weight tile is exact zeros, as the masks made it before, so every kept row gets the bits
        # of the whole-tile form: a GEMM row's result depends on that row of its left operand alone.
        self.live = live = R if nT == 1 else ROW_TILE
        # The query tile's height: ROW_TILE, or for a single tile (a decode step's rep rows) the
        # smallest height from `live` up whose products give its rows the ROW_TILE-row bits (probed,
        # `row_calls.query_tile`): the same bits in a quarter of a decode step's products.
        self.qt = query_tile(live, D, Dw + 1, dtype, device) if nT == 1 else ROW_TILE
        # Several tiles per head (a prefill, a scoring pass): where this machine's products give a
        # head's stacked tiles their own bits (`row_calls.tall_rows`) and the positions rise along
        # the queries, the heads' rows are read in place (`_Tall`) instead of by the tiles below.
        self.tall = _Tall.of(positions, B, KV, rep, Tq, nT, nK, n_keys, D, Dw, dtype, window) \
            if nT > 1 and not block_major else None
        # A decode step (one query tile per (b, kv) head): every key block of every tile in one pair
        # of products (`_decode_forward`), masked by one [nK, B·KV, 1, KEY_BLOCK] bias and factor
        # (a tile's rows are one query's heads: one position).
        self.decode = _decode_masks(positions, KV, nK, window, dtype) if Tq == 1 and nT == 1 else None
        if self.tall is not None or self.decode is not None:
            self.blocks = []
            return
        if nT * live == R:  # no padding rows (a decode step's tile: its rep rows): one copy
            flat_pos = positions[:, None, None, :].expand(B, KV, rep, Tq).reshape(-1, live)
        else:
            flat_pos = positions.new_zeros(B, KV, nT * live)  # padding rows: position 0 (key 0 only: finite)
            flat_pos[:, :, :R].view(B, KV, rep, Tq).copy_(positions[:, None, None, :].expand(B, KV, rep, Tq))
            flat_pos = flat_pos.view(-1, live)
        owner = torch.arange(B * KV, device=device).repeat_interleave(nT) if nT > 1 or nK > 1 else None
        last = flat_pos.amax(-1) if nK > 1 else None  # a tile reads key blocks 0..last // KEY_BLOCK
        self.blocks = []
        for j in range(nK):
            # Only the tiles with a query at or past the block's first key (sel; None: every tile): for
            # the others the block is wholly in the future (it would add exact zeros, rescaled by 1).
            sel = None
            if j:
                active = last >= j * KEY_BLOCK
                n = int(active.sum())
                if n == 0:
                    break
                if n < active.numel():
                    sel = active.nonzero().squeeze(1)
            heads = owner if sel is None else owner.index_select(0, sel)
            self.blocks.append(_Block(sel, flat_pos if sel is None else flat_pos.index_select(0, sel), heads,
                                      min(KEY_BLOCK, n_keys - j * KEY_BLOCK)))
        if sum(b.pj.numel() * b.cols for b in self.blocks) <= MASK_CACHE_ELEMENTS:
            for j, b in enumerate(self.blocks):
                b.masks = _block_mask(b.pj, j, window, dtype, b.cols)

    @staticmethod
    def _rows(B: int, KV: int, per_head: int, slot: torch.Tensor, block_major: bool) -> torch.Tensor:
        """The gather's row indices: (b, kv)'s slots ``slot[b]`` in :func:`_key_rows`' matrix, head-major
        [B·KV, width] or block-major [nK, B·KV, KEY_BLOCK], flat."""
        rows = torch.add(_head_rows(B, KV, per_head, slot.device), slot[:, None, :])
        if block_major:
            rows = rows.view(B * KV, -1, KEY_BLOCK).transpose(0, 1)
        return rows.reshape(-1)


def stamp(t: torch.Tensor) -> tuple:
    """What :func:`same_values` compares ``t`` by later: the tensor and its version (an inference
    tensor has none: a copy of it instead)."""
    return (t.clone(), None) if t.is_inference() else (t, t._version)


def same_values(mark: tuple, t: torch.Tensor) -> bool:
    """Whether ``t`` holds the values :func:`stamp` saw: the same object not written since (its
    version), or equal values in a saved tensor itself unwritten since (or a saved copy)."""
    saved, version = mark
    if version is not None and saved._version != version:
        return False
    if saved is t and version is not None:
        return True
    return saved.shape == t.shape and saved.device == t.device and bool(torch.equal(saved, t))


def _plan(positions, pad, *shape) -> _Plan:
    """The :class:`_Plan` of these positions, padding and shapes: a remembered one when positions
    and padding hold the values it was built for (:func:`same_values`: the layers of one forward
    pass the same objects) and the shapes are equal, else a new one (remembered: at most PLANS_KEPT)."""
    global _plans
    for key, plan in _plans:
        if key[2] == shape and same_values(key[0], positions) and same_values(key[1], pad):
            return plan
    plan = _Plan(positions, pad, *shape)
    _plans = [((stamp(positions), stamp(pad), shape), plan)] + _plans[:PLANS_KEPT - 1]
    return plan


class _DecodeBuffers:
    """A decode step's block-attention buffers of one shape (:func:`_decode_buffers`): the zero-padded
    query tiles once per key block [nK, B, KV, qt, D] (only their first rep rows are ever written),
    the scores and the value products of every block, and — made at the first step that gathers
    (one whose cache keeps no blocks of its own, `BlockedKV`) — the gathered keys and values (the
    values' zero columns and ones column written once). Each belongs to one thread and holds nothing
    a call returns (its output is a fresh division), so reusing them changes no bits: every op reads
    what the allocating form read."""

    __slots__ = ("queries", "scores", "products", "_gathered", "_shape")

    def __init__(self, q, k, v, plan):
        B, KV = k.shape[0], k.shape[1]
        D, Dv, Dw, nK = k.shape[-1], v.shape[-1], plan.Dw, plan.nK
        self.queries = q.new_zeros(nK, B, KV, plan.qt, q.shape[-1])
        self.scores = q.new_empty(nK * B * KV, plan.qt, KEY_BLOCK)
        self.products = v.new_empty(nK * B * KV, plan.qt, Dw + 1)
        # what the gather's buffers are made from (no tensor of the call: the cache stays unreferenced)
        self._gathered = None
        self._shape = (plan.rows.shape[0], D, Dv, Dw, k.dtype, v.dtype, k.device, plan.tail[:1].clone())

    def gathered(self) -> tuple:
        """(keys [rows, D], values [rows, Dw + 1]): the gather's buffers, made the first time."""
        if self._gathered is None:
            n_rows, D, Dv, Dw, kdtype, vdtype, device, tail = self._shape
            values = torch.empty(n_rows, Dw + 1, dtype=vdtype, device=device)
            values[:, Dv:] = tail
            self._gathered = (torch.empty(n_rows, D, dtype=kdtype, device=device), values)
        return self._gathered


DECODE_SHAPES_KEPT = 4  # decode-step buffer sets a thread keeps (shapes: batch, heads, key blocks, dtypes)
DECODE_BUFFER_ELEMENTS = 1 << 22  # a set's elements at most (16 MiB in fp32); a larger decode step allocates per call
_workspace = threading.local()  # a thread's {shape key: _DecodeBuffers}, oldest first


def _decode_buffers(q, k, v, plan) -> Optional[_DecodeBuffers]:
    """The calling thread's :class:`_DecodeBuffers` for this decode step's shapes, dtypes, device
    and inference mode (made the first time; at most DECODE_SHAPES_KEPT kept, the oldest dropped),
    or None for a step whose buffers would exceed DECODE_BUFFER_ELEMENTS: kept across calls they
    would hold memory a long generation's steps of other shapes need (at that size the allocation
    is a small part of the step), so such a step allocates its own, as a prefill does."""
    tiles, D, Dw = q.shape[0] * k.shape[1], k.shape[-1], plan.Dw
    if plan.rows.shape[0] * (D + Dw + 1) + tiles * plan.qt * plan.nK * (D + KEY_BLOCK + Dw + 1) > \
            DECODE_BUFFER_ELEMENTS:
        return None
    key = (tuple(q.shape), k.shape[:2], k.shape[-1], v.shape[-1], plan.rows.shape[0], plan.Dw, plan.qt, q.dtype,
           k.dtype, v.dtype, q.device, torch.is_inference_mode_enabled())
    kept = getattr(_workspace, "kept", None)
    if kept is None:
        kept = _workspace.kept = {}
    bufs = kept.get(key)
    if bufs is None:
        if len(kept) >= DECODE_SHAPES_KEPT:
            del kept[next(iter(kept))]
        bufs = kept[key] = _DecodeBuffers(q, k, v, plan)
    return bufs


class BlockedKV:
    """A static KV cache's keys and values by key index, in a decode step's block-major layout: keys
    [nK, B·KV, KEY_BLOCK, D], values [nK, B·KV, KEY_BLOCK, Dw + 1] (their zero columns and ones
    column, `_Plan.tail`, written once), key j of row b at block j // KEY_BLOCK, slot j % KEY_BLOCK —
    what a decode step's gather (`_block_forward`) copies out of the cache, kept up to date by
    :meth:`append` as the cache fills (`cache_blocks`), so a decode step reads it in place instead of
    copying every cached key of every layer at every step. The slots past a row's last key hold
    zeros where the gather held copies of other keys: both are masked, their weights exactly 0, so
    a step's bits are the gather's. Its writes are copies (no arithmetic)."""

    def __init__(self, B: int, KV: int, capacity: int, D: int, Dv: int, kdtype, vdtype, device, pad: torch.Tensor):
        self.B, self.KV, self.D, self.Dv = B, KV, D, Dv
        self.Dw = Dw = value_width(Dv)
        self.nK = nK = -(-capacity // KEY_BLOCK)
        n = nK * B * KV * KEY_BLOCK  # rows; one more at the end takes the padding slots' writes (never read)
        self._k = torch.zeros((n + 1) * D, dtype=kdtype, device=device)
        self._v = torch.zeros((n + 1) * (Dw + 1), dtype=vdtype, device=device)
        self.keys = self._k[:n * D].view(nK, B * KV, KEY_BLOCK, D)
        self.values = self._v[:n * (Dw + 1)].view(nK, B * KV, KEY_BLOCK, Dw + 1)
        self.values[..., Dw] = 1.0
        self.filled, self.pad = 0, stamp(pad)  # the leading padding its key indices are for (`same_values`)

    def append(self, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor, past: int) -> None:
        """Cache slots ``past`` .. + T (``k`` [B, KV, T, D], ``v`` [B, KV, T, Dv]) of rows with ``pad``
        leading padding slots: slot s of row b is its key s − pad[b] (a padding slot's write goes to
        the spare row)."""
        B, KV, T, D = k.shape
        rows = _mirror_rows(B, KV, T, past, pad, self.keys.numel() // D)
        self._k.view(-1, D).index_copy_(0, rows, k.reshape(-1, D))
        self._v.view(-1, self.Dw + 1)[:, :self.Dv].index_copy_(0, rows, v.reshape(-1, self.Dv))
        self.filled = past + T

    def serves(self, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor, nK: int, Dw: int) -> bool:
        """Whether a step over ``k``, ``v`` (the cache's filled prefix) with ``pad`` reads these blocks:
        the same shapes, every cached slot appended, the same padding."""
        B, KV, Tk, D = k.shape
        return (B, KV, D, v.shape[-1], Dw) == (self.B, self.KV, self.D, self.Dv, self.Dw) and nK <= self.nK \
            and Tk == self.filled and k.dtype == self.keys.dtype and v.dtype == self.values.dtype \
            and same_values(self.pad, pad)


_last_rows: tuple = ()  # (key, rows) of the last `_mirror_rows` call: every layer of a step asks for the same


def _mirror_rows(B: int, KV: int, T: int, past: int, pad: torch.Tensor, n: int) -> torch.Tensor:
    """The rows of a :class:`BlockedKV`'s [n + 1, ·] storage that cache slots ``past`` .. + T of rows
    with ``pad`` leading padding slots go to, in (b, kv, t) order (row n: a padding slot's). A decode
    step's (T = 1) from a list, remembered for the next layer's call with the same step and padding."""
    global _last_rows
    if T == 1 and B * KV <= 4096:
        pads = pad.tolist()
        key = (B, KV, past, n, tuple(pads), pad.device)
        if _last_rows and _last_rows[0] == key:
            return _last_rows[1]
        rows = []
        for b, p in enumerate(pads):
            j = past - p
            for kv in range(KV):
                rows.append(n if j < 0 else (j // KEY_BLOCK) * (B * KV * KEY_BLOCK) + (b * KV + kv) * KEY_BLOCK
                            + j % KEY_BLOCK)
        out = torch.tensor(rows, device=pad.device)
        _last_rows = (key, out)
        return out
    j = torch.arange(past, past + T, device=pad.device)[None, :] - pad[:, None]  # [B, T] key indices
    head = torch.arange(B * KV, device=pad.device).view(B, KV, 1) * KEY_BLOCK
    rows = (j // KEY_BLOCK)[:, None, :] * (B * KV * KEY_BLOCK) + head + (j % KEY_BLOCK)[:, None, :]
    return torch.where((j >= 0)[:, None, :], rows, n).reshape(-1)


def cache_blocks(cache, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor, past: int) -> Optional[BlockedKV]:
    """The :class:`BlockedKV` of a static ``cache`` (`model.layers.LayerCache`) after its new slots
    ``k``, ``v`` (appended at ``past``): made at the cache's first fill, appended to after; None where
    the cache is not static. A cache refilled from another start or with other padding is rebuilt
    from its whole filled prefix."""
    if not cache.capacity or cache.k is None:
        return None
    b = cache.blocked
    if b is None or b.filled != past or not same_values(b.pad, pad) \
            or b.keys.dtype != k.dtype or b.values.dtype != v.dtype:
        B, KV, _, D = cache.k.shape
        b = cache.blocked = BlockedKV(B, KV, cache.capacity, D, cache.v.shape[-1], k.dtype, v.dtype, k.device, pad)
        if past:
            b.append(cache.k[:, :, :past], cache.v[:, :, :past], pad, 0)
    b.append(k, v, pad, past)
    return b


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    pad: torch.Tensor, scale: Optional[float] = None, window: int = 0,
                    sinks: Optional[torch.Tensor] = None, kv_blocks: Optional["BlockedKV"] = None) -> torch.Tensor:
    """Causal attention by position (the contract of ``invariant.attention``): q [B, H, Tq, D];
    k [B, KV, Tk, D], v [B, KV, Tk, Dv] with ``pad[b]`` padding slots before row b's first key;
    positions [B, Tq]; ``scale`` (default D^-0.5), ``window`` and ``sinks`` as there. Under autograd
    (:class:`_BlockAttention`) the forward is the same no-grad pass (the same bits) and saves only
    q, k, v, the output and each row's log-sum-exp: O(T) per layer, a flash-style backward
    (`fp4/block_attention_grad.py`) recomputes the scores in chunks. ``kv_blocks``: the KV cache's
    :class:`BlockedKV` (a decode step reads its key blocks in place instead of gathering them)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks)):
        return _BlockAttention.apply(q, k, v, positions, pad, scale, window, sinks)
    return _block_forward(q, k, v, positions, pad, scale, window, sinks, kv_blocks=kv_blocks)[0]


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   pad: torch.Tensor, scale: Optional[float], window: int, sinks: Optional[torch.Tensor],
                   with_lse: bool = False, kv_blocks: Optional["BlockedKV"] = None) -> tuple:
    """(output [B, H, Tq, Dv], each query row's log-sum-exp [B, KV, rep·Tq] in float32 or wider —
    the sink's term included — or None unless ``with_lse``): :func:`block_attention` without autograd."""
    B, H, Tq, D = q.shape
    KV, Tk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    rep = H // KV
    kr, k_rows = _key_rows(k)
    vr, v_rows = _key_rows(v)
    plan = _plan(positions, pad, B, KV, rep, Tq, Tk, k_rows, v_rows, D, Dv, q.dtype, v.dtype, window)
    nK, R, nT, live, Dw, qt = plan.nK, plan.R, plan.nT, plan.live, plan.Dw, plan.qt
    # Keys and values by position, in one row copy each (index_select of whole key rows: a gather
    # with an expanded index was 10× slower) into a fresh row-major [B·KV, nK, KEY_BLOCK, ·] buffer:
    # row b's key j sits in slot pad[b] + j (clamped; the slots past n_keys are in every query's
    # future: their scores are masked and their weights exactly 0, so whatever key they copy adds
    # exact zeros). A ones column on the values: the weighted-value product also gives the softmax
    # denominator (the same fixed-shape call sums the block's weights). The values are at least
    # MIN_VALUE_COLUMNS columns wide (zeros): with fewer the CPU GEMM's narrow-N kernel rounded a row
    # by its place in the tile (measured: 9-11 columns, a padded row then differed in its last bit).
    # (One key block: [B·KV, KEY_BLOCK, ·], the block itself, with the strides of its slice of the 4-d form.)
    blocked = (nK, B * KV, KEY_BLOCK) if plan.block_major else (B * KV, nK, KEY_BLOCK) if nK > 1 else (B * KV, KEY_BLOCK)
    # A decode step (one query tile per head, no autograd) takes its buffers from the thread's
    # workspace (`_DecodeBuffers`: reused by every layer and step of this shape) instead of
    # allocating them: the same ops into the same shapes, fewer allocations and fills.
    decode = plan.decode is not None
    ws = _decode_buffers(q, k, v, plan) if decode and not with_lse else None
    mirror = kv_blocks is not None and decode and kv_blocks.serves(k, v, pad, nK, Dw)
    if mirror:  # the cache's own blocks by key index (`BlockedKV`): no gather
        kb, vb = kv_blocks.keys[:nK], kv_blocks.values[:nK]
    elif ws is None:
        kb = kr.index_select(0, plan.rows)
        vb = vr.new_empty(plan.v_at.shape[0], Dw + 1)  # the values gathered straight into it (no copy for the cat)
        vb[:, Dv:] = plan.tail
    else:
        keys, vb = ws.gathered()  # the values' tail columns (zeros, the ones column) written once
        kb = torch.index_select(kr, 0, plan.rows, out=keys)
    if not mirror:
        torch.index_select(vr, 0, plan.v_at, out=vb[:, :Dv])
    kb, vb = kb.view(*blocked, D), vb.view(*blocked, Dw + 1)
    # Query rows: the rep query heads of a kv head times the queries, in tiles [B·KV·nT, qt, D]
    # (a decode step's rep rows share one tile), pre-scaled. Every batched product's operands
    # row-major (a kernel is chosen by layout as well as shape: a decode step's expanded key block
    # would otherwise be a transposed view).
    scale = D ** -0.5 if scale is None else scale
    if plan.tall is not None:
        return _tall_forward(q, kb, vb, plan, scale, window, sinks, with_lse)
    if decode:
        return _decode_forward(q, kb, vb, plan, scale, window, sinks, with_lse, ws)
    # written straight into their zero-padded tiles (a scaled copy each, no pad pass)
    flat_q = q.new_zeros(B, KV, nT * qt, D)
    torch.mul(q.view(B, KV, rep, Tq, D), scale, out=flat_q[:, :, :R].view(B, KV, rep, Tq, D))
    flat_q = flat_q.view(-1, qt, D)
    m = l = acc = None
    scores = None  # the score tile's buffer: the first block's, reused
    mask_out = None  # the first block's mask buffers, reused by the later blocks' masks
    for j, blk in enumerate(plan.blocks):
        sel, cols = blk.sel, blk.cols
        qj = flat_q if sel is None else flat_q.index_select(0, sel)
        # [n, KEY_BLOCK, D (+1)] row-major: a tile's key block (a view where each (b, kv) has one tile and block)
        kj, vj = (kb[:, j], vb[:, j]) if nK > 1 else (kb, vb)
        if blk.oj is not None:
            kj, vj = kj.index_select(0, blk.oj), vj.index_select(0, blk.oj)
        # The block-sized buffers (scores, masks) are allocated once for the first block (every
        # tile, the widest cols) and reused: a fresh buffer per block cost more in page faults
        # (glibc hands big freed buffers back to the system) than the arithmetic in it.
        # Every product written through ``out=`` into a buffer of this forward's own: the in-place
        # softmax below then mutates no tensor a default-overload GEMM returned (selective
        # recompute's policy keeps those outputs, `model/recompute.py`, and would hand the mutated
        # buffer back to the recompute; it keeps no ``out=`` result, and this forward's backward
        # recomputes the scores anyway).
        n = qj.shape[0]
        s_tile = torch.bmm(qj, kj.transpose(1, 2),
                           out=scores[:n] if scores is not None else qj.new_empty(n, qt, KEY_BLOCK))
        if scores is None:
            scores = s_tile
        s = s_tile[:, :live, :cols]
        if blk.masks is not None:
            bias, keep = blk.masks
        else:
            bias, keep = _block_mask(blk.pj, j, window, q.dtype, cols, mask_out)
            if mask_out is None:
                mask_out = (bias.view(-1), keep.view(-1))
        s = s.add_(bias)  # the future keys (and those out of the window) −inf, the others + 0 (their bits)
        blk_max = s.amax(-1, keepdim=True)  # the row statistics m, l kept [n, live, 1]: they broadcast as they are
        m_old = None if not j else m if sel is None else m.index_select(0, sel)
        m_new = blk_max if m_old is None else torch.maximum(m_old, blk_max)
        # With a window a row may have seen no key yet (its blocks so far wholly before the window:
        # max −inf): its weights and rescale factor then come from 0 instead (exact zeros, not NaN).
        m_ref = m_new.nan_to_num(neginf=0.0) if window else m_new
        # exp of an argument clamped at EXP_FLOOR, times keep (0 for the masked keys: exact zeros,
        # whatever the cached slots past a row's end hold): ATen's vector exp takes a slow path for
        # every lane that underflows (−inf included; 10× here), and masked_fill was as slow as exp.
        # A visible key below the floor gets exp(EXP_FLOOR) ≈ 1.6e-38 instead of ~0: negligible
        # beside the block's largest weight 1, and the same in a decode step and a full forward.
        # In the score tile: its columns past cols zeroed (rows past live: padding queries, whose
        # products are dropped — a GEMM row's result depends on that row of its left operand alone).
        s.sub_(m_ref).clamp_(min=EXP_FLOOR).exp_().mul_(keep)
        if cols < KEY_BLOCK:
            s_tile[:, :live, cols:].zero_()
        pv = torch.bmm(s_tile, vj, out=vj.new_empty(n, qt, Dw + 1))
        pv = pv[:, :live]  # [n, live, Dw + 1]
        pv, ps = pv[..., :Dv], pv[..., Dw:]
        if m_old is None:
            m, l, acc = m_new, ps, pv
            continue
        corr = torch.exp(m_old - m_ref)
        if sel is None:
            m, l, acc = m_new, l * corr + ps, acc * corr + pv
            continue
        m.index_copy_(0, sel, m_new)
        l.index_copy_(0, sel, l.index_select(0, sel) * corr + ps)
        acc.index_copy_(0, sel, acc.index_select(0, sel) * corr + pv)
    if sinks is not None:  # a per-head logit in every row's softmax, dropped after it (no value)
        sink = sinks.to(m.dtype).view(1, KV, rep, 1).expand(B, KV, rep, Tq).reshape(B, KV, R)
        sink = _zero_padded(sink, 2, live).view(-1, live, 1)
        m, l, acc = _with_sink(m, l, acc, sink)
    lse = None
    if with_lse:  # m + log l in a wide dtype, per query row [B, KV, R] (a fresh O(T) tensor)
        wide = torch.promote_types(l.dtype, torch.float32)
        lse = (m.to(wide) + l.to(wide).log()).view(B, KV, nT * live)[:, :, :R].clone()  # its own storage
    # the live rows divided into a fresh contiguous [B, KV, rep·Tq, Dv] (acc may be a view of the
    # value product's wider rows: the output autograd saves is then exactly its own size)
    acc, l = acc.view(B, KV, nT * live, Dv), l.view(B, KV, nT * live, 1)
    out = torch.div(acc, l) if nT * live == R else torch.div(acc[:, :, :R], l[:, :, :R])
    return out.view(B, H, Tq, Dv), lse


def _with_sink(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, sink: torch.Tensor) -> tuple:
    """(m, l, acc) of an online softmax with one more logit ``sink`` per row (broadcast like ``m``)
    that carries no value (gpt-oss's attention sinks): the running max, weight sum and weighted
    values rescaled to max(m, sink), the sink's weight added to the sum."""
    m_all = torch.maximum(m, sink)
    corr = torch.exp(m - m_all)
    return m_all, l * corr + torch.exp(sink - m_all), acc * corr


def _decode_masks(positions: torch.Tensor, KV: int, nK: int, window: int, dtype: torch.dtype) -> tuple:
    """(bias, keep) [nK, B·KV, 1, KEY_BLOCK] of a decode step's key blocks: for head (b, kv) the
    keys of index > positions[b] (its future; with a ``window`` also those at or before
    position − window) hidden (bias −inf, keep 0), the others 0 and 1 (`_masks`)."""
    B = positions.shape[0]
    pos = positions.reshape(B, 1, 1).expand(B, KV, 1).reshape(B * KV, 1)
    keys = _arange(nK * KEY_BLOCK, positions.device)[None, :]
    hidden = keys > pos
    if window:
        hidden |= keys <= pos - window
    hidden = hidden.view(B * KV, nK, KEY_BLOCK).transpose(0, 1).reshape(nK, B * KV, 1, KEY_BLOCK)
    return _masks(hidden, dtype)


def _decode_forward(q, kb, vb, plan, scale: float, window: int, sinks: Optional[torch.Tensor],
                    with_lse: bool, ws: Optional["_DecodeBuffers"]) -> tuple:
    """:func:`_block_forward` for a decode plan (one query tile per (b, kv) head, ``kb`` / ``vb`` the
    block-major keys and values [nK, B·KV, KEY_BLOCK, ·]): the scores of every key block of every
    tile in one batched product (the query tile repeated per block: each product the tile's own
    [qt, D] · [D, KEY_BLOCK] call), the softmax's elementwise work once over all blocks (the running
    max a `cummax` over the blocks), the weighted values in one product, then the blocks combined
    in block order (``run · corr + block``, the value sums and the weight sum in one row) — the
    per-block path's ops on the same values, so its bits, in a fixed number of calls instead of
    a dozen per block. A block wholly in a head's future is included, not skipped: its scores are
    masked (weights exactly +0: the GEMM sums +0 products from +0) and its running max unchanged
    (rescale exp(0) = 1), so it leaves the running sums as they were."""
    B, H, _, D = q.shape
    nK, qt, live, Dv, Dw = plan.nK, plan.qt, plan.live, plan.Dv, plan.Dw
    n = kb.numel() // (nK * KEY_BLOCK * D)  # B·KV
    KV = n // B
    rep = H // KV
    bias, keep = plan.decode
    if ws is None:
        queries = q.new_zeros(nK, B, KV, qt, D)
        scores = q.new_empty(nK * n, qt, KEY_BLOCK)
        products = vb.new_empty(nK * n, qt, Dw + 1)
    else:
        queries, scores, products = ws.queries, ws.scores, ws.products
    # the scaled queries written into every block's copy of the zero-padded tiles (one broadcast op)
    torch.mul(q.view(1, B, KV, rep, D).expand(nK, B, KV, rep, D), scale, out=queries[:, :, :, :rep])
    torch.bmm(queries.view(nK * n, qt, D), kb.reshape(nK * n, KEY_BLOCK, D).transpose(1, 2), out=scores)
    s = scores.view(nK, n, qt, KEY_BLOCK)[:, :, :live].add_(bias)
    m = s.amax(-1, keepdim=True)  # [nK, n, live, 1]: each block's max, then the running max
    if nK > 1:
        m = torch.cummax(m, 0).values
    m_ref = m.nan_to_num(neginf=0.0) if window else m
    s.sub_(m_ref).clamp_(min=EXP_FLOOR).exp_().mul_(keep)
    torch.bmm(scores, vb.reshape(nK * n, KEY_BLOCK, Dw + 1), out=products)
    blocks = products.view(nK, n, qt, Dw + 1)[:, :, :live]
    run = blocks[0]
    if nK > 1:
        corr = torch.exp(m[:-1] - m_ref[1:])
        for j in range(1, nK):
            run = run * corr[j - 1] + blocks[j]
    m = m[-1]
    l, acc = run[..., Dw:], run[..., :Dv]
    if sinks is not None:  # a per-head logit in every row's softmax, dropped after it (no value)
        sink = sinks.to(m.dtype).view(1, KV, rep).expand(B, KV, rep).reshape(n, live, 1)
        m, l, acc = _with_sink(m, l, acc, sink)
    lse = None
    if with_lse:  # m + log l in a wide dtype, per query row [B, KV, rep] (a fresh tensor)
        wide = torch.promote_types(l.dtype, torch.float32)
        lse = (m.to(wide) + l.to(wide).log()).view(B, KV, rep)
    return torch.div(acc, l).view(B, H, 1, Dv), lse


def _tall_forward(q, kb, vb, plan, scale: float, window: int, sinks: Optional[torch.Tensor],
                  with_lse: bool) -> tuple:
    """:func:`_block_forward` for a plan with ``tall`` rows: per key block j and run of at most
    ``cap`` of the rows that read it, one product over every head's rows stacked ([B·KV, h, D], a
    view of the scaled queries) with the head's key block read in place, then the same online
    softmax, row by row, as the tiles (each op elementwise or per row; a row's products the bits of
    its ROW_TILE-row tile, probed): the bits of the tile path, without a copy of a head's key and
    value blocks per tile or gathers of the tiles and their running sums. The output and the
    log-sum-exp back in the query-head-major order."""
    B, H, Tq, D = q.shape
    n = kb.shape[0]
    KV, Dv, Dw, t = n // B, plan.Dv, plan.Dw, plan.tall
    rep = H // KV
    R, rows, nK = rep * Tq, t.rows, plan.nK
    flat_q = q.new_empty(n, rows, D)
    if rows > R:  # the padding rows' queries: zeros (finite scores, rows dropped at the end)
        flat_q[:, R:].zero_()
    torch.mul(q.view(B, KV, rep, Tq, D).transpose(2, 3), scale, out=flat_q[:, :R].view(B, KV, Tq, rep, D))
    m = q.new_empty(n, rows, 1)
    l = q.new_empty(n, rows, 1)
    acc = q.new_empty(n, rows, Dv)
    cap = min(t.cap, rows)
    s_buf = q.new_empty(n * cap * KEY_BLOCK)
    p_buf = vb.new_empty(n * cap * (Dw + 1))
    for j in range(nK):
        kj, vj = (kb[:, j], vb[:, j]) if nK > 1 else (kb, vb)
        start, cols = t.starts[j], t.cols[j]
        for c0 in range(start, rows, cap):
            c1 = min(c0 + cap, rows)
            h = c1 - c0
            s_tile = torch.bmm(flat_q[:, c0:c1], kj.transpose(1, 2),
                               out=s_buf[:n * h * KEY_BLOCK].view(n, h, KEY_BLOCK))
            sc = s_tile[:, :, :cols]
            if t.masks is not None:
                bias, keep = (mk[:, c0 - start:c1 - start] for mk in t.masks[j])
            else:
                bias, keep = _block_mask(t.pos[:, c0:c1], j, window, q.dtype, cols)
            sc = sc.add_(bias)
            blk_max = sc.amax(-1, keepdim=True)
            m_old = m[:, c0:c1] if j else None
            m_new = blk_max if m_old is None else torch.maximum(m_old, blk_max)
            m_ref = m_new.nan_to_num(neginf=0.0) if window else m_new
            sc.sub_(m_ref).clamp_(min=EXP_FLOOR).exp_().mul_(keep)
            if cols < KEY_BLOCK:
                s_tile[:, :, cols:].zero_()
            pv = torch.bmm(s_tile, vj, out=p_buf[:n * h * (Dw + 1)].view(n, h, Dw + 1))
            pvv, ps = pv[..., :Dv], pv[..., Dw:]
            if m_old is None:
                m[:, c0:c1], l[:, c0:c1], acc[:, c0:c1] = m_new, ps, pvv
                continue
            corr = torch.exp(m_old - m_ref)
            l[:, c0:c1] = l[:, c0:c1] * corr + ps
            acc[:, c0:c1] = acc[:, c0:c1] * corr + pvv
            m[:, c0:c1] = m_new
    if sinks is not None:  # a per-head logit in every row's softmax, dropped after it (no value)
        sink = sinks.to(m.dtype).view(1, KV, 1, rep).expand(B, KV, Tq, rep).reshape(n, R)
        if rows > R:  # the padding rows' sink: any finite value (their rows are dropped)
            sink = torch.cat([sink, sink[:, :1].expand(n, rows - R)], 1)
        sink = sink.view(n, rows, 1)
        m, l, acc = _with_sink(m, l, acc, sink)
    lse = None
    if with_lse:  # m + log l in a wide dtype, per query row [B, KV, R] query-head-major (its own storage)
        wide = torch.promote_types(l.dtype, torch.float32)
        lse = torch.empty(B, KV, R, dtype=wide, device=q.device)  # its own storage, exactly its size
        lse.view(B, KV, rep, Tq).copy_((m.to(wide) + l.to(wide).log())[:, :R].view(B, KV, Tq, rep).transpose(2, 3))
    # a fresh contiguous [B, H, Tq, Dv], as the tiles' (a reshape alone is a view in another layout
    # for one kv head: a later op's saved view of it would then share its storage)
    out = torch.div(acc[:, :R], l[:, :R]).view(B, KV, Tq, rep, Dv).transpose(2, 3).reshape(B, H, Tq, Dv)
    return out.contiguous(), lse


def _versions(*tensors) -> tuple:
    """Version counters of ``tensors`` (None for a tensor without one: an inference tensor)."""
    out = []
    for t in tensors:
        try:
            out.append(t._version)
        except RuntimeError:
            out.append(None)
    return tuple(out)


class _BlockAttention(torch.autograd.Function):
    """:func:`block_attention` under autograd: the forward is the no-grad pass (its bits) and saves
    q, k, v, the output and each row's log-sum-exp (positions and padding, the model's inputs shared
    by every layer, ride on the context); the backward recomputes the scores in chunks of query
    rows (`block_attention_grad.attention_backward`)."""

    @staticmethod
    def forward(ctx, q, k, v, positions, pad, scale, window, sinks):
        out, lse = _block_forward(q, k, v, positions, pad, scale, window, sinks, with_lse=True)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.positions, ctx.pad, ctx.scale, ctx.window = positions, pad, scale, window
        ctx.versions = _versions(positions, pad)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        if _versions(ctx.positions, ctx.pad) != ctx.versions:
            raise RuntimeError("block attention's backward: the positions or padding tensor was modified in place "
                               "after the forward (the backward recomputes the scores from them); pass a fresh "
                               "tensor instead of writing into the one the forward used")
        dq, dk, dv, dsinks = attention_backward(q, k, v, out, lse, d_out, ctx.positions, ctx.pad,
                                                ctx.scale, ctx.window, sinks)
        return dq, dk, dv, None, None, None, None, dsinks
