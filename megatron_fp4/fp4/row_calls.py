"""The geometry of the ``batch`` level's GEMM calls: which rows and columns one call takes.

A row's bits at the ``batch`` level are defined by the weight's fixed row tile: the row computed in
a [T, K] · [K, Nb] call, T = :func:`row_tile` ``(K, N)``, Nb a column block (:func:`column_blocks`),
the weight the transpose of a row-major [N, K] (``tiled.py``). Which *other* call heights give every
row those same bits is a property of the BLAS, the machine and the thread count, so it is measured
rather than assumed (:func:`row_plan`):

A CPU GEMM picks its kernel and its reduction order from the call's shape, layout, dtype and thread
count, never from the values. MKL's sgemm reduces a row over K the same way at many heights
(measured, torch 2.13 on an AMD EPYC: every height ≥ 4 at one thread; at two threads the multiples
of 4 and every height ≥ 12; the multiples of 4 from 8 under ``MKL_CBWR=COMPATIBLE``; bf16 every
height) but not at all (heights 1-3 take other kernels), and no documentation promises it. So the
first GEMM of each call shape runs a probe: random rows (a private generator: the global RNG is
untouched) computed in T-row tiles and in one call of every candidate height, the multiples of 4 up
to the cap, into an output of the call's row stride, one of them also from a misaligned input. The
plan keeps the smallest quantum q and minimum m for which every multiple of q from m to the cap gave
the tiles' bits in every row (a :class:`RowPlan`); where none did (another BLAS, a GPU's), the plan
is the tile itself (q = m = cap = T). The cap is CAP_TILES tiles, raised for ``mm`` while every
further multiple of q up to CAP_ROWS rows passed too (MKL's sgemm repacks the weight on every call:
a scoring pass's 192 rows of an expert in one call cost ~8 % less than in three of 64). The
``batch`` level then pads a call's rows to the next height of the plan (a decode step's 2 rows of
an expert to 4 instead of 16) and cuts longer runs into cap-row calls (a scoring pass's 42 rows of
an expert in one call instead of 3 tiles): the tiles' bits at a lower price. The plan is a cached
fact of the machine, not a mode: the bits are the tiles' either way.

The kernel: an fp32 weight of at least :data:`ONEDNN_MIN_ELEMENTS` on a CPU with AVX2 is first probed
with oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``, one column block: oneDNN
blocks the weight itself), where the weight is either the row-major [n, k] tensor or oneDNN's packed
copy of it (:func:`onednn_pack`): both forms at every height must give the oneDNN tiles' bits. It is
kept where they do (measured here: every height from 4, 1 and 2 threads, both forms equal), and then
*its* T-row tiles define the row's bits (the plan's ``kernel``); elsewhere MKL's ``mm`` does. The
choice is a function of the shape, the machine and the build, as the heights are, so the trainer
and a rollout on one machine pick the same. What it buys: oneDNN's fp32 kernels read a weight at
small heights far faster than MKL's sgemm, which packs the transposed weight on every call (4 rows
times a [4096, 1024] weight: 0.42 ms packed, 1.0 dense, 1.5 ms ``mm``; 64 rows 1.3×); the packed form
is kept where weights stay constant across calls (a rollout model's weight cache,
``Numerics.weight_packs``), the trainer computes with the dense form (the same bits, no copy).

The same holds for ``mm``'s operand: MKL's sgemm packs the weight on every call, from the
transposed view of the row-major [n, k] weight a strided gather, from a contiguous [k, n] copy a
row copy. Where the probe finds that copy's calls give the tiles' bits at every height of the plan
(measured here: every multiple of 4 at one and two threads; under ``MKL_CBWR=COMPATIBLE`` not
height 4, and at two threads not a 128-column weight's heights past 128), the plan says so
(``transposed_copy``) and a rollout model keeps the copy beside the weight (decode heights 4-16 of
a [512, 256] weight out of cache: 0.62-0.72× the view's time; the trainer keeps the view: the same
bits, no copy).

Below the minimum: a call of one or two rows (a decode step's share of an expert at a realistic
width) padded to 4 rows reads the weight as slowly as the 4-row call, which at a decode step is
memory-bound (64 experts' [768, 1024] weights, one call each: oneDNN packed 4 rows 24-27 ms, 2
rows 19 ms, 1 row 17 ms, on an AVX2-only EPYC). oneDNN's kernels took the same path at 2 and 3
rows as at 4 on both weight forms (the dense weight's 1-row call another), so a oneDNN plan keeps
``low``: the heights from it up to the minimum probed like the others (both forms, aligned and
misaligned rows), down from the minimum while each agrees; a call of fewer rows is padded only to
``low`` (measured: a realistic-width generation at `batch` 0.87-0.90× the time with every call
padded to 4, the same bits). MKL's sgemm takes other kernels at heights 1-3 (not tried).

Above the cap, for a scoring pass: a oneDNN plan takes every multiple of its quantum up to
TALL_ROWS rows (a scoring pass's ~100-row run of an expert in one call of its own height), the
heights past the probed ones (``RowPlan.dense``) each verified the first time a call takes it
(:func:`tall_agrees`: random rows in one call, aligned and misaligned, against the tiles; a height
that differs is cut into probed ones, :meth:`RowPlan.calls`' pieces of :meth:`RowPlan.dense_calls`).
A weight of more than CACHED_WEIGHT_ELEMENTS (an LM head's [8192, 1024]: a verification reads it
~40 times, ~0.2 s) calls past its probed heights only the multiples of ``dense`` (3 heights to verify
instead of 48), the rest of a call in a probed height (:func:`onednn_calls`). So the bits are the
tiles' whichever heights a process has verified, and a process makes (and oneDNN caches a primitive
for) only the heights its calls take. Measured (an AVX2-only EPYC, one thread): a realistic scoring
pass 0.91x the time of 64-row calls (session 25's eager 96-256-row steps: 0.92-0.98x, a run of 100
rows in a 96-row call and a 4-row one that reads the whole weight again); the LM head's 256-row
calls another 0.98x (session 27). Probing every height up front took 5.4 s for an LM head and
~92 MiB a shape (session 24).

And for a decode step's experts: runs of one small height (up to :data:`BATCHED_MAX_HEIGHT` rows)
of consecutive experts may go in one ``bmm`` over their slice of the stacked weight where the probe
finds it gives each run its own ``mm`` call's bits (``RowPlan.batched``; measured here at every
height 4-16, 1 and 2 threads, also under ``MKL_CBWR=COMPATIBLE`` and ``AVX2``).

And for a decode step's few rows on a oneDNN plan: oneDNN's fp32 inner product at two rows and
more computes each element as one fused multiply-add per k in order from +0 (measured on AVX2), and
so does the project's row-streaming kernel (`row_stream.py`, compiled on first use), which reads a
weight at 1-16 rows 1.25-1.8x faster than oneDNN's calls (a decode step is weight-bandwidth bound).
The oneDNN probe tries it at every height 1 .. STREAM_MAX_ROWS, aligned and misaligned rows and a
wider output stride, against the plan's tiles, at one intra-op thread; where every row agrees the
plan keeps ``stream`` and a rollout model's store-backed calls of so few rows take the kernel on its
packed weight (`tiled._row_products`), the trainer's dense calls stay on oneDNN: the same bits
(measured: realistic generation at `batch` 0.75-0.79x the standard kernels' time, was ~1.1x).
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch

from megatron_fp4.fp4 import row_stream

ROW_TILE = 16  # the smallest GEMM row tile, and attention's query tile
MAX_ROW_TILE = 128
TILE_WORK = 1 << 18  # multiply-adds a GEMM tile aims at (a narrow layer's tile grows to reach it)
COLUMN_BLOCK_ELEMENTS = 1 << 19  # a GEMM's weight block: 2 MiB in fp32, a core's L2 (`column_blocks`)
CACHED_WEIGHT_ELEMENTS = 1 << 21  # a weight up to this size is one block (8 MiB in fp32: it stays cached)
MIN_COLUMNS = 16  # a GEMM's output columns at least (a narrower weight: zero-padded, `tiled._tiled_forward`)
MIN_COLUMN_BLOCK = 256  # columns of a weight block at least
CAP_TILES = 4  # a call takes at most this many tiles' rows (a probed plan's cap) ...
CAP_ROWS = 256  # ... or, for mm, up to this many rows where every height up to them passed the probe
QUANTA = (4, 8, 16)  # a probed plan's row quantum: the heights it may call are its multiples
PROBE_SEED = 0x5EED
ONEDNN_MIN_ELEMENTS = 1 << 18  # weights smaller than this stay on mm (oneDNN's ~12 µs a call loses below it)
# a oneDNN plan's calls go up to this many rows, the heights past its CAP_TILES tiles each verified at
# its first call (`tall_agrees`; a weight of more than CACHED_WEIGHT_ELEMENTS: only the multiples of
# its probed cap, `onednn_calls`)
TALL_ROWS = 256
# a weight of at least this many elements on mm is probed for its contiguous transposed copy
# (`RowPlan.transposed_copy`): below it the copy's lookup (~2 µs) costs about what a decode call
# saves ([128, 64]: 3.1 -> 2.4 µs)
TRANSPOSED_COPY_MIN_ELEMENTS = 1 << 15
# runs of one height up to this many rows (a decode step's few rows per expert) are probed for one
# `bmm` over consecutive experts' stacked weights (`RowPlan.batched`); past it a call's own work
# outweighs the per-call cost a batched call saves
BATCHED_MAX_HEIGHT = 16
BATCHED_PROBE_GROUPS = (2, 5)  # how many weights one probed batched call stacks
# a oneDNN plan's calls of at most this many rows are probed for the row-streaming kernel
# (`row_stream.py`, `RowPlan.stream`): 1.25-1.8x oneDNN's speed at 1-16 rows of a realistic expert
STREAM_MAX_ROWS = 16
# What oneDNN keeps in its primitive cache per (weight shape, call height, weight form) once called:
# measured 8.6-9.0 MiB for 16 heights of either form, whatever the shape ([1024, 256] to [4096, 1024],
# 1 and 2 threads), 119-125 MiB for the 192 heights 65-256 ([768, 1024], [1024, 384], either form);
# `training.memory_plan` counts it.
ONEDNN_PRIMITIVE_BYTES = 640 << 10


@functools.lru_cache(maxsize=None)
def row_tile(k: int, n: int) -> int:
    """The row tile of a [M, k] · [k, n] GEMM: ROW_TILE doubled while a tile does fewer than
    TILE_WORK multiply-adds, at most MAX_ROW_TILE. A function of the weight's shape alone (never of
    M), so every call through one weight has one tile shape: the bits of a row stay the row's own."""
    tile = ROW_TILE
    while tile < MAX_ROW_TILE and tile * k * n < TILE_WORK:
        tile *= 2
    return tile


