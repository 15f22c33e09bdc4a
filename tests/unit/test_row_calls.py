"""The ``batch`` level's GEMM call heights (``fp4/row_calls.py``): a probed plan's calls give every
row the bits of the weight's fixed row tile, checked here on other random rows than the probe's, at
one and two threads (run under ``ATEN_CPU_CAPABILITY`` / ``MKL_CBWR`` variations too:
``tools/check_portability.sh``); the plan's arithmetic; the probe's choice and fallback."""
from __future__ import annotations

import functools

import pytest
import torch

from megatron_fp4.fp4 import row_calls
from megatron_fp4.fp4.row_calls import RowPlan, column_blocks, fixed_plan, onednn_linear, row_plan, row_tile
from megatron_fp4.fp4.tiled import _row_products, tiled_grouped_linear, tiled_linear


def bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def tiles(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The definition: ``x @ wᵀ`` in [T, K] · [K, Nb] calls of the shape's kernel (oneDNN's or
    ``mm``, ``row_plan(...).kernel``), T the weight's fixed row tile."""
    tile = fixed_plan(w.shape[1], w.shape[0]).cap
    plan = RowPlan(tile, tile, tile, row_plan(w.shape[1], w.shape[0], x.dtype, x.device).kernel)
    height = plan.height(x.shape[0])
    xp = torch.cat([x, x.new_zeros(height - x.shape[0], x.shape[1])])
    out = x.new_empty(height, w.shape[0])
    _row_products(xp, w.t(), out, plan)
    return out[:x.shape[0]]


def test_plan_heights_and_calls():
    plan = RowPlan(4, 8, 64)
    assert [plan.height(n) for n in (0, 1, 8, 9, 64, 65, 70, 128, 130)] == [8, 8, 8, 12, 64, 72, 72, 128, 136]
    assert plan.calls(136) == [64, 64, 8] and plan.calls(8) == [8] and plan.calls(128) == [64, 64]
    tile = RowPlan(16, 16, 16)
    assert [tile.height(n) for n in (0, 1, 16, 17)] == [16, 16, 16, 32] and tile.calls(48) == [16, 16, 16]
    assert fixed_plan(1024, 1024) == RowPlan(16, 16, 16) and fixed_plan(64, 64) == RowPlan(64, 64, 64)
    low = RowPlan(4, 4, 64, "onednn", low=2)  # oneDNN's short heights: 2 and 3 rows called as they are
    assert [low.height(n) for n in (0, 1, 2, 3, 4, 5, 64, 65, 66)] == [4, 2, 2, 3, 4, 8, 64, 68, 68]
    assert low.calls(2) == [2] and low.calls(3) == [3] and low.calls(68) == [64, 4]
    # a oneDNN plan past its probed heights: every multiple of the quantum to the cap (those past
    # `dense` verified at their first call); one that differs goes in probed heights (`dense_calls`)
    tall = RowPlan(4, 4, 256, "onednn", low=2, dense=64)
    assert tall.heights() == [2, 3] + list(range(4, 257, 4))
    assert low.heights() == [2, 3] + list(range(4, 65, 4))
    assert RowPlan(8, 16, 64).heights() == [16, 24, 32, 40, 48, 56, 64]
    assert [tall.height(n) for n in (1, 65, 68, 96, 97, 100, 130, 256, 257, 300)] == \
        [2, 68, 68, 96, 100, 100, 132, 256, 260, 300]
    assert tall.calls(100) == [100] and tall.calls(300) == [256, 44] and tall.calls(260) == [256, 4]
    assert tall.dense_calls(100) == [64, 36] and tall.dense_calls(68) == [64, 4] and tall.dense_calls(256) == [64] * 4
    assert RowPlan(4, 8, 256, "onednn", dense=64).dense_calls(68) == [60, 8]  # 4 rows: under the minimum
    assert RowPlan(8, 16, 256, "onednn", dense=64).dense_calls(136) == [64, 56, 16]
    for n in range(0, 600):  # every height is covered by calls the plan allows
        for p in (plan, tile, RowPlan(4, 4, 256), low, tall, RowPlan(4, 8, 256, "onednn", dense=64),
                  RowPlan(8, 16, 256, "onednn", dense=64)):
            allowed = set(p.heights())
            height = p.height(n)
            calls = p.calls(height)
            assert sum(calls) == height >= n and set(calls) <= allowed, (p, n, calls)
            assert p.one_call(height) == (len(calls) == 1), (p, n)
            for c in calls:  # a call past the probed heights, cut into them where it is not verified
                if p.dense and c > p.dense:
                    pieces = p.dense_calls(c)
                    assert sum(pieces) == c and set(pieces) <= allowed and max(pieces) <= p.dense, (p, c, pieces)
            body = p.whole(n)  # `_runs_in_place`'s rows called in place, the rest padded
            assert n - body < max(p.quantum, p.minimum) and (n - body < p.quantum or body == n - n % p.cap), (p, n)
            assert not body or set(p.calls(body)) <= allowed and sum(p.calls(body)) == body, (p, n)


