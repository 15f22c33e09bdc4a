"""The decode step of the ``batch`` level's block attention (`fp4/tiled.py`): its per-thread buffers
(`_DecodeBuffers`, reused by every layer and step of a shape) and block-major key gathers must give
every call the bits of the causal full forward (which allocates its own buffers), whatever ran
before in the thread (other shapes, more shapes than are kept, inference mode) or beside it in
another thread. Also the attention's shared RoPE tables (`model.layers.layer_rope_cos_sin`)."""
from __future__ import annotations

import threading

import torch

from megatron_fp4.fp4 import tiled
from megatron_fp4.fp4.tiled import KEY_BLOCK, block_attention
from megatron_fp4.model.layers import layer_rope_cos_sin, rope_cos_sin


def bits(t):
    return t.contiguous().view(torch.int32)


def _case(seed, B, KV, rep, D, Dv, T, pads):
    """A batch with leading padding `pads`, its full forward, and static cache buffers (capacity T + 8)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, KV * rep, T, D, generator=g)
    k, v = torch.randn(B, KV, T, D, generator=g), torch.randn(B, KV, T, Dv, generator=g)
    pad = torch.tensor(pads)
    positions = (torch.arange(T)[None, :] - pad[:, None]).clamp(min=0)
    full = block_attention(q, k, v, positions, pad)
    cache_k, cache_v = torch.zeros(B, KV, T + 8, D), torch.zeros(B, KV, T + 8, Dv)
    cache_k[:, :, :T], cache_v[:, :, :T] = k, v
    return q, cache_k, cache_v, positions, pad, full


def _step_matches(case, t) -> bool:
    q, cache_k, cache_v, positions, pad, full = case
    step = block_attention(q[:, :, t:t + 1], cache_k[:, :, :t + 1], cache_v[:, :, :t + 1], positions[:, t:t + 1], pad)
    real = pad <= t  # the rows whose slot t holds a real token (a padding query's output is never read)
    return bool(real.any()) and torch.equal(bits(step[real, :, 0]), bits(full[real, :, t]))


# (seed, B, KV, rep, D, Dv, T, pads): one key block; rows in one and in two key blocks (the second
# block read by some tiles only); narrow values (zero columns); three blocks; no GQA, one row
CASES = [(0, 3, 2, 2, 16, 16, 40, [0, 5, 20]), (1, 3, 2, 2, 32, 32, 90, [0, 7, 60]),
         (2, 2, 1, 4, 16, 4, 70, [3, 0]), (3, 2, 2, 1, 16, 24, 150, [0, 70]), (4, 1, 2, 2, 8, 8, 20, [0])]


def test_decode_steps_reusing_buffers_across_shapes_equal_the_full_forward():
    """Decode steps of five shapes interleaved (more than DECODE_SHAPES_KEPT: sets are dropped and
    made again), at steps that cross key blocks: every step == the full forward, bitwise."""
    cases = [_case(*c) for c in CASES]
    assert len(cases) > tiled.DECODE_SHAPES_KEPT
    with torch.no_grad():
        for t_from_end in (9, 8, 1, 0):
            for case, spec in zip(cases, CASES):
                t = spec[6] - 1 - t_from_end
                assert _step_matches(case, t), (spec, t)
        for case, spec in zip(cases, CASES):  # the last key block's first key (a new block for some rows)
            T, pads = spec[6], spec[7]
            for t in {KEY_BLOCK + p for p in pads if KEY_BLOCK + p < T}:
                assert _step_matches(case, t), (spec, t)


def test_decode_buffers_under_inference_mode_and_no_grad_alternately():
    """The same shape in inference mode and outside it (an inference tensor cannot be written
    outside inference mode: each mode keeps its own buffers): both == the full forward."""
    case = _case(*CASES[1])
    for mode in (True, False, True, False):
        with torch.inference_mode(mode), torch.no_grad():
            for t in (70, 89):
                assert _step_matches(case, t), (mode, t)


def test_decode_buffers_are_per_thread():
    """Two threads decoding the same shape at once (other values), each == its full forward."""
    cases = [_case(10 + i, *CASES[1][1:]) for i in range(2)]
    failures = []

    def run(case):
        try:
            with torch.no_grad():
                for _ in range(20):
                    for t in (60, 70, 89):
                        if not _step_matches(case, t):
                            failures.append(t)
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(e)

    workers = [threading.Thread(target=run, args=(c,)) for c in cases]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not failures, failures


def test_layer_rope_tables_follow_the_positions():
    """The tables kept for the next layer are the ones `rope_cos_sin` computes for the positions
    given now: after an in-place write, for an equal fresh tensor, another head dim or dtype."""
    positions = torch.arange(12).view(2, 6)
    first = layer_rope_cos_sin(positions, 16, 1e6, torch.float32)
    assert layer_rope_cos_sin(positions, 16, 1e6, torch.float32) is first  # the next layer's call
    for args in ((positions.clone(), 16, 1e6, torch.float32), (positions, 8, 1e6, torch.float32),
                 (positions, 16, 1e4, torch.float32), (positions, 16, 1e6, torch.bfloat16)):
        got, ref = layer_rope_cos_sin(*args), rope_cos_sin(*args)
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, ref)), args[1:]
    positions.add_(3)  # written in place: its version moves
    got, ref = layer_rope_cos_sin(positions, 16, 1e6, torch.float32), rope_cos_sin(positions, 16, 1e6, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    with torch.inference_mode():  # inference tensors have no version: compared by value
        p = torch.arange(6).view(1, 6)
        a = layer_rope_cos_sin(p, 16, 1e6, torch.float32)
        p.add_(1)
        assert all(torch.equal(x, y) for x, y in zip(layer_rope_cos_sin(p, 16, 1e6, torch.float32),
                                                      rope_cos_sin(p, 16, 1e6, torch.float32)))
        assert not torch.equal(a[0], rope_cos_sin(p, 16, 1e6, torch.float32)[0])


def test_decode_steps_over_the_buffer_bound_keep_nothing(monkeypatch):
    """A decode step whose buffers would exceed DECODE_BUFFER_ELEMENTS allocates per call (as a
    prefill does) and keeps no set in the thread: a long generation's growing steps do not pile up
    memory. Its bits are the full forward's all the same."""
    case = _case(*CASES[1])
    monkeypatch.setattr(tiled._workspace, "kept", {}, raising=False)  # this thread's sets: none yet
    monkeypatch.setattr(tiled, "DECODE_BUFFER_ELEMENTS", 0)
    with torch.no_grad():
        for t in (70, 89):
            assert _step_matches(case, t), t
    assert tiled._workspace.kept == {}
    monkeypatch.setattr(tiled, "DECODE_BUFFER_ELEMENTS", 1 << 22)  # under the bound: one set kept
    with torch.no_grad():
        assert _step_matches(case, 89)
    assert len(tiled._workspace.kept) == 1


