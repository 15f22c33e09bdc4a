"""The prefill path of the ``batch`` level's block attention (``tiled._tall_forward``): every head's
query tiles stacked into one product per key block, read in place, must give every output and
log-sum-exp bit of the per-tile path (the level's definition: one ROW_TILE-row tile per product,
its key block copied per tile), whatever the padding, window, sinks, grouping, value width and
product cap; positions that do not rise along the queries keep the per-tile path."""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.fp4 import tiled
from megatron_fp4.fp4.tiled import _block_forward, block_attention


def bits(t):
    return t.contiguous().view(torch.int32)


# B, H, KV, Tk, Tq, D, Dv, window, sinks, pads
CASES = {
    "gqa_left_padded": (3, 4, 2, 150, 150, 16, 16, 0, False, [0, 7, 60]),
    "mha_narrow_values": (2, 2, 2, 90, 90, 32, 8, 0, False, [3, 0]),
    "rep4_window_sinks": (2, 8, 2, 140, 140, 16, 16, 40, True, [0, 9]),
    "chunk_of_a_cache": (2, 4, 2, 130, 70, 16, 24, 0, False, [5, 0]),  # queries 60..129 of a longer cache
}


def _inputs(case):
    B, H, KV, Tk, Tq, D, Dv, window, sinks, pads = CASES[case]
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    q = torch.randn(B, H, Tq, D, generator=g)
    k, v = torch.randn(B, KV, Tk, D, generator=g), torch.randn(B, KV, Tk, Dv, generator=g)
    pad = torch.tensor(pads)
    positions = (torch.arange(Tk - Tq, Tk)[None, :] - pad[:, None]).clamp(min=0)
    s = torch.randn(H, generator=g) if sinks else None
    return q, k, v, positions, pad, window, s


def _both(monkeypatch, case, cap=None):
    """(tall output, lse), (per-tile output, lse) of one case; ``cap``: the tall products' row cap."""
    q, k, v, positions, pad, window, sinks = _inputs(case)
    tiled._plans = []
    if cap is not None:
        monkeypatch.setattr(tiled, "tall_rows", lambda *a: cap)
    with torch.no_grad():
        tall = _block_forward(q, k, v, positions, pad, None, window, sinks, with_lse=True)
        # the probed cap may be 0 on a machine whose products keep no stacked height (MKL_CBWR=AVX2 at
        # two threads): the plan then keeps the tiles, and the comparison below still holds
        if cap is not None or tiled.tall_rows(q.shape[-1], tiled.value_width(v.shape[-1]) + 1, q.dtype,
                                              q.device) >= tiled.ROW_TILE:
            assert tiled._plan(positions, pad, *_shape(q, k, v, window)).tall is not None
        monkeypatch.setattr(tiled._Tall, "of", classmethod(lambda cls, *a: None))
        tiled._plans = []
        tiles = _block_forward(q, k, v, positions, pad, None, window, sinks, with_lse=True)
    monkeypatch.undo()
    tiled._plans = []
    return tall, tiles


def _shape(q, k, v, window):
    B, H, Tq, D = q.shape
    KV, Tk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    return (B, KV, H // KV, Tq, Tk, Tk, Tk, D, Dv, q.dtype, v.dtype, window)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("cap", [None, 32, 16], ids=["probed_cap", "cap32", "cap16"])
def test_tall_products_give_the_tiles_bits(monkeypatch, threads, case, cap):
    (out, lse), (want, want_lse) = _both(monkeypatch, case, cap)
    assert torch.equal(bits(out), bits(want)) and torch.equal(bits(lse), bits(want_lse))


def test_positions_that_do_not_rise_keep_the_tiles():
    q, k, v, positions, pad, window, sinks = _inputs("gqa_left_padded")
    shuffled = positions.flip(1).contiguous()
    tiled._plans = []
    assert tiled._plan(shuffled, pad, *_shape(q, k, v, window)).tall is None
    with torch.no_grad():  # the per-tile path: each query still sees exactly its causal keys
        out = block_attention(q, k, v, shuffled, pad)
        ref = block_attention(q.flip(2), k, v, positions, pad).flip(2)
    assert torch.allclose(out, ref, atol=1e-5)
    tiled._plans = []


def test_other_devices_and_a_failed_probe_keep_the_tiles(monkeypatch):
    from megatron_fp4.fp4 import row_calls
    assert row_calls.tall_rows(16, 17, torch.float32, torch.device("meta")) == 0
    q, k, v, positions, pad, window, sinks = _inputs("gqa_left_padded")
    monkeypatch.setattr(tiled, "tall_rows", lambda *a: 0)
    tiled._plans = []
    assert tiled._plan(positions, pad, *_shape(q, k, v, window)).tall is None
    tiled._plans = []
