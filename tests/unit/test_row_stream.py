"""The row-streaming GEMM (`fp4/row_stream.py`) against an independent reference — each output
element one fused multiply-add per k in order from +0, emulated in float64 (the product of two
fp32 numbers is exact there) — and its place in the `batch` level: the probe keeps it only where it
gives the oneDNN plan's tile bits, and nothing breaks where it is not built."""
import functools

import pytest
import torch

from megatron_fp4.fp4 import row_calls, row_stream

needs_kernel = pytest.mark.skipif(not row_stream.available(), reason="no C compiler or no AVX2/FMA here")


def sequential_fma(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out[m, n] = fma(x[m, K-1], w[n, K-1], ... fma(x[m, 0], w[n, 0], +0)): each step's exact
    product plus the fp32 accumulator, rounded to fp32 (via float64: exact product, one rounding of
    the sum there and one to fp32; a double rounding can differ from one fma only on an exact fp32
    halfway point after the first rounding, which these few thousand random steps do not hit)."""
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    xd, wd = x.double(), w.double()
    for k in range(x.shape[1]):
        acc = (acc.double() + xd[:, k:k + 1] * wd[:, k][None]).float()
    return acc


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@needs_kernel
@pytest.mark.parametrize("k,n", [(64, 40), (37, 16), (48, 5), (96, 33)])
def test_stream_linear_is_a_sequential_fma_per_element(k, n):
    """Every row count 1-9 (a 4-row group and its tails), N not a multiple of the 16-column block,
    odd K, rows misaligned by one element, an output of a wider row stride: every element's bits are
    the sequential fma's, so a row's do not depend on the other rows of the call."""
    g = torch.Generator().manual_seed(k * 1000 + n)
    w = torch.randn(n, k, generator=g)
    packed = row_stream.stream_pack(w)
    assert packed.shape == (-(-n // 16), k, 16)
    x = torch.randn(9, k, generator=g)
    ref = sequential_fma(x, w)
    for m in range(1, 10):
        rows = x[:m]
        shifted = torch.empty(m * k + 1)[1:].view(m, k).copy_(rows)
        wide = torch.full((m, n + 7), float("nan"))[:, 3:n + 3]
        for got in (row_stream.stream_linear(rows, packed, n), row_stream.stream_linear(shifted, packed, n),
                    row_stream.stream_linear(rows, packed, n, out=wide)):
            assert torch.equal(bits(got), bits(ref[:m])), (m, (got != ref[:m]).sum())
    full = torch.full((2, n + 7), float("nan"))
    row_stream.stream_linear(x[:2], packed, n, out=full[:, 3:n + 3])
    assert full[:, :3].isnan().all() and full[:, n + 3:].isnan().all()  # nothing written outside its columns


@needs_kernel
def test_stream_linear_refuses_operands_it_cannot_read():
    w = torch.randn(32, 16)
    packed = row_stream.stream_pack(w)
    with pytest.raises(ValueError, match="stream_pack"):
        row_stream.stream_linear(torch.randn(16, 3).t(), packed, 32)  # rows without unit stride
    with pytest.raises(ValueError, match="stream_pack"):
        row_stream.stream_linear(torch.randn(3, 16).double(), packed, 32)
    with pytest.raises(ValueError, match="stream_pack"):
        row_stream.stream_linear(torch.randn(3, 16), packed, 40)  # not the weight it packs
    with pytest.raises(ValueError, match="out"):
        row_stream.stream_linear(torch.randn(3, 16), packed, 32, out=torch.empty(32, 3).t())
    with pytest.raises(ValueError, match="out"):
        row_stream.stream_linear(torch.randn(3, 16), packed, 32, out=torch.empty(3, 32, device="meta"))
    with pytest.raises(ValueError, match="stream_pack"):
        row_stream.stream_linear(torch.randn(3, 16), packed.to("meta"), 32)


@needs_kernel
def test_where_onednn_serves_the_probe_keeps_the_kernel_only_if_it_gives_the_tiles_bits(monkeypatch):
    """A oneDNN plan at one thread gets ``stream`` exactly where the kernel matches oneDNN's tiles
    here; a kernel that rounds otherwise (its output nudged by one ulp) is refused, so the bits of
    the `batch` level never depend on it."""
    if not row_calls._onednn_usable():
        pytest.skip("oneDNN does not serve here")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        k, n = 512, 768
        gen = torch.Generator().manual_seed(3)
        w = torch.randn(n, k, generator=gen)
        x = torch.randn(row_calls.STREAM_MAX_ROWS, k, generator=gen)
        tile = row_calls.row_tile(k, n)
        padded = torch.cat([x, x.new_zeros(-x.shape[0] % tile, k)])  # whole tiles, as the probe's reference
        ref = torch.cat([row_calls.onednn_linear(t, w) for t in padded.split(tile)])[:x.shape[0]]
        shifted = row_calls._misaligned(x)
        agrees = row_calls._stream_agrees(w, x, shifted, ref)
        assert agrees == torch.equal(row_stream.stream_linear(x, row_stream.stream_pack(w), n), ref)
        real = row_stream.stream_linear

        def nudged(*a, **kw):
            out = real(*a, **kw)
            out[0, 0] = torch.nextafter(out[0, 0], torch.tensor(float("inf")))
            return out
        monkeypatch.setattr(row_stream, "stream_linear", nudged)
        assert not row_calls._stream_agrees(w, x, shifted, ref)
        torch.set_num_threads(2)  # the kernel runs on one thread: not probed at two
        monkeypatch.setattr(row_stream, "stream_linear", real)
        assert not row_calls._stream_agrees(w, x, shifted, ref)
    finally:
        torch.set_num_threads(before)


def test_without_the_kernel_plans_keep_onednn_for_every_call(monkeypatch):
    """No compiler (or no AVX2): `available()` is False, the probe keeps no ``stream`` height, and a
    rollout-store call of a few rows runs oneDNN as before (same bits as the dense form)."""
    monkeypatch.setattr(row_stream, "_function", functools.lru_cache(maxsize=None)(lambda: None))
    assert not row_stream.available()
    with pytest.raises(RuntimeError, match="not available"):
        row_stream.stream_linear(torch.randn(2, 16), torch.zeros(1, 16, 16), 16)
    x = torch.randn(4, 64)
    w = torch.randn(32, 64)
    assert not row_calls._stream_agrees(w, x, x, x @ w.t())


def test_the_library_is_built_into_the_cache_directory_once(monkeypatch, tmp_path):
    """Compiled from the module's own source into ``$XDG_CACHE_HOME/megatron_fp4`` (named by the
    source's and flags' hash), loaded from there afterwards without compiling again."""
    if not row_stream.available():
        pytest.skip("no C compiler or no AVX2/FMA here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    real = row_stream._compile
    monkeypatch.setattr(row_stream, "_compile", lambda *a: (calls.append(a), real(*a))[1])
    fresh = functools.lru_cache(maxsize=None)(row_stream._function.__wrapped__)
    monkeypatch.setattr(row_stream, "_function", fresh)
    assert row_stream.available()
    built = list((tmp_path / "megatron_fp4").glob("row_stream-*.so"))
    assert len(built) == 1 and len(calls) == 1
    assert not list((tmp_path / "megatron_fp4").glob(".row_stream-*"))  # no temporary left behind
    fresh.cache_clear()
    assert row_stream.available() and len(calls) == 1  # the built library, loaded again
    w, x = torch.randn(20, 24), torch.randn(3, 24)
    assert torch.equal(bits(row_stream.stream_linear(x, row_stream.stream_pack(w), 20)), bits(sequential_fma(x, w)))