def test_decode_query_tiles_of_every_height_keep_the_full_forwards_bits(threads):
    """A decode step's query tile takes the probed height for its rep rows (`row_calls.query_tile`:
    4, 8 or 12 rows instead of 16 where this machine's bmm gives those rows the 16-row bits): rep
    1..12 query heads per kv head, steps in the first and the second key block, == the full forward."""
    from megatron_fp4.fp4.row_calls import query_tile
    with torch.no_grad():
        for rep in (1, 3, 4, 5, 8, 12):
            spec = (10 + rep, 2, 2, rep, 32, 32, 80, [0, 9])
            case = _case(*spec)
            assert query_tile(rep, 32, 33, torch.float32, torch.device("cpu")) >= rep
            for t in (30, 70, 79):
                assert _step_matches(case, t), (spec, t)


def test_query_tile_keeps_only_heights_whose_products_match(monkeypatch):
    """With a bmm whose rows are each computed alone (the same bits at every height, whatever this
    machine's kernels do) that rounds otherwise below 8 rows, at every height but 16, or at 8: the
    query tile is the smallest height from the live rows up that matched; on another device it is 16
    without a probe."""
    from megatron_fp4.fp4 import row_calls
    real_bmm = torch.bmm

    def make(bad):
        def bmm(a, b, out=None):
            r = torch.cat([real_bmm(a[:, i:i + 1].contiguous(), b) for i in range(a.shape[1])], 1)
            r = r.mul_(1 + 2 ** -20) if bad(a.shape[1]) else r
            return r if out is None else out.copy_(r)
        return bmm

    cpu = torch.device("cpu")
    for bad, want in ((lambda h: h < 8, [8, 8, 8, 12, 16]), (lambda h: h != 16, [16] * 5),
                      (lambda h: h == 8, [4, 4, 12, 12, 16]), (lambda h: False, [4, 4, 8, 12, 16])):
        row_calls._query_heights.cache_clear()
        monkeypatch.setattr(row_calls.torch, "bmm", make(bad))
        assert [row_calls.query_tile(r, 24, 25, torch.float32, cpu) for r in (1, 4, 5, 9, 13)] == want
    row_calls._query_heights.cache_clear()
    assert row_calls.query_tile(2, 24, 25, torch.float32, torch.device("meta")) == 16


