"""The ``batch`` level's kernels (``fp4/tiled.py``): a row's bits do not depend on its batch.

Bitwise claims hold by construction (every kernel call has one shape whatever the row count, see the
module doc), so they are asserted exactly, with one and two intra-op threads; run them under
``ATEN_CPU_CAPABILITY=default|avx2`` and ``MKL_CBWR`` variations too (``tools/check_portability.sh``).
Accuracy is checked against float64 references within bounds derived from the fp32 rounding unit.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_fp4.fp4 import Numerics, invariant
from megatron_fp4.fp4.exact_gemm import exact_linear
from megatron_fp4.fp4.row_calls import MIN_COLUMN_BLOCK
from megatron_fp4.fp4.tiled import (KEY_BLOCK, MAX_ROW_TILE, ROW_TILE, block_attention,
                                    column_blocks, row_sum, row_tile, tiled_grouped_linear, tiled_grouped_mlp,
                                    tiled_linear, tiled_mm)

U = 2.0 ** -24  # fp32 unit roundoff


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def bits(t):
    return t.contiguous().view(torch.int32)


# tiles of 16 (wide), 32, 64 and 128 rows (narrow: row_tile grows the tile of a small K·N); column
# blocks (column_blocks): (2048, 256) one block, N smaller than a block; (1024, 2600) blocks of 512,
# the last of 5 widened by the remainder of 40 (a tail block of its own: the grouped test's (1024, 2900))
@pytest.mark.parametrize("k,n", [(64, 96), (1000, 77), (2048, 256), (64, 64), (16, 48), (1024, 2600)])
def test_tiled_linear_row_bits_do_not_depend_on_the_batch(threads, k, n):
    g = torch.Generator().manual_seed(k + n)
    x, w = torch.randn(300, k, generator=g), torch.randn(n, k, generator=g) / math.sqrt(k)
    full = tiled_linear(x, w)
    perm = torch.randperm(300, generator=g)
    shuffled = tiled_linear(x[perm], w)
    tile = row_tile(k, n)
    for i in (0, 1, tile - 1, tile, 101, 299):
        assert torch.equal(bits(tiled_linear(x[i:i + 1], w)[0]), bits(full[i]))  # alone
        assert torch.equal(bits(tiled_linear(x[max(0, i - 5):i + 1], w)[-1]), bits(full[i]))  # other tile slot
        assert torch.equal(bits(tiled_linear(x[i:i + tile + 3], w)[0]), bits(full[i]))  # first of two tiles
    assert torch.equal(bits(shuffled), bits(full[perm]))  # other tiles, other neighbours
    # one fp32 dot product of k terms per element: |err| <= gamma_k * sum |x||w|
    ref = x.double() @ w.double().t()
    assert ((full.double() - ref).abs() <= gamma(k) * (x.double().abs() @ w.double().abs().t()) + 1e-30).all()


def test_row_tile_depends_on_the_weight_shape_alone():
    """Wide layers keep the 16-row tile; narrow ones grow it (fewer calls) up to MAX_ROW_TILE."""
    assert row_tile(1024, 1024) == row_tile(2048, 256) == ROW_TILE == 16
    assert (row_tile(64, 128), row_tile(64, 64), row_tile(16, 48)) == (32, 64, MAX_ROW_TILE)
    assert all(row_tile(k, n) in (16, 32, 64, 128) for k in (1, 7, 64, 1000) for n in (1, 77, 4096))


def test_column_blocks_depend_on_the_weight_shape_alone():
    """A weight of at most 2^21 elements is one block; a larger one L2-sized blocks of a multiple of
    64 columns (at least MIN_COLUMN_BLOCK), covering the weight once, in order, no block narrower
    than half a block (a remainder under that widens the last)."""
    assert column_blocks(1024, 8192) == tuple((j, 512) for j in range(0, 8192, 512))  # the LM head
    assert column_blocks(1024, 768) == ((0, 768),) and column_blocks(1024, 2048) == ((0, 2048),)  # in cache
    assert column_blocks(1024, 2900) == ((0, 512), (512, 512), (1024, 512), (1536, 512), (2048, 512), (2560, 340))
    assert column_blocks(1024, 2600)[-1] == (2048, 552) and column_blocks(2048, 1380)[-1] == (1024, 356)
    assert column_blocks(1 << 16, 1000)[0] == (0, MIN_COLUMN_BLOCK)
    for k in (1, 64, 384, 1000, 1024, 4096):
        for n in (1, 77, 600, 1300, 8192, 40000):
            blocks = column_blocks(k, n)
            assert [j for j, _ in blocks] == [sum(w for _, w in blocks[:i]) for i in range(len(blocks))]
            assert sum(w for _, w in blocks) == n
            assert len(blocks) == 1 or min(w for _, w in blocks) >= blocks[0][1] // 2
            assert (len(blocks) > 1) == (k * n > 1 << 21 and n >= 1.5 * blocks[0][1])


def test_tiled_mm_of_a_transposed_view_and_the_dense_weight_gradient_layout():
    """``tiled_mm`` of any layout of the same matrix gives the same bits (operands made canonical);
    with autograd the weight gradient comes in the weight's own layout (contiguous [N, K], not the
    transpose of a [K, N] product), equal to float64 within fp32 rounding (M = 37 terms)."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(37, 1024, generator=g), torch.randn(2900, 1024, generator=g)  # column blocks
    y = tiled_mm(x, w.t())
    assert torch.equal(bits(y), bits(tiled_mm(x, w.t().contiguous())))
    assert torch.equal(bits(y), bits(tiled_linear(x, w)))
    wp = w.clone().requires_grad_()
    dy = torch.randn(37, 2900, generator=g)
    (dw,) = torch.autograd.grad((tiled_linear(x, wp) * dy).sum(), [wp])
    assert dw.is_contiguous() and dw.shape == w.shape
    ref = dy.double().t() @ x.double()
    assert ((dw.double() - ref).abs() <= gamma(37) * (dy.double().abs().t() @ x.double().abs())).all()


