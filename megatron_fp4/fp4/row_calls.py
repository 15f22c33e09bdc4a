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
is the tile itself (q = m = cap = T). The ``batch`` level then pads a call's rows to the next height
of the plan (a decode step's 2 rows of an expert to 4 instead of 16) and cuts longer runs into
cap-row calls (a scoring pass's 42 rows of an expert in one call instead of 3 tiles): the tiles'
bits at a lower price. The plan is a cached fact of the machine, not a mode: the bits are the
tiles' either way.
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
MIN_COLUMN_BLOCK = 256  # columns of a weight block at least
CAP_TILES = 4  # a call takes at most this many tiles' rows (a probed plan's cap)
QUANTA = (4, 8, 16)  # a probed plan's row quantum: the heights it may call are its multiples
PROBE_SEED = 0x5EED


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
    alone, as the row tile."""
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
    (the fixed tile T: ``RowPlan(T, T, T)``)."""

    quantum: int
    minimum: int
    cap: int

    def height(self, rows: int) -> int:
        """Rows ``rows`` are padded to: whole cap-row calls, then the remainder rounded up to a
        height of the plan (at least one call: 0 rows give ``minimum``)."""
        full, rest = divmod(rows, self.cap)
        if rest == 0:
            return full * self.cap if full else self.minimum
        return full * self.cap + max(self.minimum, -(-rest // self.quantum) * self.quantum)

    def calls(self, height: int) -> list:
        """The call heights covering ``height`` rows (a value of :meth:`height`), in order."""
        full, rest = divmod(height, self.cap)
        return [self.cap] * full + ([rest] if rest else [])


def fixed_plan(k: int, n: int) -> RowPlan:
    """The tile itself: every call [T, K] · [K, Nb], T = :func:`row_tile` ``(k, n)``."""
    tile = row_tile(k, n)
    return RowPlan(tile, tile, tile)


_PLANS: dict = {}
_LOCK = threading.Lock()


def row_plan(k: int, n: int, dtype: torch.dtype, device: torch.device) -> RowPlan:
    """The :class:`RowPlan` of a [·, k] · [k, n] GEMM (the weight the transpose of a row-major
    [n, k]) at ``dtype`` on ``device`` at the current thread count and fp32 matmul precision: probed
    on CPU once per shape, dtype and setting (every column block's call shape, :func:`_run_probe`),
    the fixed tile elsewhere."""
    if torch.device(device).type != "cpu":
        return fixed_plan(k, n)
    key = (k, n, dtype, torch.get_num_threads(), torch.get_float32_matmul_precision())
    plan = _PLANS.get(key)
    if plan is None:
        plan = _combined(k, n, dtype, key[3:])
        with _LOCK:
            _PLANS[key] = plan
    return plan


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
    if any(p.cap != tile * CAP_TILES for p in plans):  # a block kept the fixed tile
        return fixed_plan(k, n)
    return RowPlan(quantum, minimum, tile * CAP_TILES)


@functools.lru_cache(maxsize=None)
def _probe_cached(k: int, width: int, stride: int, tile: int, dtype: torch.dtype, setting: tuple) -> RowPlan:
    """:func:`_run_probe` remembered per ``setting`` (the thread count and fp32 matmul precision
    it ran at: the BLAS's choices change with them)."""
    return _run_probe(k, width, stride, tile, dtype)


def _run_probe(k: int, width: int, stride: int, tile: int, dtype: torch.dtype) -> RowPlan:
    """Which call heights give a [h, k] · [k, width] call (output row stride ``stride``) the bits
    of T = ``tile``-row calls in every row: the multiples of 4 up to ``CAP_TILES`` tiles tried on
    random rows, the smallest quantum and minimum (at most T: else the tile is as cheap) whose
    heights all passed, confirmed from a misaligned copy of the rows at the minimum and the cap."""
    cap = tile * CAP_TILES
    with torch.inference_mode(), torch.autocast("cpu", enabled=False):
        gen = torch.Generator().manual_seed(PROBE_SEED)
        wt = torch.randn(width, k, generator=gen).to(dtype).t()
        x = torch.randn(cap, k, generator=gen).to(dtype)
        ref = torch.empty(cap, stride, dtype=dtype)[:, :width]
        for xt, ot in zip(x.split(tile), ref.split(tile)):
            torch.mm(xt, wt, out=ot)

        def same(rows: torch.Tensor) -> bool:
            out = torch.empty(rows.shape[0], stride, dtype=dtype)[:, :width]
            torch.mm(rows, wt, out=out)
            return torch.equal(out, ref[:rows.shape[0]])

        good = {h for h in range(QUANTA[0], cap + 1, QUANTA[0]) if same(x[:h])}
        for quantum in QUANTA:
            for minimum in range(quantum, tile + 1, quantum):
                if not all(h in good for h in range(minimum, cap + 1, quantum)):
                    continue
                shifted = torch.empty(cap * k + 1, dtype=dtype)[1:].view(cap, k).copy_(x)
                if same(shifted[:minimum]) and same(shifted):
                    return RowPlan(quantum, minimum, cap)
                return RowPlan(tile, tile, tile)
    return RowPlan(tile, tile, tile)