def test_decode_steps_read_the_caches_key_blocks_in_place_with_the_gathers_bits(threads):
    """A static cache at the batch level keeps its keys and values by key index (`tiled.BlockedKV`,
    `tiled.cache_blocks`): a prefill of left-padded rows then decode steps across a key block, each
    step read in place == the same step gathered from the cache == the full forward, bitwise; a
    cache appended from another start, or with other padding, is rebuilt from its filled prefix."""
    from megatron_fp4.model.layers import LayerCache
    B, KV, rep, D, Dv, T, P = 3, 2, 2, 16, 16, 90, 50
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, KV * rep, T, D, generator=g)
    k, v = torch.randn(B, KV, T, D, generator=g), torch.randn(B, KV, T, Dv, generator=g)
    pad = torch.tensor([0, 7, 33])
    positions = (torch.arange(T)[None, :] - pad[:, None]).clamp(min=0)
    with torch.no_grad():
        full = block_attention(q, k, v, positions, pad)
        cache = LayerCache(capacity=T)
        ck, cv = cache.append(k[:, :, :P], v[:, :, :P])
        blocks = tiled.cache_blocks(cache, k[:, :, :P], v[:, :, :P], pad, 0)
        read = []
        for t in range(P, T):
            ck, cv = cache.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
            blocks = tiled.cache_blocks(cache, k[:, :, t:t + 1], v[:, :, t:t + 1], pad, t)
            args = (q[:, :, t:t + 1], ck, cv, positions[:, t:t + 1], pad)
            read.append(blocks.serves(ck, cv, pad, -(-(t + 1) // KEY_BLOCK), max(Dv, tiled.MIN_VALUE_COLUMNS - 1)))
            step = block_attention(*args, kv_blocks=blocks)
            assert torch.equal(bits(step), bits(block_attention(*args))), t
            assert torch.equal(bits(step[:, :, 0]), bits(full[:, :, t])), t
        assert all(read)
        assert not blocks.serves(ck, cv, pad + 1, 2, 15)  # other padding: not these blocks
        again = tiled.cache_blocks(cache, k[:, :, T - 1:], v[:, :, T - 1:], pad, T - 1)  # appended out of order
        assert again is not blocks and again.filled == T and torch.equal(again.keys, blocks.keys) \
            and torch.equal(again.values, blocks.values)
        # a step read in place makes no gather buffers in the thread's workspace; a gathering one does
        tiled._workspace.kept = {}
        args = (q[:, :, T - 1:], ck, cv, positions[:, T - 1:], pad)
        in_place = block_attention(*args, kv_blocks=again)
        assert [ws._gathered for ws in tiled._workspace.kept.values()] == [None]
        assert torch.equal(bits(block_attention(*args)), bits(in_place))
        assert all(ws._gathered is not None for ws in tiled._workspace.kept.values())


def test_decode_steps_over_many_key_blocks_with_window_and_sinks_equal_the_full_forward(threads):
    """A decode step computes every key block of every head in one pair of products and combines
    them after (`tiled._decode_forward`), a block wholly in a shorter row's future included as exact
    identities: at every step of a 300-token generation (five key blocks; rows 0, 45 and 130 slots
    shorter, so they reach their blocks at different steps), plain, with a sliding window shorter
    than a block and with per-head sinks, read from the cache's blocks in place and gathered ==
    the full forward, bitwise. The log-sum-exp of a one-query call (`_block_forward(with_lse=True)`,
    a one-token step under autograd) == the full forward's at that position."""
    from megatron_fp4.model.layers import LayerCache
    B, KV, rep, D, Dv, T, P = 3, 2, 3, 16, 24, 300, 20
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, KV * rep, T, D, generator=g)
    k, v = torch.randn(B, KV, T, D, generator=g), torch.randn(B, KV, T, Dv, generator=g)
    sinks = torch.randn(KV * rep, generator=g)
    pad = torch.tensor([0, 45, 130])
    positions = (torch.arange(T)[None, :] - pad[:, None]).clamp(min=0)
    real = lambda t: pad <= t  # noqa: E731 (rows whose slot t holds a token)
    with torch.no_grad():
        for window, sk in ((0, None), (37, None), (0, sinks), (70, sinks)):
            full, lse = tiled._block_forward(q, k, v, positions, pad, None, window, sk, with_lse=True)
            cache = LayerCache(capacity=T)
            ck, cv = cache.append(k[:, :, :P], v[:, :, :P])
            blocks = tiled.cache_blocks(cache, k[:, :, :P], v[:, :, :P], pad, 0)
            for t in range(P, T):
                ck, cv = cache.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
                blocks = tiled.cache_blocks(cache, k[:, :, t:t + 1], v[:, :, t:t + 1], pad, t)
                args = (q[:, :, t:t + 1], ck, cv, positions[:, t:t + 1], pad)
                step = block_attention(*args, window=window, sinks=sk, kv_blocks=blocks)
                r = real(t)
                assert torch.equal(bits(step[r, :, 0]), bits(full[r, :, t])), (window, t)
                if t % 37 == 0 or t == T - 1:
                    gathered = block_attention(*args, window=window, sinks=sk)
                    assert torch.equal(bits(gathered[r]), bits(step[r])), (window, t)
                    one, one_lse = tiled._block_forward(*args, None, window, sk, with_lse=True)
                    assert torch.equal(bits(one[r]), bits(step[r]))
                    # lse [B, KV, rep·Tq] query-head-major: the full forward's row g·T + t
                    want = lse.view(B, KV, rep, T)[:, :, :, t]
                    assert torch.equal(bits(one_lse.view(B, KV, rep)[r]), bits(want[r])), (window, t)