@functools.lru_cache(maxsize=None)
def column_blocks(k: int, n: int) -> tuple:
    """The column blocks ``(start, width)`` of a [M, k] · [k, n] GEMM. A weight of at most
    CACHED_WEIGHT_ELEMENTS (8 MiB in fp32) is one block: it stays in the cache from one row tile to
    the next (measured: cutting an expert's [768, 1024] or a [1024, 1024] projection cost 0-3 %). A
    larger one is cut into blocks of COLUMN_BLOCK_ELEMENTS // k columns (a multiple of 64, at least
    MIN_COLUMN_BLOCK: a block fits a core's L2 cache, 2 MiB in fp32), the last one wider by the
    remainder where that is under half a block (no narrow tail block: MKL's narrow-N kernels
    rounded a row by its slot in the tile, ``block_attention``). A function of the weight's shape
    alone, as the row tile (cached: every GEMM call of the ``batch`` level asks)."""
    width = max(MIN_COLUMN_BLOCK, COLUMN_BLOCK_ELEMENTS // max(k, 1) // 64 * 64)
    full, rest = divmod(n, width)
    if k * n <= CACHED_WEIGHT_ELEMENTS or full == 0 or (full == 1 and rest < width // 2):
        return ((0, n),)
    blocks = [(j * width, width) for j in range(full)]
    if rest >= width // 2:
        blocks.append((full * width, rest))
    elif rest:
        blocks[-1] = (blocks[-1][0], width + rest)
    return tuple(blocks)


@dataclass(frozen=True)
class RowPlan:
    """The heights one GEMM call may take: the multiples of ``quantum`` from ``minimum`` to ``cap``
    (the fixed tile T: ``RowPlan(T, T, T)``), each a call of ``kernel`` (``mm``: on the transposed
    view of the row-major weight, or where ``transposed_copy`` on its contiguous transposed copy)."""

    quantum: int
    minimum: int
    cap: int
    kernel: str = "mm"  # "mm": the BLAS's GEMM (torch.mm); "onednn": oneDNN's inner product (onednn_linear)
    # mm: its calls on the weight's contiguous transposed copy ([k, n]) give the same bits at every
    # height of the plan (one column block; a rollout model keeps the copy: `tiled._row_products`)
    transposed_copy: bool = False
    # mm, one column block: runs of one height of the plan up to BATCHED_MAX_HEIGHT, stacked with
    # their weights (consecutive slices of a stacked [E, n, k], in the form the run's call reads) in
    # one ``bmm``, give each run its own ``mm`` call's bits (`tiled._run_tiles`: a decode step's
    # experts in one call per GEMM instead of one per expert)
    batched: bool = False
    # onednn: the heights ``low`` .. minimum − 1 (0: none) also give the tiles' bits, so a call of
    # so few rows is padded only to ``low`` (a decode step's one or two rows of an expert not to 4:
    # a memory-bound call then reads the weight at the few-row kernel's rate, `_run_probe`)
    low: int = 0
    # onednn: the heights up to ``dense`` were probed with the plan; the multiples of the quantum past
    # it up to the cap are each verified at their first call (`tall_agrees`), one that differs cut
    # into probed heights (`dense_calls`). 0: every height of the plan was probed
    dense: int = 0
    # onednn: calls of up to this many rows give the tiles' bits through the row-streaming kernel too
    # (`row_stream.stream_linear` on its packed weight; probed at every height up to it, aligned and
    # misaligned, at one thread), which a rollout model's store-backed calls then take (0: none)
    stream: int = 0

    def height(self, rows: int) -> int:
        """Rows ``rows`` are padded to: whole cap-row calls, then the remainder rounded up to a height
        of the plan (at least one call: 0 rows give ``minimum``; fewer than ``minimum`` rows at least
        ``low``, where the plan has short heights)."""
        if self.low and 0 < rows < self.minimum:
            return max(rows, self.low)
        full, rest = divmod(rows, self.cap)
        if rest == 0:
            return full * self.cap if full else self.minimum
        return full * self.cap + max(self.minimum, -(-rest // self.quantum) * self.quantum)

    def calls(self, height: int) -> list:
        """The call heights covering ``height`` rows (a value of :meth:`height`, or any multiple of
        the quantum from the minimum), in order: whole cap-row calls, then the rest in one call."""
        full, rest = divmod(height, self.cap)
        return [self.cap] * full + ([rest] if rest else [])

    def dense_calls(self, height: int) -> list:
        """``height`` rows (a height of the plan past ``dense``) in calls of probed heights: ``dense``
        rows at a time, one quantum less where the rest would fall under the plan's smallest height."""
        out, rest, least = [], height, self.low or self.minimum
        while rest > self.dense:
            step = self.dense if rest - self.dense >= least else self.dense - self.quantum
            out.append(step)
            rest -= step
        return out + ([rest] if rest else [])

    def heights(self) -> list:
        """Every height one call of the plan may take, ascending (the short ones first)."""
        short = list(range(self.low, self.minimum)) if self.low else []
        return short + list(range(self.minimum, self.cap + 1, self.quantum))

    def whole(self, rows: int) -> int:
        """How many of ``rows`` rows go in calls of the plan as they are, with no padding row: the
        whole cap-row calls and the rest cut to a multiple of the quantum (none of it under the
        minimum); :meth:`calls` covers them."""
        full, rest = divmod(rows, self.cap)
        return full * self.cap + (rest - rest % self.quantum if rest >= self.minimum else 0)

    def one_call(self, height: int) -> bool:
        """Whether ``height`` rows are one call of the plan (:meth:`calls` gives ``[height]``)."""
        return height <= self.cap


def fixed_plan(k: int, n: int) -> RowPlan:
    """The tile itself: every call [T, K] · [K, Nb], T = :func:`row_tile` ``(k, n)``."""
    tile = row_tile(k, n)
    return RowPlan(tile, tile, tile)


def _setting() -> tuple:
    """What a probe's answer depends on besides the shape and dtype: the intra-op thread count and
    the fp32 matmul precision (the BLAS's kernels and thread split change with them)."""
    return torch.get_num_threads(), _matmul_precision()


# torch's own getter without its Python wrapper (the same value; the wrapper where the binding is absent)
_matmul_precision = getattr(torch._C, "_get_float32_matmul_precision", torch.get_float32_matmul_precision)


_PLANS: dict = {}
_LOCK = threading.Lock()


def row_plan(k: int, n: int, dtype: torch.dtype, device: torch.device) -> RowPlan:
    """The :class:`RowPlan` of a [·, k] · [k, n] GEMM (the weight the transpose of a row-major
    [n, k]) at ``dtype`` on ``device`` at the current thread count and fp32 matmul precision: probed
    on CPU once per shape, dtype and setting (oneDNN first where it may serve, :func:`onednn_serves`;
    else every column block's ``mm`` call shape, :func:`_run_probe`), the fixed tile elsewhere."""
    if torch.device(device).type != "cpu":
        return fixed_plan(k, n)
    key = (k, n, dtype, *_setting())
    plan = _PLANS.get(key)
    if plan is None:
        if onednn_serves(k, n, dtype):
            plan = _probe_cached(k, n, n, row_tile(k, n), dtype, key[3:], "onednn")
            plan = plan if plan.kernel == "onednn" else None  # no height agreed: not trusted, mm's plan
        plan = plan or _combined(k, n, dtype, key[3:])
        with _LOCK:
            _PLANS[key] = plan
    return plan


@functools.lru_cache(maxsize=None)
def _onednn_usable() -> bool:
    """oneDNN's fp32 inner product is in this build and the CPU has AVX2 (its kernels for older
    vector units lose to ``mm`` at every height: measured)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.cpu._is_avx2_supported()
                    and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


def onednn_serves(k: int, n: int, dtype: torch.dtype) -> bool:
    """Whether a [·, k] · [k, n] GEMM is probed with oneDNN first: fp32, a weight of at least
    :data:`ONEDNN_MIN_ELEMENTS`, oneDNN usable here."""
    return dtype == torch.float32 and k * n >= ONEDNN_MIN_ELEMENTS and _onednn_usable()


def onednn_kernel_bytes(k: int, n: int) -> int:
    """The most bytes oneDNN's primitive cache keeps for a [·, k] · [k, n] GEMM it serves: one
    primitive per call height and weight form — the probe's heights in both forms (dense, packed:
    the multiples of 4 up to CAP_TILES tiles, the short heights 1-3 it tries for ``RowPlan.low``)
    and the heights past them up to TALL_ROWS (:func:`tall_heights`) in one form (a trainer computes
    with the dense form alone, a rollout model with the packed one), each made when a call first
    takes it (:func:`tall_agrees`: a process holds the heights its calls took) — kept for the
    process's life (the cache holds up to 1024 primitives)."""
    return (2 * probed_heights(k, n) + tall_heights(k, n)) * ONEDNN_PRIMITIVE_BYTES


def probed_heights(k: int, n: int) -> int:
    """How many call heights a oneDNN probe of a [·, k] · [k, n] GEMM tries in each weight form."""
    return row_tile(k, n) * CAP_TILES // QUANTA[0] + QUANTA[0] - 1


def tall_heights(k: int, n: int) -> int:
    """How many heights past the probed ones a oneDNN plan of a [·, k] · [k, n] GEMM may call: every
    multiple of 4 up to TALL_ROWS, only those of the probed cap for a weight of more than
    CACHED_WEIGHT_ELEMENTS (:func:`onednn_calls`)."""
    cap = row_tile(k, n) * CAP_TILES
    return max(0, TALL_ROWS - cap) // (QUANTA[0] if _every_height(k, n) else cap)


def _every_height(k: int, n: int) -> bool:
    """Whether a oneDNN plan of a [·, k] · [k, n] GEMM calls every multiple of its quantum past its
    probed heights (each verified at its first call) or only the multiples of its probed cap: a weight
    of at most CACHED_WEIGHT_ELEMENTS (a larger one's verification reads it ~40 times)."""
    return k * n <= CACHED_WEIGHT_ELEMENTS


_TALL: dict = {}
_TALL_LOCK = threading.Lock()


def tall_agrees(k: int, n: int, dtype: torch.dtype, packed: bool, height: int) -> bool:
    """Whether a oneDNN call of ``height`` rows (past its plan's ``dense``) on the [n, k] weight's
    packed or dense form gives every row the tiles' bits: random rows (a private generator) in one
    call, aligned and misaligned, against oneDNN's T-row tiles of the same form; verified once per
    shape, dtype, form, height and setting (:func:`_setting`), the first time a call takes it."""
    key = (k, n, dtype, packed, height, *_setting())
    agrees = _TALL.get(key)
    if agrees is None:
        with _TALL_LOCK:
            agrees = _TALL.get(key)
            if agrees is None:
                agrees = _TALL[key] = _tall_check(k, n, dtype, packed, height)
    return agrees


def _tall_check(k: int, n: int, dtype: torch.dtype, packed: bool, height: int) -> bool:
    """:func:`tall_agrees`' check itself (uncached)."""
    tile = row_tile(k, n)
    with torch.inference_mode(), torch.autocast("cpu", enabled=False):
        gen = torch.Generator().manual_seed(PROBE_SEED + height)
        w = torch.randn(n, k, generator=gen).to(dtype)
        x = torch.randn(-(-height // tile) * tile, k, generator=gen).to(dtype)
        form = onednn_pack(w) if packed else w
        ref = torch.cat([onednn_linear(t, form) for t in x.split(tile)])[:height]
        rows = x[:height]
        return torch.equal(onednn_linear(rows, form), ref) and torch.equal(onednn_linear(_misaligned(rows), form), ref)


def onednn_calls(plan: RowPlan, k: int, n: int, dtype: torch.dtype, packed: bool, height: int) -> list:
    """The oneDNN calls covering ``height`` rows of a [·, k] · [k, n] GEMM (a value of
    :meth:`RowPlan.height`) on the weight's packed or dense form: :meth:`RowPlan.calls`, each past
    the plan's ``dense`` verified (:func:`tall_agrees`) or else cut into probed heights. A weight of
    more than CACHED_WEIGHT_ELEMENTS calls past ``dense`` only multiples of it: such a call's height
    is cut into its largest multiple of ``dense`` (verified) and the rest (probed heights)."""
    if height <= (plan.dense or plan.cap):  # a decode step's few rows: one call of a probed height
        return [height]
    if not plan.dense:  # every height of the plan probed
        return plan.calls(height)
    every, out = _every_height(k, n), []
    for c in plan.calls(height):
        whole = c if every or c <= plan.dense else c - c % plan.dense
        if 0 < c - whole < (plan.low or plan.minimum):  # no rest under the plan's smallest height
            whole -= plan.dense
        verified = whole > plan.dense and tall_agrees(k, n, dtype, packed, whole)
        out += ([whole] if verified else plan.dense_calls(whole)) + plan.dense_calls(c - whole)
    return out


def onednn_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ wᵀ`` by oneDNN's inner product: ``w`` the row-major [n, k] weight or its
    :func:`onednn_pack` (the same bits: :func:`row_plan` keeps oneDNN only where they are)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def onednn_pack(w: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed (blocked) copy of the row-major [n, k] weight ``w``, for :func:`onednn_linear`:
    a decode step's few rows read it ~2.4× faster than the dense weight (a copy as large as ``w``)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, ROW_TILE)


def _combined(k: int, n: int, dtype: torch.dtype, setting: tuple) -> RowPlan:
    """The plan every column block of the weight accepts: each distinct block width probed (the
    blocks of one width make the same calls: same shape and strides), the coarsest of them kept
    when they agree on nothing smaller (else the fixed tile)."""
    tile = row_tile(k, n)
    plans = {_probe_cached(k, width, n, tile, dtype, setting) for width in {w for _, w in column_blocks(k, n)}}
    if len(plans) == 1:
        return plans.pop()
    quantum = max(p.quantum for p in plans)  # QUANTA: each divides the largest
    minimum = -(-max(p.minimum for p in plans) // quantum) * quantum
    if any(p.cap < tile * CAP_TILES for p in plans):  # a block kept the fixed tile
        return fixed_plan(k, n)
    return RowPlan(quantum, minimum, min(p.cap for p in plans) // quantum * quantum)


@functools.lru_cache(maxsize=None)
def _probe_cached(k: int, width: int, stride: int, tile: int, dtype: torch.dtype, setting: tuple,
                  kernel: str = "mm") -> RowPlan:
    """:func:`_run_probe` remembered per ``setting`` (the thread count and fp32 matmul precision
    it ran at: the BLAS's choices change with them)."""
    return _run_probe(k, width, stride, tile, dtype, kernel)


def _products(kernel: str, wt: torch.Tensor, width: int, stride: int, dtype: torch.dtype) -> list:
    """The forms of one call of ``kernel`` the probe compares: each ``f(rows) -> [h, width]`` (a view of
    an output of row stride ``stride``). ``mm``: the transposed view of the row-major weight (the
    plan's), then — a whole weight (``width == stride``) of at least TRANSPOSED_COPY_MIN_ELEMENTS —
    its contiguous transposed copy (``RowPlan.transposed_copy`` where it agrees); ``onednn``: the
    packed weight, then the dense one (both must give the tiles' bits)."""
    if kernel == "mm":
        def mm(rows, operand=wt):
            out = torch.empty(rows.shape[0], stride, dtype=dtype)[:, :width]
            return torch.mm(rows, operand, out=out)
        if width != stride or wt.shape[0] * width < TRANSPOSED_COPY_MIN_ELEMENTS:
            return [mm]
        return [mm, functools.partial(mm, operand=wt.contiguous())]
    w = wt.t()
    packed = onednn_pack(w)
    return [lambda rows: onednn_linear(rows, packed), lambda rows: onednn_linear(rows, w)]


def _run_probe(k: int, width: int, stride: int, tile: int, dtype: torch.dtype, kernel: str = "mm") -> RowPlan:
    """Which call heights give a [h, k] · [k, width] call of ``kernel`` (output row stride ``stride``)
    the bits of T = ``tile``-row calls in every row: the multiples of 4 up to ``CAP_TILES`` tiles
    tried on random rows (every form of a oneDNN call, ``mm``'s transposed view, :func:`_products`),
    the smallest quantum and minimum (at most T: else the tile is as cheap) whose heights all
    passed, confirmed from a misaligned copy of the rows at the minimum and the cap. The fixed tile
    (``mm``'s) where none did. ``mm``'s contiguous transposed copy, where probed, is then tried at
    every height of that plan and from the misaligned rows (``RowPlan.transposed_copy``). A oneDNN
    plan goes on to TALL_ROWS rows, the heights past the probed ones (its ``dense``) verified at
    their first call (:func:`onednn_calls`)."""
    cap = tile * CAP_TILES
    longest = max(cap, CAP_ROWS) if kernel == "mm" else cap  # heights past the cap tried (mm: its repacking)
    with torch.inference_mode(), torch.autocast("cpu", enabled=False):
        gen = torch.Generator().manual_seed(PROBE_SEED)
        wt = torch.randn(width, k, generator=gen).to(dtype).t()
        x = torch.randn(longest, k, generator=gen).to(dtype)
        forms = _products(kernel, wt, width, stride, dtype)
        ref = torch.cat([forms[0](xt) for xt in x.split(tile)])
        # the forms that define the plan: oneDNN's both; mm's view (its copy is only kept where it agrees)
        needed, extra = (forms, []) if kernel == "onednn" else (forms[:1], forms[1:])

        def same(rows: torch.Tensor, fs: list) -> bool:
            return all(torch.equal(form(rows), ref[:rows.shape[0]]) for form in fs)

        good = {h for h in range(QUANTA[0], longest + 1, QUANTA[0]) if same(x[:h], needed)}
        for quantum in QUANTA:
            for minimum in range(quantum, tile + 1, quantum):
                if not all(h in good for h in range(minimum, cap + 1, quantum)):
                    continue
                top = cap  # the cap: CAP_TILES tiles, raised while every further height passed
                while top + quantum <= longest and top + quantum in good:
                    top += quantum
                shifted = _misaligned(x[:top])
                if not (same(shifted[:minimum], needed) and same(shifted, needed)):
                    return RowPlan(tile, tile, tile)
                copy = bool(extra) and all(same(x[:h], extra) for h in range(minimum, top + 1, quantum)) \
                    and same(shifted[:minimum], extra) and same(shifted, extra)
                batched = kernel == "mm" and width == stride and _batched_agrees(
                    k, width, range(minimum, min(top, BATCHED_MAX_HEIGHT) + 1, quantum), copy, dtype, gen)
                # oneDNN: the heights below the minimum, down from minimum − 1 while each agrees
                # (aligned and misaligned rows, both forms: the dense weight's 1-row call took
                # another kernel here, the packed one's did not); MKL's heights 1-3 take other
                # kernels (not tried)
                low = minimum
                while kernel == "onednn" and low > 1 and same(x[:low - 1], needed) \
                        and same(shifted[:low - 1], needed):
                    low -= 1
                tall = kernel == "onednn" and top < TALL_ROWS
                stream = kernel == "onednn" and width == stride and _stream_agrees(wt.t(), x, shifted, ref)
                return RowPlan(quantum, minimum, TALL_ROWS if tall else top, kernel, copy, batched,
                               low if low < minimum else 0, top if tall else 0, STREAM_MAX_ROWS if stream else 0)
    return RowPlan(tile, tile, tile)


def _stream_agrees(w: torch.Tensor, x: torch.Tensor, shifted: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether the row-streaming kernel (`row_stream.py`) on the row-major [n, k] weight ``w``'s
    packed copy gives every row of ``x`` and of its misaligned copy ``shifted`` the bits ``ref`` of
    the plan's tiles, at every height 1 .. STREAM_MAX_ROWS, into an output of a wider row stride as
    well: at one intra-op thread only (the kernel runs on one; past it oneDNN's calls use the
    threads), where the kernel is available here."""
    if torch.get_num_threads() != 1 or x.dtype != torch.float32 or not row_stream.available():
        return False
    n = w.shape[0]
    packed = row_stream.stream_pack(w)
    for h in range(1, STREAM_MAX_ROWS + 1):
        wide = torch.empty(h, n + row_stream.BLOCK)[:, 1:n + 1]
        for rows in (x[:h], shifted[:h]):
            if not (torch.equal(row_stream.stream_linear(rows, packed, n), ref[:h])
                    and torch.equal(row_stream.stream_linear(rows, packed, n, out=wide), ref[:h])):
                return False
    return True


def _misaligned(rows: torch.Tensor) -> torch.Tensor:
    """A copy of the [h, k] ``rows`` starting one element past an aligned allocation (the probe's
    misaligned input: a kernel may take another path for it)."""
    h, k = rows.shape
    return torch.empty(h * k + 1, dtype=rows.dtype)[1:].view(h, k).copy_(rows)


def _batched_agrees(k: int, n: int, heights: range, copy: bool, dtype: torch.dtype, gen: torch.Generator) -> bool:
    """Whether one ``bmm`` of G stacked [h, k] row blocks times G weights (G in
    BATCHED_PROBE_GROUPS; the weights consecutive in a stacked [G, n, k], read as its transposed view
    and, with ``copy``, as the contiguous [G, k, n] copy) gives each block the bits of its own
    ``mm`` call on that weight, at every height in ``heights``, from aligned and misaligned rows.
    False for an empty ``heights`` (no height of the plan is small enough to batch)."""
    if not len(heights):
        return False
    groups = max(BATCHED_PROBE_GROUPS)
    w = torch.randn(groups, n, k, generator=gen).to(dtype)
    forms = [w.transpose(1, 2)] + ([w.transpose(1, 2).contiguous()] if copy else [])
    top = max(heights)
    x = torch.randn(groups * top * k + 1, generator=gen).to(dtype)
    for rows in (x[:-1], x[1:]):  # the second misaligned by one element
        for h in heights:
            for g in BATCHED_PROBE_GROUPS:
                xs = rows[:g * h * k].view(g, h, k)
                for wt in forms:
                    want = torch.stack([torch.mm(xs[i], wt[i]) for i in range(g)])
                    if not torch.equal(torch.bmm(xs, wt[:g]), want):
                        return False
    return True


KEY_BLOCK = 64  # attention's key block (`tiled.block_attention`): the products' key dimension
QUERY_TILE_BATCHES = (1, 2, 3, 8, 17)  # how many tiles one probed attention product takes (`query_tile`)


def query_tile(rows: int, d: int, dv: int, dtype: torch.dtype, device: torch.device) -> int:
    """The query tile height block attention may call for ``rows`` live query rows (at most ROW_TILE:
    a decode step's rep query heads of a kv head): the smallest multiple of 4 from ``rows`` up whose
    two products — scores [n, h, d] · [n, d, KEY_BLOCK] (the keys a row-major [n, KEY_BLOCK, d] read
    transposed) and values [n, h, KEY_BLOCK] · [n, KEY_BLOCK, dv] — give every row the bits of the
    ROW_TILE-row tile (:func:`_query_heights`, probed on CPU once per shape, dtype and setting), else
    ROW_TILE (a GPU's, or where no smaller height matched). A decode step's 2 live rows then take a
    4-row product instead of 16 (measured: every height from 4 at one and two threads; from 8 for the
    scores under ``MKL_CBWR=COMPATIBLE``)."""
    if torch.device(device).type != "cpu" or rows >= ROW_TILE:
        return ROW_TILE
    good = _query_heights(d, dv, dtype, _setting())
    for h in range(-(-max(rows, 1) // QUANTA[0]) * QUANTA[0], ROW_TILE, QUANTA[0]):
        if h in good:
            return h
    return ROW_TILE


@functools.lru_cache(maxsize=None)
def _query_heights(d: int, dv: int, dtype: torch.dtype, setting: tuple) -> frozenset:
    """The heights h (multiples of 4 below ROW_TILE) at which both attention products (:func:`query_tile`)
    of 1, 2, 3, 8 and 17 tiles gave every row of every tile its ROW_TILE-row bits (random operands,
    a private generator; the key and value blocks both contiguous and one block of a [n, 2, ...]
    tensor, as a block of a head's several is read), at ``setting`` (thread count, matmul precision)."""
    with torch.inference_mode(), torch.autocast("cpu", enabled=False):
        gen = torch.Generator().manual_seed(PROBE_SEED + 2)
        n = max(QUERY_TILE_BATCHES)
        q = torch.randn(n, ROW_TILE, d, generator=gen).to(dtype)
        p = torch.randn(n, ROW_TILE, KEY_BLOCK, generator=gen).to(dtype)
        keys = torch.randn(n, 2, KEY_BLOCK, d, generator=gen).to(dtype)
        values = torch.randn(n, 2, KEY_BLOCK, dv, generator=gen).to(dtype)
        blocks = [(keys[:, 0].contiguous(), values[:, 0].contiguous()), (keys[:, 1], values[:, 1])]

        def same(h: int) -> bool:
            return all(torch.equal(torch.bmm(q[:g, :h].contiguous(), k[:g].transpose(1, 2)),
                                   torch.bmm(q[:g], k[:g].transpose(1, 2))[:, :h])
                       and torch.equal(torch.bmm(p[:g, :h].contiguous(), v[:g]), torch.bmm(p[:g], v[:g])[:, :h])
                       for g in QUERY_TILE_BATCHES for k, v in blocks)

        return frozenset(h for h in range(QUANTA[0], ROW_TILE, QUANTA[0]) if same(h))


TALL_MAX = 256  # the most query rows one tall attention product takes (`tall_rows`)
TALL_BATCHES = (1, 2, 5)  # how many heads one probed tall product takes


def tall_rows(d: int, dv: int, dtype: torch.dtype, device: torch.device) -> int:
    """The most rows (a multiple of ROW_TILE, at most TALL_MAX; 0: none) one attention product of a
    head's several query tiles may take, stacked in one [n, h, d] operand, so that at every such
    height up to it both products — scores [n, h, d] · [n, d, KEY_BLOCK] and values [n, h, KEY_BLOCK]
    · [n, KEY_BLOCK, dv] — give every row the bits of its own ROW_TILE-row tile (:func:`_tall_cap`,
    probed on CPU once per shape, dtype and setting; 0 on other devices). A prefill then reads each
    head's key block in place for all its tiles instead of copying it once per tile (measured: every
    multiple of 16 up to 512 rows, 1 and 2 threads, also under ``MKL_CBWR=COMPATIBLE``)."""
    if torch.device(device).type != "cpu":
        return 0
    return _tall_cap(d, dv, dtype, _setting())


@functools.lru_cache(maxsize=None)
def _tall_cap(d: int, dv: int, dtype: torch.dtype, setting: tuple) -> int:
    """:func:`tall_rows`' probe: random operands (a private generator), the query rows a view of a
    taller buffer past its first tile and the key and value blocks one block of a [n, 2, ...] tensor
    (the operands' layouts in a prefill), 1, 2 and 5 heads, each height a multiple of ROW_TILE up to
    TALL_MAX against per-tile products; the largest height below the first mismatch."""
    with torch.inference_mode(), torch.autocast("cpu", enabled=False):
        gen = torch.Generator().manual_seed(PROBE_SEED + 3)
        n = max(TALL_BATCHES)
        q = torch.randn(n, TALL_MAX + ROW_TILE, d, generator=gen).to(dtype)[:, ROW_TILE:]
        p = torch.randn(n, TALL_MAX + ROW_TILE, KEY_BLOCK, generator=gen).to(dtype)[:, ROW_TILE:]
        k = torch.randn(n, 2, KEY_BLOCK, d, generator=gen).to(dtype)[:, 1]
        v = torch.randn(n, 2, KEY_BLOCK, dv, generator=gen).to(dtype)[:, 1]
        ref_s = torch.cat([torch.bmm(t.contiguous(), k.transpose(1, 2)) for t in q.split(ROW_TILE, 1)], 1)
        ref_o = torch.cat([torch.bmm(t.contiguous(), v) for t in p.split(ROW_TILE, 1)], 1)
        best = 0
        for h in range(ROW_TILE, TALL_MAX + 1, ROW_TILE):
            if not all(torch.equal(torch.bmm(q[:g, :h], k[:g].transpose(1, 2)), ref_s[:g, :h])
                       and torch.equal(torch.bmm(p[:g, :h], v[:g]), ref_o[:g, :h]) for g in TALL_BATCHES):
                break
            best = h
        return best