def test_other_devices_keep_the_fixed_tile():
    assert row_plan(1024, 768, torch.float32, torch.device("cuda")) == fixed_plan(1024, 768)


# wide (tile 16, one block), narrow (tiles 32 and 128), column blocks of 512 with a wider last one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k,n", [(1024, 768), (64, 128), (16, 48), (1024, 2600), (100, 60), (256, 512)])
def test_every_height_of_the_plan_gives_the_tiles_bits(threads, k, n, dtype):
    """Fresh rows (another generator than the probe's) at every height the plan may call, alone and
    inside longer inputs: one call's rows equal the fixed tiles' bit for bit; and tiled_linear (the
    production path) equals the tiles at row counts around every call boundary."""
    plan = row_plan(k, n, dtype, torch.device("cpu"))
    tile = row_tile(k, n)
    assert plan.cap % plan.quantum == 0 and plan.minimum <= tile <= plan.cap and plan.minimum % plan.quantum == 0
    g = torch.Generator().manual_seed(k * n)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    x = torch.randn(2 * plan.cap + tile, k, generator=g).to(dtype)
    want = tiles(x, w)
    blocks = column_blocks(k, n)
    packed = row_calls.onednn_pack(w) if plan.kernel == "onednn" else None
    for h in plan.heights()[len(range(plan.low, plan.minimum)) if plan.low else 0:]:
        if plan.dense and h > plan.dense:  # verified at a first call: where it agreed, on these rows too
            for form in (w, packed):
                if row_calls.tall_agrees(k, n, dtype, form.is_mkldnn, h):
                    assert torch.equal(bits(onednn_linear(x[:h], form)), bits(want[:h])), f"height {h} of {plan}"
            out = _row_products(x[:h], w.t(), None, plan)  # the production calls (cut where not verified)
        elif plan.kernel == "onednn":
            out = onednn_linear(x[:h], w)
        else:
            out = x.new_empty(h, n)
            for j, width in blocks:
                torch.mm(x[:h], w.t()[:, j:j + width], out=out[:, j:j + width])
        assert torch.equal(bits(out), bits(want[:h])), f"height {h} of {plan}"
        if plan.transposed_copy:  # the rollout side's operand: the contiguous transposed copy
            assert len(blocks) == 1 and torch.equal(bits(torch.mm(x[:h], w.t().contiguous())), bits(want[:h])), h
    if plan.low:  # oneDNN's short heights, both weight forms (the trainer's dense, a rollout's packed)
        assert plan.kernel == "onednn" and 0 < plan.low < plan.minimum
        for h in range(plan.low, plan.minimum):
            for form in (w, packed):
                assert torch.equal(bits(onednn_linear(x[:h], form)), bits(want[:h])), f"short height {h} of {plan}"
    for rows in sorted({1, 2, 3, plan.minimum - 1, plan.minimum + 1, tile + 1, plan.cap - 1, plan.cap + 1, x.shape[0]}):
        if rows > 0:
            assert torch.equal(bits(tiled_linear(x[:rows], w)), bits(want[:rows])), f"{rows} rows"
    counts = [1, 0, plan.cap + 3, 2, tile]
    grouped = tiled_grouped_linear(x[:sum(counts)], [w] * len(counts), counts)
    runs = [tiles(r, w) for r, c in zip(x[:sum(counts)].split(counts), counts) if c]
    assert torch.equal(bits(grouped), bits(torch.cat(runs)))


def test_the_probe_leaves_the_global_generator_alone():
    row_calls._probe_cached.cache_clear()
    state = torch.get_rng_state()
    row_calls._probe_cached(96, 80, 80, row_tile(96, 80), torch.float32, (1, "highest"))
    assert torch.equal(torch.get_rng_state(), state)