def test_tiled_linear_bias_leading_dims_and_grad():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 21, 32, generator=g, requires_grad=True)
    w = torch.randn(8, 32, generator=g, requires_grad=True)
    b = torch.randn(8, generator=g, requires_grad=True)
    y = tiled_linear(x, w, b)
    assert y.shape == (2, 21, 8)
    with torch.no_grad():  # the autograd Function's forward is the tiles' (same bits)
        assert torch.equal(bits(y.detach()), bits(tiled_linear(x, w, b)))
    assert torch.equal(bits(y), bits(tiled_linear(x.reshape(42, 32), w, b).reshape(2, 21, 8)))
    y.square().sum().backward()
    x2, w2, b2 = (t.detach().clone().double().requires_grad_() for t in (x, w, b))
    F.linear(x2, w2, b2).square().sum().backward()
    for got, ref in ((x.grad, x2.grad), (w.grad, w2.grad), (b.grad, b2.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)  # fp32 chain vs fp64, O(K u) relative


@pytest.mark.parametrize("n", [7, 300, 40000])
def test_row_sum_row_bits_do_not_depend_on_the_batch(threads, n):
    """A row summed alone (a lone row: ATen would split it across threads; 40000 > its grain) or
    among others, shuffled, non-contiguous: the same bits; within gamma_n of the float64 sum."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=g)
    full = row_sum(x)
    perm = torch.randperm(9, generator=g)
    assert torch.equal(bits(row_sum(x[perm])), bits(full[perm]))
    assert torch.equal(bits(row_sum(x.t().contiguous().t())), bits(full))  # a column-major copy
    for i in (1, 4, 8):
        assert torch.equal(bits(row_sum(x[i], keepdim=True)), bits(full[i:i + 1]))  # alone
        assert torch.equal(bits(row_sum(x[i - 1:i + 1].reshape(2, 1, n))[-1, 0]), bits(full[i]))  # with another
    ref = x.double().sum(-1)
    assert ((full.double() - ref).abs() <= gamma(n) * x.double().abs().sum(-1)).all()


@pytest.mark.parametrize("n", [7, 2048, 40000])
def test_batch_level_softmax_row_bits_do_not_depend_on_the_batch(threads, n):
    """The batch level's softmax / log-softmax (ATen's row-local kernels): a row alone, among others,
    at another position in a longer batch: the same bits; within a few ulp of float64."""
    nx = Numerics(invariance="batch")
    g = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=g) * 5
    for f, ref_f in ((invariant.softmax, torch.softmax), (invariant.log_softmax, torch.log_softmax)):
        full = f(x, nx)
        perm = torch.randperm(9, generator=g)
        assert torch.equal(bits(f(x[perm], nx)), bits(full[perm]))
        assert torch.equal(bits(f(torch.cat([x[:4], x]), nx)[4:]), bits(full))
        for i in (0, 5, 8):
            assert torch.equal(bits(f(x[i:i + 1], nx)[0]), bits(full[i]))
        ref = ref_f(x.double(), -1)
        # x − max rounds by u·|x − max| (≤ u·S, S the row's largest shift), which exp turns into a
        # relative error, plus a few ulp of exp itself; the sum adds gamma_n: each probability is
        # within 2·(S + 8)·u + gamma_n relative, a log-probability within that (absolute) + 2u·|log p|
        shift = (x - x.amax(-1, keepdim=True)).abs().amax(-1, keepdim=True).double()
        rel = 2 * (shift + 8) * U + gamma(n)
        bound = rel * ref.abs() if f is invariant.softmax else rel + 2 * U * ref.abs()
        assert ((full.double() - ref).abs() <= bound).all()


def test_tiled_grouped_linear_is_each_run_alone():
    g = torch.Generator().manual_seed(1)
    counts = [5, 0, 19, 1]
    weights = [torch.randn(12, 40, generator=g) for _ in counts]
    x = torch.randn(sum(counts), 40, generator=g)
    got = tiled_grouped_linear(x, weights, counts)
    runs = [tiled_linear(r, w) for r, w, n in zip(x.split(counts), weights, counts) if n]
    assert torch.equal(bits(got), bits(torch.cat(runs)))


# tiles of 32, 16, 16 and 16 rows; (1024, 2900): column blocks of 512 and a tail block of 340
@pytest.mark.parametrize("k,n", [(64, 128), (1000, 77), (1024, 768), (1024, 2900)])
def test_tiled_grouped_linear_rows_are_their_run_alone_whatever_the_batch(threads, k, n):
    """Runs of several tiles, empty runs, one row: each row of the grouped call (one tile-aligned
    buffer, one output) has the bits of its run alone, of the row alone and of the runs shuffled."""
    g = torch.Generator().manual_seed(k + n)
    tile = row_tile(k, n)
    counts = [2 * tile + 3, 0, 1, tile, 5]
    weights = torch.randn(len(counts), n, k, generator=g) / math.sqrt(k)
    x = torch.randn(sum(counts), k, generator=g)
    got = tiled_grouped_linear(x, weights.unbind(0), counts)
    runs = x.split(counts)
    for e, (r, w) in enumerate(zip(runs, weights)):
        if not counts[e]:
            continue
        own = got[sum(counts[:e]):sum(counts[:e + 1])]
        assert torch.equal(bits(own), bits(tiled_linear(r, w)))
        assert torch.equal(bits(own[-1]), bits(tiled_linear(r[-1:], w)[0]))  # the run's last row alone
    order = [4, 3, 2, 1, 0]
    shuffled = tiled_grouped_linear(torch.cat([runs[e] for e in order]), [weights[e] for e in order],
                                    [counts[e] for e in order])
    assert torch.equal(bits(shuffled), bits(torch.cat([got.split(counts)[e] for e in order])))
    assert tiled_grouped_linear(x[:0], weights.unbind(0), [0] * len(counts)).shape == (0, n)


@pytest.mark.parametrize("h,f", [(64, 64), (128, 64), (512, 512)])  # w13 tiles of 32 and 16 rows, w2 of 64 and 32;
def test_tiled_grouped_mlp_is_its_two_grouped_linears(threads, h, f):  # (512, 512): oneDNN's, many rows
    """The no-grad expert MLP in one padded row layout (runs aligned to the larger tile, the SwiGLU
    run on the padding rows too) or, on oneDNN plans with many rows, each GEMM's calls reading the
    rows in place (`_onednn_runs`), gives every row the bits of the two grouped GEMMs with the SwiGLU
    between them, so those of each run alone; an empty batch is [0, h]; autograd is refused."""
    g = torch.Generator().manual_seed(h + f)
    t13, t2 = row_tile(h, 2 * f), row_tile(f, h)
    counts = [max(t13, t2) + 3, 0, 1, min(t13, t2), 2 * min(t13, t2) + 1]
    if h * f < 1 << 17:
        assert t13 != t2
    else:  # past LAYOUT_LIST_ROWS, the last run's last call past the last row
        counts += [130, 3, 257, 61]
    w13 = torch.randn(len(counts), 2 * f, h, generator=g) / math.sqrt(h)
    w2 = torch.randn(len(counts), h, f, generator=g) / math.sqrt(f)
    x = torch.randn(sum(counts), h, generator=g)
    nx = Numerics(invariance="batch")

    def act(t):
        gate, up = t.split(f, dim=-1)
        return invariant.silu(gate, nx) * up

    got = tiled_grouped_mlp(x, w13, w2, counts, act)
    want = tiled_grouped_linear(act(tiled_grouped_linear(x, w13.unbind(0), counts)), w2.unbind(0), counts)
    assert torch.equal(bits(got), bits(want))
    assert tiled_grouped_mlp(x[:0], w13, w2, [0] * len(counts), act).shape == (0, h)
    with pytest.raises(ValueError, match="without autograd"):
        tiled_grouped_mlp(x.requires_grad_(), w13, w2, counts, act)


def test_tiled_grouped_linear_autograd_forward_bits_and_gradients():
    """Stacked weights with autograd: the forward is the no-grad tiles' bits, the gradients those of
    the per-run ``F.linear`` in float64 within fp32 rounding (dx sums 12 products, dw up to 19)."""
    g = torch.Generator().manual_seed(4)
    counts = [5, 0, 19, 1]
    w = torch.randn(4, 12, 40, generator=g, requires_grad=True)
    x = torch.randn(sum(counts), 40, generator=g, requires_grad=True)
    y = tiled_grouped_linear(x, w, counts)
    with torch.no_grad():
        assert torch.equal(bits(y), bits(tiled_grouped_linear(x, list(w.unbind(0)), counts)))
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    x2, w2 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    torch.cat([F.linear(r, we) for r, we in zip(x2.split(counts), w2.unbind(0))]).backward(dy.double())
    # one fp32 dot product per element: |err| <= gamma_n · Σ|a||b| (n = 12 for dx, an expert's rows for dw)
    ad, ax, aw = dy.double().abs(), x.detach().double().abs(), w.detach().double().abs()
    dx_bound = torch.cat([a @ we for a, we in zip(ad.split(counts), aw.unbind(0))]) * gamma(12)
    dw_bound = torch.stack([a.t() @ b * gamma(max(n, 1))
                            for a, b, n in zip(ad.split(counts), ax.split(counts), counts)])
    assert ((x.grad.double() - x2.grad).abs() <= dx_bound).all()
    assert ((w.grad.double() - w2.grad).abs() <= dw_bound).all()
    assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1]))  # an expert without rows


def test_invariant_linear_dispatches_by_level():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 32, generator=g), torch.randn(8, 32, generator=g)
    assert torch.equal(invariant.linear(x, w, None, Numerics(invariance="batch")), tiled_linear(x, w))
    assert torch.equal(invariant.linear(x, w, None, Numerics(invariance="standard")), F.linear(x, w))
    assert torch.equal(invariant.linear(x, w, None, Numerics(invariance="exact")), exact_linear(x, w))
    with pytest.raises(ValueError, match="invariance='fast'"):
        Numerics(invariance="fast")


def _reference_attention(q, k, v, positions, pad):
    """float64 causal attention by position (keys shifted past the padding), GQA by repetition."""
    B, H, Tq, D = q.shape
    rep = H // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    out = torch.zeros(B, H, Tq, D, dtype=torch.float64)
    for b in range(B):
        kb, vb = k[b, :, pad[b]:], v[b, :, pad[b]:]
        for t in range(Tq):
            p = int(positions[b, t])
            s = (q[b, :, t].double()[:, None, :] * kb[:, :p + 1]).sum(-1) / math.sqrt(D)
            out[b, :, t] = (torch.softmax(s, -1)[..., None] * vb[:, :p + 1]).sum(1)
    return out


def _case(seed, B=3, H=4, KV=2, T=150, D=32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, KV, T, D, generator=g), torch.randn(B, KV, T, D, generator=g)
    pad = torch.tensor([0, 7, 70])[:B]
    positions = (torch.arange(T)[None, :] - pad[:, None]).clamp(min=0)
    return q, k, v, positions, pad


def test_block_attention_matches_float64_within_bound():
    q, k, v, positions, pad = _case(0)
    got = block_attention(q, k, v, positions, pad)
    ref = _reference_attention(q, k, v, positions, pad)
    D, T = q.shape[-1], k.shape[2]
    # scores: |err| <= gamma_D·Σ|q||k|/sqrt(D) (+ exp's few ulp); a convex combination of values with
    # weights of relative error ≲ 2·(score err) + gamma_{T+D+4}, blocks rescaled ≤ T/KEY_BLOCK times
    s_abs = (q.abs().double() @ k.abs().double().repeat_interleave(2, 1).transpose(-1, -2)).amax() / math.sqrt(D)
    rel = 2 * (gamma(D) * float(s_abs) + 4 * U) + gamma(T + D + 4 + 2 * math.ceil(T / KEY_BLOCK))
    bound = 2 * rel * float(v.abs().amax())
    real = positions >= 0
    err = (got.double() - ref).abs().amax(-1).amax(1)[real]
    assert float(err.max()) <= bound, (float(err.max()), bound)


def test_block_attention_decode_equals_full_forward_bitwise(threads):
    """Each query alone over its cache prefix (a decode step), and in other batches, == the causal
    full forward of the batch, bitwise, whatever the padding."""
    q, k, v, positions, pad = _case(1)
    full = block_attention(q, k, v, positions, pad)
    for b in range(q.shape[0]):
        for t in (int(pad[b]), int(pad[b]) + 1, 63 + int(pad[b]), 64 + int(pad[b]), q.shape[2] - 1):
            if t >= q.shape[2]:
                continue
            step = block_attention(q[b:b + 1, :, t:t + 1], k[b:b + 1, :, :t + 1], v[b:b + 1, :, :t + 1],
                                   positions[b:b + 1, t:t + 1], pad[b:b + 1])
            assert torch.equal(bits(step[0, :, 0]), bits(full[b, :, t])), (b, t)
    alone = block_attention(q[1:2], k[1:2], v[1:2], positions[1:2], pad[1:2])
    assert torch.equal(bits(alone[0]), bits(full[1]))


@pytest.mark.parametrize("dv", [4, 15, 40])  # values narrower than MIN_VALUE_COLUMNS (zero columns), as wide, wider
def test_block_attention_value_widths_decode_equals_full_and_float64(threads, dv):
    """Values of another width than the keys (DeepSeek-V3's MLA): a decode step over a KV cache's
    filled prefix (a view of a larger buffer) == the full forward, bitwise; within the bound of
    `test_block_attention_matches_float64_within_bound` of float64."""
    q, k, _, positions, pad = _case(2, T=80)
    v = torch.randn(*k.shape[:3], dv, generator=torch.Generator().manual_seed(dv))
    full = block_attention(q, k, v, positions, pad)
    assert full.shape == (*q.shape[:3], dv)
    cache_k, cache_v = torch.zeros(3, 2, 96, 32), torch.zeros(3, 2, 96, dv)  # static cache buffers
    cache_k[:, :, :80], cache_v[:, :, :80] = k, v
    for t in (70, 71, 79):
        step = block_attention(q[:, :, t:t + 1], cache_k[:, :, :t + 1], cache_v[:, :, :t + 1],
                               positions[:, t:t + 1], pad)
        assert torch.equal(bits(step[:, :, 0]), bits(full[:, :, t])), t
    rep = q.shape[1] // k.shape[1]
    ref = torch.zeros(*q.shape[:3], dv, dtype=torch.float64)
    for b in range(3):
        kb = k[b, :, pad[b]:].double().repeat_interleave(rep, 0)
        vb = v[b, :, pad[b]:].double().repeat_interleave(rep, 0)
        for t in range(q.shape[2]):
            p = int(positions[b, t])
            s = (q[b, :, t].double()[:, None, :] * kb[:, :p + 1]).sum(-1) / math.sqrt(q.shape[-1])
            ref[b, :, t] = (torch.softmax(s, -1)[..., None] * vb[:, :p + 1]).sum(1)
    D, T = q.shape[-1], k.shape[2]
    s_abs = (q.abs().double() @ k.abs().double().repeat_interleave(rep, 1).transpose(-1, -2)).amax() / math.sqrt(D)
    rel = 2 * (gamma(D) * float(s_abs) + 4 * U) + gamma(T + D + 4 + 2 * math.ceil(T / KEY_BLOCK))
    assert float((full.double() - ref).abs().max()) <= 2 * rel * float(v.abs().amax())


def test_block_attention_window_past_whole_blocks_is_finite_decodes_and_matches_float64(threads):
    """A sliding window shorter than a query's distance to the end of key block 0 (its first blocks
    wholly before the window: no key seen yet) gives finite outputs within the float64 bound (it
    gave NaN), with and without autograd, and a decode step over a static cache equals the full
    forward bitwise."""
    q, k, v, positions, pad = _case(3, B=2, T=150, D=16)
    pad, positions = pad[:2], positions[:2]
    window = 20
    full = block_attention(q, k, v, positions, pad, window=window)
    qg = q.clone().requires_grad_(True)
    graded = block_attention(qg, k, v, positions, pad, window=window)
    graded.square().sum().backward()
    assert torch.isfinite(qg.grad).all() and torch.equal(bits(graded.detach()), bits(full))
    rep = q.shape[1] // k.shape[1]
    ref = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(2):
        kb = k[b, :, pad[b]:].double().repeat_interleave(rep, 0)
        vb = v[b, :, pad[b]:].double().repeat_interleave(rep, 0)
        for t in range(q.shape[2]):
            p = int(positions[b, t])
            lo = max(0, p - window + 1)
            s = (q[b, :, t].double()[:, None, :] * kb[:, lo:p + 1]).sum(-1) / math.sqrt(q.shape[-1])
            ref[b, :, t] = (torch.softmax(s, -1)[..., None] * vb[:, lo:p + 1]).sum(1)
    D = q.shape[-1]
    s_abs = (q.abs().double() @ k.abs().double().repeat_interleave(rep, 1).transpose(-1, -2)).amax() / math.sqrt(D)
    rel = 2 * (gamma(D) * float(s_abs) + 4 * U) + gamma(window + D + 4 + 2 * math.ceil(150 / KEY_BLOCK))
    assert torch.isfinite(full).all()
    assert float((full.double() - ref).abs().max()) <= 2 * rel * float(v.abs().amax())
    cache_k, cache_v = torch.zeros(2, 2, 160, 16), torch.zeros(2, 2, 160, 16)
    cache_k[:, :, :150], cache_v[:, :, :150] = k, v
    for t in (100, 149):
        step = block_attention(q[:, :, t:t + 1], cache_k[:, :, :t + 1], cache_v[:, :, :t + 1], positions[:, t:t + 1],
                               pad, window=window)
        assert torch.equal(bits(step[:, :, 0]), bits(full[:, :, t])), t


@pytest.mark.parametrize("inference", [False, True], ids=["no_grad", "inference_mode"])
def test_block_attention_plan_is_not_reused_for_other_padding_or_changed_positions(inference):
    """The per-forward plan (`tiled._plan`, kept for the next layer's call with the same positions
    tensor) is rebuilt when the padding or the shapes differ, or the positions were changed in
    place: every call equals a call with fresh tensors (inference tensors, as vLLM passes them,
    have no version counter: compared by value)."""
    with torch.inference_mode(inference), torch.no_grad():
        _plan_cases(*_case(4, T=70, D=16))


def _plan_cases(q, k, v, positions, pad):
    def fresh(q, k, v, positions, pad):
        return block_attention(q, k, v, positions.clone(), pad.clone())

    first = block_attention(q, k, v, positions, pad)
    assert torch.equal(bits(first), bits(fresh(q, k, v, positions, pad)))
    other_pad = torch.tensor([1, 0, 3])
    got = block_attention(q, k, v, positions, other_pad)  # the same positions object, other padding
    assert torch.equal(bits(got), bits(fresh(q, k, v, positions, other_pad)))
    assert not torch.equal(bits(got), bits(first))
    got = block_attention(q[:, :, :40], k[:, :, :40], v[:, :, :40], positions[:, :40], pad)  # another shape
    assert torch.equal(bits(got), bits(fresh(q[:, :, :40], k[:, :, :40], v[:, :, :40], positions[:, :40], pad)))
    positions[0] = torch.arange(70).flip(0)  # changed in place (its version moves)
    got = block_attention(q, k, v, positions, pad)
    assert torch.equal(bits(got), bits(fresh(q, k, v, positions, pad)))


@pytest.mark.parametrize("inference", [False, True], ids=["no_grad", "inference_mode"])
def test_leading_pad_follows_writes_into_the_mask_and_its_base(inference):
    """`invariant.leading_pad` keeps its last answer for the next layer's call with the same mask;
    a write into the mask's base buffer (the engine's per-step mask is a view of one) or another
    mask, batch or a None mask gives the new count."""
    with torch.inference_mode(inference):
        _leading_pad_cases(torch.ones(3, 8, dtype=torch.long))


def _leading_pad_cases(base):
    base[1, :2] = 0
    view = base[:, :6]
    first = invariant.leading_pad(view, 3, "cpu")
    assert first.tolist() == [0, 2, 0] and invariant.leading_pad(view, 3, "cpu") is first
    base[2, :3] = 0
    assert invariant.leading_pad(view, 3, "cpu").tolist() == [0, 2, 3]
    assert invariant.leading_pad(base[:2], 2, "cpu").tolist() == [0, 2]
    assert invariant.leading_pad(None, 2, "cpu").tolist() == [0, 0]
    assert invariant.leading_pad(None, 3, "cpu").tolist() == [0, 0, 0]


@pytest.mark.parametrize("mode,scope", [("bf16", "experts"), ("fp4_resq", "experts+attention"), ("fp4", "experts")])
def test_batch_level_training_forward_equals_no_grad_scoring_bitwise(mode, scope):
    """The training forward (autograd: experts one by one, MoEResQ's autograd Functions) gives the
    no-grad scoring forward's bits (grouped experts) at the batch level, in another batch too."""
    from megatron_fp4.config import Config
    from megatron_fp4.fp4 import apply_numerics
    from megatron_fp4.model import build_model
    from megatron_fp4.model.specs import numerics_from_config

    cfg = Config()
    cfg.model.num_layers, cfg.fp4.scope = 2, scope
    cfg.numerics.invariance = "batch"
    model = build_model(cfg, seed=7)
    apply_numerics(model, numerics_from_config(cfg, "train"))  # as the Trainer builds its model
    model.set_fp4_mode(mode)
    tokens = torch.randint(1, cfg.model.vocab_size, (5, 19), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        scored = model(tokens).logits
        alone = model(tokens[2:3]).logits
    trained = model(tokens).logits
    trained.float().square().mean().backward()  # a real training forward: the graph is used
    assert torch.equal(bits(trained.detach()), bits(scored))
    assert torch.equal(bits(alone[0]), bits(scored[2]))


def test_invariant_silu_gradient_is_finite_and_silus():
    """The row-invariant SiLU's gradient is SiLU's derivative, finite where exp(−x) overflows
    (autograd through x / (1 + exp(−x)) gave NaN for x < −88)."""
    x = torch.tensor([-200.0, -90.0, -20.0, -1.0, 0.0, 0.5, 3.0, 100.0], requires_grad=True)
    invariant.silu(x, Numerics(invariance="batch")).sum().backward()
    ref = x.detach().double().requires_grad_()
    F.silu(ref).sum().backward()
    assert torch.isfinite(x.grad).all()
    # a few fp32 operations on the derivative's O(1) terms: within 8 ulp of 1 + |x|·u·8
    assert ((x.grad.double() - ref.grad).abs() <= 8 * U * (1 + x.detach().double().abs())).all()


@pytest.mark.parametrize("mode", ["bf16", "fp4_resq"])
def test_batch_level_rollout_equals_scoring_bitwise_with_a_column_blocked_lm_head(mode):
    """A vocabulary wide enough for the LM head to run in column blocks (hidden 64: 4 blocks of
    8192, then a tail of 7232): the rollout engine's decode == scoring in other batches, 0 bits, 0 routes."""
    from megatron_fp4.config import Config
    from megatron_fp4.model import build_model
    from tests.numerics import single_thread
    from tests.unit.test_batch_invariant import check_rollout_equals_scoring

    cfg = Config()
    cfg.model.vocab_size, cfg.model.num_layers = 40000, 2
    assert column_blocks(cfg.model.hidden_size, cfg.model.vocab_size)[-2:] == ((24576, 8192), (32768, 7232))
    with single_thread():
        check_rollout_equals_scoring(mode, "experts", "nvfp4", 7, "batch", model=build_model(cfg, seed=7))
