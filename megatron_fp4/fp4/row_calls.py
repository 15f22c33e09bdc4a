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

Above the cap, for a scoring pass: a oneDNN plan of a weight of at most CACHED_WEIGHT_ELEMENTS also
keeps ``tall`` heights, the multiples of TALL_STEP up to TALL_ROWS rows that pass the same probe
(in order; the tallest from misaligned rows too), and a run past the dense heights goes in one tall
call and a dense remainder (100 rows: 96 + 4): oneDNN reads rows 8-15 % faster at 96-256 rows than at
64 (an expert's [768, 1024], a [1024, 1024] projection; measured), at six extra primitives a shape
where every multiple of 4 to 256 took 48 (session 24: ~92 MiB and a 5.4 s LM-head probe).

And for a decode step's experts: runs of one small height (up to :data:`BATCHED_MAX_HEIGHT` rows)
of consecutive experts may go in one ``bmm`` over their slice of the stacked weight where the probe
finds it gives each run its own ``mm`` call's bits (``RowPlan.batched``; measured here at every
height 4-16, 1 and 2 threads, also under ``MKL_CBWR=COMPATIBLE`` and ``AVX2``).
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch

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
TALL_STEP = 32  # a oneDNN plan's heights past its CAP_TILES tiles: the multiples of this ...
TALL_ROWS = 256  # ... up to this many rows, where each passed the probe (`RowPlan.tall`), for a
# weight of at most CACHED_WEIGHT_ELEMENTS (an LM head's [8192, 1024]: its probe 0.7 -> 1.5 s and
# ~+48 MiB for ~2 % of a scoring pass; an expert's [768, 1024]: 0.11 -> 0.18 s, ~+10 MiB, measured)
# a weight of at least this many elements on mm is probed for its contiguous transposed copy
# (`RowPlan.transposed_copy`): below it the copy's lookup (~2 µs) costs about what a decode call
# saves ([128, 64]: 3.1 -> 2.4 µs)
TRANSPOSED_COPY_MIN_ELEMENTS = 1 << 15
# runs of one height up to this many rows (a decode step's few rows per expert) are probed for one
# `bmm` over consecutive experts' stacked weights (`RowPlan.batched`); past it a call's own work
# outweighs the per-call cost a batched call saves
BATCHED_MAX_HEIGHT = 16
BATCHED_PROBE_GROUPS = (2, 5)  # how many weights one probed batched call stacks
# What oneDNN keeps in its primitive cache per (weight shape, call height, weight form) once called:
# measured 8.6-9.0 MiB for 16 heights of either form, whatever the shape ([1024, 256] to [4096, 1024],
# 1 and 2 threads; `training.memory_plan` counts it).
ONEDNN_PRIMITIVE_BYTES = 576 << 10


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
    # onednn: its heights are the multiples of ``quantum`` from ``minimum`` to ``dense`` and the
    # multiples of ``tall`` past ``dense`` up to ``cap`` (0: every multiple of the quantum up to the
    # cap). A scoring pass's ~100 rows of an expert, or its 768 rows of a projection, then go in
    # one or two taller calls instead of 64-row ones (oneDNN reads rows 8-15 % faster at 96-256 rows
    # than at 64, measured), at a handful of extra primitives rather than one per multiple of 4
    dense: int = 0
    tall: int = 0

    def height(self, rows: int) -> int:
        """Rows ``rows`` are padded to: whole cap-row calls, then the remainder rounded up to a
        height of the plan, or past ``dense`` its whole ``tall`` steps and the rest rounded up (at
        least one call: 0 rows give ``minimum``; fewer than ``minimum`` rows at least ``low``, where
        the plan has short heights)."""
        if self.low and 0 < rows < self.minimum:
            return max(rows, self.low)
        full, rest = divmod(rows, self.cap)
        if rest == 0:
            return full * self.cap if full else self.minimum
        steps = rest // self.tall * self.tall if self.tall and rest > self.dense else 0
        rest -= steps
        return full * self.cap + steps + (max(self.minimum, -(-rest // self.quantum) * self.quantum) if rest else 0)

    def calls(self, height: int) -> list:
        """The call heights covering ``height`` rows (a value of :meth:`height`, or any multiple of
        the quantum from the minimum), in order: whole cap-row calls, then the rest in one call, or
        past ``dense`` in a ``tall`` multiple and what remains (one step less where that would
        leave fewer rows than the plan's smallest height)."""
        full, rest = divmod(height, self.cap)
        out = [self.cap] * full
        if self.tall and rest > self.dense:
            steps = rest // self.tall * self.tall
            rest -= steps
            if 0 < rest < (self.low or self.minimum):
                steps, rest = steps - self.tall, rest + self.tall
            out += [steps] if steps else []
        return out + ([rest] if rest else [])

    def heights(self) -> list:
        """Every height one call of the plan may take, ascending (the short ones first)."""
        short = list(range(self.low, self.minimum)) if self.low else []
        dense = list(range(self.minimum, (self.dense or self.cap) + 1, self.quantum))
        return short + dense + (list(range(self.dense // self.tall * self.tall + self.tall, self.cap + 1, self.tall))
                                if self.tall else [])

    def whole(self, rows: int) -> int:
        """How many of ``rows`` rows go in calls of the plan as they are, with no padding row: the
        whole cap-row calls and the rest cut to a multiple of the quantum (none of it under the
        minimum); :meth:`calls` covers them."""
        full, rest = divmod(rows, self.cap)
        return full * self.cap + (rest - rest % self.quantum if rest >= self.minimum else 0)

    def one_call(self, height: int) -> bool:
        """Whether ``height`` rows are one call of the plan (:meth:`calls` gives ``[height]``)."""
        return height <= self.cap and (not self.tall or height <= self.dense or height % self.tall == 0)


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
    """The bytes oneDNN's primitive cache keeps for a [·, k] · [k, n] GEMM the probe tried with it:
    one primitive per call height of the probe (the multiples of 4 up to CAP_TILES tiles, the short
    heights 1-3 it tries for ``RowPlan.low``, the tall ones it tries for ``RowPlan.tall``) and
    weight form (dense, packed), kept for the process's life (its cache holds up to 1024 primitives)."""
    dense = row_tile(k, n) * CAP_TILES
    tall = max(0, TALL_ROWS // TALL_STEP - dense // TALL_STEP) if _tall_probed(k, n) else 0
    return 2 * (dense // QUANTA[0] + QUANTA[0] - 1 + tall) * ONEDNN_PRIMITIVE_BYTES


def _tall_probed(k: int, n: int) -> bool:
    """Whether a oneDNN plan of a [·, k] · [k, n] GEMM tries ``RowPlan.tall``'s heights: a weight of
    at most CACHED_WEIGHT_ELEMENTS (see TALL_ROWS)."""
    return k * n <= CACHED_WEIGHT_ELEMENTS


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
    every height of that plan and from the misaligned rows (``RowPlan.transposed_copy``)."""
    cap = tile * CAP_TILES
    longest = max(cap, CAP_ROWS) if kernel == "mm" else cap  # heights past the cap tried (mm: its repacking)
    try_tall = kernel == "onednn" and _tall_probed(k, width)
    with torch.inference_mode(), torch.autocast("cpu", enabled=False):
        gen = torch.Generator().manual_seed(PROBE_SEED)
        wt = torch.randn(width, k, generator=gen).to(dtype).t()
        x = torch.randn(max(longest, TALL_ROWS) if try_tall else longest, k, generator=gen).to(dtype)
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
                tallest = _tall_top(x, top, minimum, needed, same) if try_tall else top
                return RowPlan(quantum, minimum, tallest, kernel, copy, batched, low if low < minimum else 0,
                               *((top, TALL_STEP) if tallest > top else (0, 0)))
    return RowPlan(tile, tile, tile)


def _tall_top(x: torch.Tensor, top: int, minimum: int, forms: list, same) -> int:
    """A oneDNN plan's tallest call (``RowPlan.tall``): the multiples of TALL_STEP past ``top`` (its
    CAP_TILES tiles) up to TALL_ROWS rows, each of ``forms`` tried on ``x``'s first rows while every
    one gave the tiles' bits (``same``), the tallest then from a misaligned copy too; ``top`` itself
    where none did, or where one step past ``top`` could leave a remainder no height of the plan
    takes (:meth:`RowPlan.calls`: TALL_STEP + ``minimum`` > ``top``)."""
    if TALL_STEP + minimum > top:
        return top
    tall = top
    for h in range(top // TALL_STEP * TALL_STEP + TALL_STEP, TALL_ROWS + 1, TALL_STEP):
        if not same(x[:h], forms):
            break
        tall = h
    if tall > top and not same(_misaligned(x[:tall]), forms):
        return top
    return tall


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