def test_the_probe_keeps_only_heights_that_match_and_falls_back_to_the_tile(monkeypatch):
    """A GEMM whose heights off a multiple of 8 (or below 12, past 100, at 68, or every height but
    the tile's) round otherwise: the plan takes quantum 8 (minimum 12, cap 100, cap 64, or the tile
    itself). The GEMM computes each row alone (the same bits at every height whatever this machine's
    kernels do) before the height decides."""
    real_mm = torch.mm

    def make(bad):
        def mm(a, b, out=None):
            r = torch.cat([real_mm(a[i:i + 1], b) for i in range(a.shape[0])])
            if bad(a.shape[0]):
                r.mul_(1 + 2 ** -20)
            return r if out is None else out.copy_(r)
        return mm

    tile = row_tile(64, 256)
    longest = row_calls.CAP_ROWS  # mm's heights past the CAP_TILES tiles: the cap raised while each passed
    monkeypatch.setattr(row_calls, "_batched_agrees", lambda *a: False)  # its own test below
    monkeypatch.setattr(row_calls.torch, "mm", make(lambda h: h % 8 != 0))
    assert row_calls._run_probe(64, 256, 256, tile, torch.float32) == RowPlan(8, 8, longest)
    monkeypatch.setattr(row_calls.torch, "mm", make(lambda h: h < 12 or h % 4 != 0))
    assert row_calls._run_probe(64, 256, 256, tile, torch.float32) == RowPlan(4, 12, longest)
    monkeypatch.setattr(row_calls.torch, "mm", make(lambda h: h > 100))  # the cap stops below the first miss
    assert row_calls._run_probe(64, 256, 256, tile, torch.float32) == RowPlan(4, 4, 100)
    monkeypatch.setattr(row_calls.torch, "mm", make(lambda h: h == tile * row_calls.CAP_TILES + 4))
    assert row_calls._run_probe(64, 256, 256, tile, torch.float32) == RowPlan(4, 4, tile * row_calls.CAP_TILES)
    monkeypatch.setattr(row_calls.torch, "mm", make(lambda h: h != tile))
    assert row_calls._run_probe(64, 256, 256, tile, torch.float32) == RowPlan(tile, tile, tile)


needs_onednn = pytest.mark.skipif(not row_calls._onednn_usable(), reason="oneDNN's fp32 inner product unusable here")


def onednn_in_tiles(tile: int):
    """oneDNN's inner product as calls of ``tile`` rows (the real one, before a test patches it):
    every height and weight form gives the tiles' bits, whatever this machine's kernels do."""
    real = row_calls.onednn_linear

    def linear(x, w):
        xp = torch.cat([x, x.new_zeros(-x.shape[0] % tile, x.shape[1])])
        return torch.cat([real(t, w) for t in xp.split(tile)])[:x.shape[0]]
    return linear


@needs_onednn
def test_the_onednn_probe_keeps_matching_heights_else_leaves_the_shape_to_mm(monkeypatch):
    """oneDNN heights off a multiple of 8 (one form only: the dense weight's) round otherwise: quantum
    8 on oneDNN; every height but the tile's: no oneDNN plan, and row_plan falls back to mm's."""
    k, n = 512, 512
    tile = row_tile(k, n)
    base = onednn_in_tiles(tile)

    def make(bad):
        def linear(x, w):
            r = base(x, w)
            return r * (1 + 2 ** -20) if bad(x.shape[0], w) else r
        return linear

    dense = tile * row_calls.CAP_TILES
    tall = dict(dense=dense)
    top = row_calls.TALL_ROWS
    # the heights alone: the row-streaming kernel's probe (`RowPlan.stream`: test_row_stream.py) left out
    monkeypatch.setattr(row_calls, "_stream_agrees", lambda *a: False)
    monkeypatch.setattr(row_calls, "onednn_linear", make(lambda h, w: h % 8 != 0 and not w.is_mkldnn))
    assert row_calls._run_probe(k, n, n, tile, torch.float32, "onednn") == RowPlan(8, 8, top, "onednn", **tall)
    # the short heights below the minimum: kept down from minimum - 1 while both forms agree at each
    for bad, low in ((lambda h, w: False, 1), (lambda h, w: h == 1 and not w.is_mkldnn, 2),
                     (lambda h, w: h == 2 and w.is_mkldnn, 3), (lambda h, w: h == 3, 0)):
        monkeypatch.setattr(row_calls, "onednn_linear", make(bad))
        assert row_calls._run_probe(k, n, n, tile, torch.float32, "onednn") == \
            RowPlan(4, 4, top, "onednn", low=low, **tall), low

    monkeypatch.setattr(row_calls, "onednn_linear", make(lambda h, w: False))
    cached = row_calls.CACHED_WEIGHT_ELEMENTS
    monkeypatch.setattr(row_calls, "CACHED_WEIGHT_ELEMENTS", k * n - 1)  # a larger weight: the same plan (its
    assert row_calls._run_probe(k, n, n, tile, torch.float32, "onednn") == \
        RowPlan(4, 4, top, "onednn", low=1, **tall)  # calls past `dense` multiples of it: `onednn_calls`)
    assert row_calls.tall_heights(k, n) == (top - dense) // dense
    monkeypatch.setattr(row_calls, "CACHED_WEIGHT_ELEMENTS", cached)

    def misaligned(x, w):  # 2 rows from the probe's misaligned copy differ: 3 is the lowest
        r = base(x, w)
        return r * (1 + 2 ** -20) if x.shape[0] == 2 and x.data_ptr() % 16 else r
    monkeypatch.setattr(row_calls, "onednn_linear", misaligned)
    assert row_calls._run_probe(k, n, n, tile, torch.float32, "onednn").low == 3
    monkeypatch.setattr(row_calls, "onednn_linear", make(lambda h, w: h != tile))
    assert row_calls._run_probe(k, n, n, tile, torch.float32, "onednn") == RowPlan(tile, tile, tile)
    monkeypatch.setattr(row_calls, "_PLANS", {})
    monkeypatch.setattr(row_calls, "_probe_cached", functools.lru_cache(maxsize=None)(row_calls._probe_cached.__wrapped__))
    assert row_plan(k, n, torch.float32, torch.device("cpu")).kernel == "mm"


@needs_onednn
def test_a_height_past_the_probed_ones_is_verified_at_its_first_call_and_cut_where_it_differs(monkeypatch):
    """A oneDNN plan's heights past ``dense``: each verified once per form at the first call that
    takes it (aligned and misaligned random rows against the tiles), a call of a height that differs
    (on that form, or only from misaligned rows) cut into probed heights; the products keep the
    tiles' bits either way, and the verdict is remembered (no second check)."""
    k, n = 512, 512
    base = onednn_in_tiles(row_tile(k, n))
    calls = []

    def linear(x, w):
        calls.append((x.shape[0], w.is_mkldnn))
        r = base(x, w)
        differs = (x.shape[0] == 100 and not w.is_mkldnn) or (x.shape[0] == 200 and x.data_ptr() % 16 != 0)
        return r * (1 + 2 ** -20) if differs else r

    monkeypatch.setattr(row_calls, "onednn_linear", linear)
    monkeypatch.setattr(row_calls, "_TALL", {})
    plan = RowPlan(4, 4, 256, "onednn", dense=64)
    args = (k, n, torch.float32)
    assert row_calls.onednn_calls(plan, *args, True, 100) == [100]  # the packed form agrees at 100
    assert row_calls.onednn_calls(plan, *args, False, 100) == [64, 36]  # the dense form does not
    assert row_calls.onednn_calls(plan, *args, False, 200) == [64, 64, 64, 8]  # only misaligned rows differ
    assert row_calls.onednn_calls(plan, *args, False, 300) == [256, 44]
    assert row_calls.onednn_calls(plan, *args, False, 64) == [64]
    assert sorted(key[3:5] for key in row_calls._TALL) == [(False, 100), (False, 200), (False, 256), (True, 100)]
    calls.clear()
    assert row_calls.onednn_calls(plan, *args, False, 100) == [64, 36] and not calls  # remembered
    g = torch.Generator().manual_seed(3)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    x = torch.randn(300, k, generator=g)
    monkeypatch.setattr("megatron_fp4.fp4.tiled.onednn_linear", linear)
    for rows in (100, 200, 300):
        out = _row_products(x[:rows], w.t(), None, plan)
        assert torch.equal(bits(out), bits(base(x[:rows], w))), rows


@needs_onednn
def test_a_weight_past_the_cached_size_calls_only_multiples_of_its_probed_cap(monkeypatch):
    """A weight of more than CACHED_WEIGHT_ELEMENTS (an LM head): past ``dense`` a call takes the
    largest multiple of it (verified at its first call, cut into probed heights where it differs) and
    the rest in a probed height — never a rest under the plan's smallest height — so a process
    verifies at most ``tall_heights`` heights of it; the products keep the tiles' bits."""
    k, n = 512, 512
    base = onednn_in_tiles(row_tile(k, n))
    checked = []

    def linear(x, w):
        r = base(x, w)
        return r * (1 + 2 ** -20) if x.shape[0] == 192 else r  # 192 rows differ

    monkeypatch.setattr(row_calls, "onednn_linear", linear)
    monkeypatch.setattr(row_calls, "_TALL", {})
    monkeypatch.setattr(row_calls, "CACHED_WEIGHT_ELEMENTS", k * n - 1)
    real = row_calls._tall_check
    monkeypatch.setattr(row_calls, "_tall_check", lambda *a: checked.append(a[-1]) or real(*a))
    args = (k, n, torch.float32, True)
    plan = RowPlan(4, 4, 256, "onednn", low=2, dense=64)
    assert row_calls.onednn_calls(plan, *args, 188) == [128, 60]
    assert row_calls.onednn_calls(plan, *args, 256 + 132) == [256, 128, 4]
    assert row_calls.onednn_calls(plan, *args, 200) == [64, 64, 64, 8]  # 192 differs: probed heights
    assert row_calls.onednn_calls(plan, *args, 100) == [64, 36]
    assert sorted(checked) == [128, 192, 256] and row_calls.tall_heights(k, n) == 3
    coarse = RowPlan(8, 16, 256, "onednn", dense=64)  # quantum 8, minimum 16: no 8-row rest
    assert row_calls.onednn_calls(coarse, *args, 136) == [64, 56, 16]
    g = torch.Generator().manual_seed(4)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    x = torch.randn(400, k, generator=g)
    monkeypatch.setattr("megatron_fp4.fp4.tiled.onednn_linear", linear)
    for rows in (188, 200, 388):
        assert torch.equal(bits(_row_products(x[:rows], w.t(), None, plan)), bits(base(x[:rows], w))), rows


def test_the_transposed_copy_is_kept_only_where_every_height_of_the_plan_agrees(monkeypatch):
    """mm's contiguous transposed copy: probed for a whole weight of at least
    TRANSPOSED_COPY_MIN_ELEMENTS; a copy whose calls round otherwise at one height (here 12, or only
    from a misaligned input) leaves the plan as the view's with ``transposed_copy`` off; a narrower
    weight is not probed for it."""
    real_mm = torch.mm

    def make(bad):
        def mm(a, b, out=None):  # each row alone, on the view: the same bits at every height and for both forms
            copy = b.is_contiguous()  # (the view is the transpose of a row-major weight)
            view = b.t().contiguous().t() if copy else b
            r = torch.cat([real_mm(a[i:i + 1], view) for i in range(a.shape[0])])
            if copy and bad(a):  # only the copy's calls
                r.mul_(1 + 2 ** -20)
            return r if out is None else out.copy_(r)
        return mm

    k, n = 128, 256
    tile, longest = row_tile(k, n), row_calls.CAP_ROWS
    assert k * n >= row_calls.TRANSPOSED_COPY_MIN_ELEMENTS
    monkeypatch.setattr(row_calls, "_batched_agrees", lambda *a: False)  # its own test below
    monkeypatch.setattr(row_calls.torch, "mm", make(lambda a: False))
    assert row_calls._run_probe(k, n, n, tile, torch.float32) == RowPlan(4, 4, longest, "mm", True)
    assert row_calls._run_probe(k, n, 2 * n, tile, torch.float32) == RowPlan(4, 4, longest)  # a column block: no copy
    monkeypatch.setattr(row_calls.torch, "mm", make(lambda a: a.shape[0] == 12))
    assert row_calls._run_probe(k, n, n, tile, torch.float32) == RowPlan(4, 4, longest)
    monkeypatch.setattr(row_calls.torch, "mm", make(lambda a: a.data_ptr() % 16 != 0))  # misaligned rows
    assert row_calls._run_probe(k, n, n, tile, torch.float32) == RowPlan(4, 4, longest)
    monkeypatch.setattr(row_calls.torch, "mm", make(lambda a: False))
    assert row_calls._run_probe(64, 128, 128, row_tile(64, 128), torch.float32).transposed_copy is False


@pytest.mark.parametrize("k,n", [(256, 512), (128, 256)])
def test_a_rollout_stores_transposed_copy_gives_the_views_same_bits(threads, k, n):
    """A rollout store's GEMMs (linear, grouped, the expert MLP) give the trainer's bits (no store:
    the view) at decode and prefill row counts. Where the plan keeps mm's transposed copy, the copy
    is made once per weight version (a stacked expert weight: one [E, k, n] copy) and remade after
    an in-place update; where this machine's probe refused it, the store holds no copy (and no
    skip: the bits are checked either way)."""
    from megatron_fp4.fp4.tiled import _transposed, tiled_grouped_mlp
    plan = row_plan(k, n, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    x = torch.randn(300, k, generator=g)
    store: dict = {}
    for rows in (1, 2, 5, 8, 16, 37, 300):
        assert torch.equal(bits(tiled_linear(x[:rows], w, packs=store)), bits(tiled_linear(x[:rows], w))), rows
    copies = [entry[2] for entry in store.values()]
    if plan.transposed_copy:
        (copy,) = copies
        assert copy.is_contiguous() and torch.equal(copy, w.t())
    else:
        assert not copies, plan
    w.mul_(0.5)  # a new version: a new copy, the new bits
    assert torch.equal(bits(tiled_linear(x[:3], w, packs=store)), bits(tiled_linear(x[:3], w)))
    assert not any(entry[2] is c for entry in store.values() for c in copies)
    E = 4
    w13, w2 = torch.randn(E, n, k, generator=g) / k ** 0.5, torch.randn(E, k, n // 2, generator=g) / n ** 0.5
    act = lambda h: torch.nn.functional.silu(h[:, :n // 2]) * h[:, n // 2:]  # noqa: E731
    for counts in ([2, 0, 1, 3], [40, 7, 0, 90]):
        stacked: dict = {}
        xs = x[:sum(counts)]
        with torch.no_grad():
            assert torch.equal(bits(tiled_grouped_mlp(xs, w13, w2, counts, act, stacked)),
                               bits(tiled_grouped_mlp(xs, w13, w2, counts, act)))
            assert torch.equal(bits(tiled_grouped_linear(xs, w13, counts, stacked)),
                               bits(tiled_grouped_linear(xs, w13, counts)))
        kept = [entry[2] for entry in stacked.values() if entry[2].dim() == 3]
        p2 = row_plan(n // 2, k, torch.float32, torch.device("cpu"))
        assert len(kept) == plan.transposed_copy + p2.transposed_copy
        if plan.transposed_copy:
            assert any(torch.equal(c, _transposed(w13)) for c in kept)


@pytest.mark.parametrize("k,n", [(256, 512), (64, 128), (100, 60), (1024, 768)])
def test_many_rows_in_place_give_the_padded_layouts_same_bits(threads, k, n):
    """A grouped GEMM of more than LAYOUT_LIST_ROWS rows (`_runs_in_place`: each run's whole calls on
    its rows in place, only its tail padded) against the padded layout (`GroupedRows`), bit for
    bit, for runs shorter than the plan's minimum, off and on the quantum, past the cap; with a
    rollout store too (its copies where the plan keeps them)."""
    from megatron_fp4.fp4.tiled import LAYOUT_LIST_ROWS, GroupedRows, _run_tiles, _runs_in_place
    plan = row_plan(k, n, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(11 * k + n)
    q, m, cap = plan.quantum, plan.minimum, plan.cap
    for counts in ([1, q + 1, 0, m + 3, cap + 1, 2 * cap + q, LAYOUT_LIST_ROWS - 7],
                   [cap, 0, q, m - 1 if m > 1 else 1, 3, LAYOUT_LIST_ROWS]):
        weights = torch.randn(len(counts), n, k, generator=g) / k ** 0.5
        x = torch.randn(sum(counts), k, generator=g)
        layout = GroupedRows(counts, (plan,), x.device)
        want = layout.unpad(_run_tiles(layout.pad(x), weights.unbind(0), layout, plan))
        assert sum(counts) > LAYOUT_LIST_ROWS
        for store in (None, {}):
            got = _runs_in_place(x, weights, counts, plan, store)
            assert torch.equal(bits(got), bits(want)), (counts, store is not None)
            assert torch.equal(bits(tiled_grouped_linear(x, weights, counts, store)), bits(want))
        # a oneDNN call reads the next runs' rows in place of padding: never into a run's own rows
        poisoned = x.clone()
        poisoned[counts[0] + counts[1]:] = float("nan")
        first = counts[0] + counts[1]
        assert torch.equal(bits(_runs_in_place(poisoned, weights, counts, plan)[:first]), bits(want[:first]))


def test_the_batched_call_is_kept_only_where_every_small_height_and_group_agrees(monkeypatch):
    """``RowPlan.batched``: one bmm of G stacked runs must give each run its own mm call's bits at
    every height of the plan up to BATCHED_MAX_HEIGHT, for every probed group size, from aligned and
    misaligned rows, on each operand form the plan reads; a bmm that rounds otherwise at one height,
    one group size, from misaligned rows only, or on the transposed copy only leaves it off; a
    column block (not the whole weight) is not batched."""
    real_mm, real_bmm = torch.mm, torch.bmm

    def mm(a, b, out=None):  # each row alone, on the view: the same bits at every height and for both forms
        view = b.t().contiguous().t() if b.is_contiguous() else b
        r = torch.cat([real_mm(a[i:i + 1], view) for i in range(a.shape[0])])
        return r if out is None else out.copy_(r)

    def make(bad):
        def bmm(a, b, out=None):  # each matrix as mm computes it, perturbed where bad
            r = torch.stack([mm(a[i], b[i]) for i in range(a.shape[0])])
            if bad(a, b):
                r.mul_(1 + 2 ** -20)
            return r if out is None else out.copy_(r)
        return bmm

    k, n = 128, 256
    tile, longest = row_tile(k, n), row_calls.CAP_ROWS
    monkeypatch.setattr(row_calls.torch, "mm", mm)
    monkeypatch.setattr(row_calls.torch, "bmm", make(lambda a, b: False))
    assert row_calls._run_probe(k, n, n, tile, torch.float32) == RowPlan(4, 4, longest, "mm", True, True)
    assert row_calls._run_probe(k, n, 2 * n, tile, torch.float32) == RowPlan(4, 4, longest)  # a column block
    for bad in (lambda a, b: a.shape[1] == 12, lambda a, b: a.shape[0] == max(row_calls.BATCHED_PROBE_GROUPS),
                lambda a, b: a.data_ptr() % 16 != 0, lambda a, b: b.is_contiguous()):
        monkeypatch.setattr(row_calls.torch, "bmm", make(bad))
        assert row_calls._run_probe(k, n, n, tile, torch.float32) == RowPlan(4, 4, longest, "mm", True, False)
    monkeypatch.setattr(row_calls.torch, "bmm", make(lambda a, b: a.shape[1] == 20))  # past BATCHED_MAX_HEIGHT
    assert row_calls._run_probe(k, n, n, tile, torch.float32).batched


@pytest.mark.parametrize("k,n", [(64, 512), (256, 64), (512, 256), (128, 48)])
def test_batched_runs_same_bits_as_each_runs_own_calls(threads, k, n, monkeypatch):
    """A decode step's expert GEMMs (`_run_tiles` on a stacked weight, runs of one height in one bmm
    where the plan is ``batched``): every run's rows equal its own ``tiled_linear`` call bit for bit,
    with and without a rollout store, for runs of equal heights, mixed heights, empty experts
    between them and a run past BATCHED_MAX_HEIGHT; the expert MLP equals its per-expert form. On a
    machine whose plan is batched the bmm is called (else the runs' own calls are, the same bits)."""
    from megatron_fp4.fp4.tiled import tiled_grouped_mlp
    plan = row_plan(k, n, torch.float32, torch.device("cpu"))
    calls = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **kw: calls.append(a[0].shape) or real_bmm(*a, **kw))
    g = torch.Generator().manual_seed(7 * k + n)
    E = 8
    w = torch.randn(E, n, k, generator=g) / k ** 0.5
    w2 = torch.randn(E, k, n // 2, generator=g) / n ** 0.5
    act = lambda h: torch.nn.functional.silu(h[:, :n // 2]) * h[:, n // 2:]  # noqa: E731
    for counts in ([2, 2, 1, 3, 4, 2, 1, 1], [1, 0, 3, 0, 2, 2, 6, 7], [20, 2, 2, 0, 5, 9, 3, 3]):
        x = torch.randn(sum(counts), k, generator=g)
        with torch.no_grad():
            own = torch.cat([tiled_linear(xe, w[e]) for e, xe in enumerate(x.split(counts))])
            h = act(own)
            mlp = torch.cat([tiled_linear(he, w2[e]) for e, he in enumerate(h.split(counts))])
            for store in (None, {}):
                assert torch.equal(bits(tiled_grouped_linear(x, w, counts, store)), bits(own)), (counts, store)
                assert torch.equal(bits(tiled_grouped_mlp(x, w, w2, counts, act, store)), bits(mlp)), (counts, store)
    assert bool(calls) == plan.batched, (plan, calls)


def test_onednn_serves_wide_fp32_weights_only():
    assert not row_calls.onednn_serves(64, 64, torch.float32)
    assert not row_calls.onednn_serves(1024, 1024, torch.bfloat16)
    assert row_calls.onednn_serves(512, 512, torch.float32) == row_calls._onednn_usable()


@needs_onednn
def test_packed_weights_are_made_once_per_version_and_give_the_dense_bits(monkeypatch):
    """The rollout side's packed copy (kept in a weight cache) and the trainer's dense weight give
    the same bits; the copy is reused until the weight changes in place, then remade (an inference
    tensor, which cannot: until the store is cleared); a per-call temporary's copy leaves the store
    with it; no store: the dense weight."""
    from megatron_fp4.fp4.tiled import _onednn_weight
    # oneDNN's packs alone: plans probed without the row-streaming kernel (whose own packed copy
    # replaces oneDNN's in a store where a plan keeps it: test_row_stream.py)
    monkeypatch.setattr(row_calls, "_stream_agrees", lambda *a: False)
    monkeypatch.setattr(row_calls, "_PLANS", {})
    monkeypatch.setattr(row_calls, "_probe_cached", functools.lru_cache(maxsize=None)(row_calls._probe_cached.__wrapped__))
    g = torch.Generator().manual_seed(3)
    w = torch.randn(768, 512, generator=g) / 512 ** 0.5
    x = torch.randn(37, 512, generator=g)
    store: dict = {}
    dense = tiled_linear(x, w)
    assert torch.equal(bits(tiled_linear(x, w, packs=store)), bits(dense)) and len(store) == 1
    packed = next(iter(store.values()))[2]
    assert packed.is_mkldnn and _onednn_weight(w, store) is packed  # reused
    w.mul_(0.5)  # an in-place update bumps the version: a new copy, the new bits
    assert torch.equal(bits(tiled_linear(x[:3], w, packs=store)), bits(tiled_linear(x[:3], w)))
    assert _onednn_weight(w, store) is not packed
    assert _onednn_weight(w, None) is w
    kept = len(store)
    for _ in range(3):  # another layout: a contiguous copy per call, packed and forgotten with it
        assert torch.equal(bits(tiled_linear(x[:6], w.t().contiguous().t(), packs=store)), bits(tiled_linear(x[:6], w)))
    assert len(store) == kept
    with torch.inference_mode():
        wi = w.clone()
        assert torch.equal(bits(tiled_linear(x[:5], wi, packs=store)), bits(tiled_linear(x[:5], w)))
    assert _onednn_weight(wi, store) is _onednn_weight(wi, store) and _onednn_weight(wi, store).is_mkldnn


def test_only_a_rollout_model_keeps_packed_weights():
    from megatron_fp4.fp4 import Numerics
    for mode, keeps in (("rollout", True), ("train", False)):
        nx = Numerics(invariance="batch", mode=mode)
        with nx.cached_weights() as _:
            assert (nx.weight_packs() is nx.weight_cache) == keeps and nx.weight_cache is not None
        assert nx.weight_packs() is None


def test_a_narrow_weight_is_the_first_columns_of_its_zero_padded_copy(threads):
    """Fewer than MIN_COLUMNS output columns (a router over 8 experts): the bits of the first columns
    of the weight zero-padded to MIN_COLUMNS (whose plan calls 4-row heights where the 8-column GEMM
    kept only its 128-row tile), so a row alone, in a decode step's 8 and in a prefill's 300 rows
    has one result."""
    from megatron_fp4.fp4.tiled import MIN_COLUMNS
    g = torch.Generator().manual_seed(7)
    for n in (1, 8, MIN_COLUMNS - 1):
        w, x = torch.randn(n, 96, generator=g), torch.randn(300, 96, generator=g)
        wide = torch.cat([w, w.new_zeros(MIN_COLUMNS - n, 96)])
        want = tiles(x, wide)[:, :n]
        for rows in (1, 3, 8, 300):
            got = tiled_linear(x[:rows], w)
            assert got.shape == (rows, n) and got.is_contiguous()
            assert torch.equal(bits(got), bits(want[:rows])), (n, rows)
        w.requires_grad_(True)  # under autograd: the same forward bits, the gradient of the narrow weight
        y = tiled_linear(x[:8], w)
        y.sum().backward()
        assert torch.equal(bits(y.detach()), bits(want[:8])) and torch.allclose(w.grad, x[:8].sum(0).expand(n, -1))


def test_a_dropped_weight_store_goes_without_the_cyclic_gc():
    """A pack kept in a `WeightStore` (an engine's or the plugin's rollout store) holds the store
    weakly: dropped without `clear()`, the store and its packs are freed at once (with the cyclic
    GC off), where a plain dict's callback keeps it in a reference cycle; a pack whose weight's
    memory is freed leaves either store."""
    import gc
    import weakref

    from megatron_fp4.fp4 import WeightStore, tiled

    w = torch.randn(16, 8)
    enabled = gc.isenabled()
    gc.disable()
    try:
        store = WeightStore()
        made = tiled._kept(w, store, "copy", lambda t: t.clone())
        assert tiled._kept(w, store, "copy", lambda t: None) is made and len(store) == 1
        gone, pack = weakref.ref(store), weakref.ref(made)
        del store, made
        assert gone() is None and pack() is None
        plain = {"marker": torch.zeros(1)}  # (a dict itself takes no weak reference: one of its values does)
        tiled._kept(w, plain, "copy", lambda t: t.clone())
        held = weakref.ref(plain["marker"])
        del plain
        assert held() is not None  # the cycle: only the cyclic GC frees it
        for store in (WeightStore(), {}):
            temp = torch.randn(4, 4)
            tiled._kept(temp, store, "copy", lambda t: t.clone())
            del temp
            assert len(store) == 0
    finally:
        if enabled:
            gc.enable()
        gc.collect()
