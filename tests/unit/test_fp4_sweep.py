"""The eager sweeps (``formats.Sweep``: fake quantization and ResQ one cache-sized range of rows at a
time, block scales rounded by ``nvfp4.e4m3_rne_``) give the bits of the reference path they
replaced: ``nvfp4_core`` / ``mxfp4_core`` (fp8-cast scales, one call over the whole tensor) followed
by the dequantizing multiplies, and for ResQ two such fake quantizations, a subtraction and an
addition. Checked bit for bit (fp32 and bf16/fp16 input and output, strided input, ranges forced
small so a tensor spans many) on E2M1 ties, −0.0, zero blocks and rows (amax 0), subnormal inputs
and block scales, values at FLT_MAX; non-finite input must raise the same error and, with deferred
checks, record the same flags and write the same bits."""
from __future__ import annotations

import threading

import pytest
import torch

from megatron_fp4.fp4 import NonFiniteFlags, NonFiniteInputError, formats
from megatron_fp4.fp4.formats import pow2_fp32
from megatron_fp4.fp4.mxfp4 import fake_quantize_mxfp4, mxfp4_core
from megatron_fp4.fp4.nvfp4 import E4M3_MAX, e4m3_rne_, fake_quantize_nvfp4, nvfp4_core
from megatron_fp4.fp4.recipe import OperandFormat
from megatron_fp4.fp4.resq import portable_resq_quantize


def ref_nvfp4(x, scale="row", block="1d", dtype=None, nonfinite=None, name="x"):
    q, _, s_blk32, s_dec = nvfp4_core(x, scale, block, "nearest", None, name, nonfinite)
    return q.mul_(s_blk32).mul_(s_dec).reshape(x.shape).to(dtype or x.dtype)


def ref_mxfp4(x, scale_mode="floor", dtype=None, nonfinite=None, name="x"):
    q, e = mxfp4_core(x, scale_mode, "nearest", None, name, nonfinite)
    return q.mul_(pow2_fp32(e)).reshape(x.shape).to(dtype or x.dtype)


def ref_fq(x, fmt, nonfinite=None, name="x"):
    if fmt.format == "nvfp4":
        return ref_nvfp4(x, fmt.scale, fmt.block, torch.float32, nonfinite, name)
    return ref_mxfp4(x, fmt.mx_scale_mode, torch.float32, nonfinite, name)


def ref_resq(x, fmt, nonfinite=None, name="x"):
    xf = x.to(torch.float32)
    q = ref_fq(xf, fmt, nonfinite, name)
    return q + ref_fq(xf - q, fmt, nonfinite, name + " residual")


def bits(t):
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.dtype.itemsize])


def hard(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 2.0 ** torch.randint(-24, 24, (rows, 1), generator=g)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[0] = ties.repeat(k // 8)[:k] * torch.where(torch.rand(k, generator=g) < 0.5, -1.0, 1.0)
    x[1, :32] = 0.0  # zero blocks
    x[1, 32:48] = -0.0
    x[2] = 0.0  # a zero row: amax 0
    x[3] *= 1e-38  # subnormal inputs (subnormal S_dec, zero / subnormal E4M3 block scales)
    x[4] = (torch.rand(k, generator=g) * 2 - 1) * 3e38  # S_enc tiny, block scales at the E4M3 max
    x[5, ::16] = 6.0 * 2.0 ** torch.randint(-8, 8, (k // 16,), generator=g).float()
    x[6] = torch.where(torch.rand(k, generator=g) < 0.5, -0.0, 0.0)  # only signed zeros
    x[7, :64] *= 2.0 ** -100  # blocks far below the row's amax: E4M3 scale 0 or subnormal
    return x


@pytest.fixture
def small_ranges(monkeypatch):
    """Ranges of a few rows (a 2d tile's 16 at least), so every test tensor spans several, the last short."""
    monkeypatch.setattr(formats, "SWEEP_ELEMENTS", 700)


def test_e4m3_rne_equals_the_fp8_cast():
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0) & (grid <= E4M3_MAX)].unique()
    mids = (grid[:-1] + grid[1:]) / 2  # exact in fp32: the ties
    near = torch.cat([grid, mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9))])
    g = torch.Generator().manual_seed(0)
    patterns = torch.randint(0, 0x43E00001, (1 << 20,), generator=g, dtype=torch.int32).view(torch.float32)
    tiny = torch.arange(0, 1 << 16, dtype=torch.int32).view(torch.float32)  # fp32 subnormals
    v = torch.cat([near, patterns, tiny, torch.tensor([0.0, E4M3_MAX, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11])])
    want = v.to(torch.float8_e4m3fn).float()
    assert torch.equal(bits(e4m3_rne_(v.clone())), bits(want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale,block", [("row", "1d"), ("tensor", "1d"), ("tensor", "2d")])
def test_nvfp4_sweep_bits_equal_reference(small_ranges, dtype, scale, block):
    x = hard(48, 96, 1)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    x = x.to(dtype)
    for out in (None, torch.float32, torch.bfloat16):
        got = fake_quantize_nvfp4(x, scale=scale, block=block, compile="off", dtype=out)
        want = ref_nvfp4(x, scale, block, out)
        assert got.dtype == want.dtype and got.shape == x.shape
        assert torch.equal(bits(got), bits(want))
    t = x.t()  # strided: ranges read from a transposed view
    assert torch.equal(bits(fake_quantize_nvfp4(t, scale=scale, block=block, compile="off")),
                       bits(ref_nvfp4(t, scale, block)))
    b = x.view(3, 16, 96)  # leading dims (2d: tiles never straddle two matrices)
    assert torch.equal(bits(fake_quantize_nvfp4(b, scale=scale, block=block, compile="off")),
                       bits(ref_nvfp4(b, scale, block)))


def test_nvfp4_sweep_many_blocks_uses_emulated_scales(monkeypatch):
    """Past ``_cast_scales``' threshold (8192 blocks) the E4M3 scales are rounded by ``e4m3_rne_``
    (ranges of 2^14 elements: the per-tensor scales sweep too, from 4 ranges up)."""
    monkeypatch.setattr(formats, "SWEEP_ELEMENTS", 1 << 14)
    x = torch.cat([hard(64, 2048, 2), torch.randn(64, 2048) * 1e-30])
    for scale in ("row", "tensor"):
        assert torch.equal(bits(fake_quantize_nvfp4(x, scale=scale, compile="off")), bits(ref_nvfp4(x, scale)))
    assert torch.equal(bits(fake_quantize_nvfp4(x, scale="tensor", block="2d", compile="off")),
                       bits(ref_nvfp4(x, "tensor", "2d")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_mxfp4_sweep_bits_equal_reference(small_ranges, dtype, mode):
    x = hard(64, 128, 3).to(dtype)
    for out in (None, torch.float32):
        assert torch.equal(bits(fake_quantize_mxfp4(x, scale_mode=mode, compile="off", dtype=out)),
                           bits(ref_mxfp4(x, mode, out)))
    t = x.t()
    assert torch.equal(bits(fake_quantize_mxfp4(t, scale_mode=mode, compile="off")), bits(ref_mxfp4(t, mode)))


FORMATS = [OperandFormat(), OperandFormat(format="mxfp4", scale="tensor"),
           OperandFormat(format="mxfp4", scale="tensor", mx_scale_mode="rceil")]


@pytest.mark.parametrize("fmt", FORMATS, ids=["nvfp4", "mxfp4", "mxfp4-rceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resq_sweep_bits_equal_two_call_reference(small_ranges, fmt, dtype):
    x = hard(40, 128, 4).to(dtype)
    want = ref_resq(x, fmt)
    assert torch.equal(bits(portable_resq_quantize(x, fmt, compile="off")), bits(want))
    scratch = x.clone()  # handed over: the sweep never writes the caller's tensor
    assert torch.equal(bits(portable_resq_quantize(scratch, fmt, compile="off", scratch=True)), bits(want))
    assert torch.equal(bits(scratch), bits(x))
    t = x.t().contiguous().t()  # strided rows
    assert torch.equal(bits(portable_resq_quantize(t, fmt, compile="off")), bits(ref_resq(t, fmt)))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("fmt", FORMATS[:2], ids=["nvfp4", "mxfp4"])
def test_sweeps_non_finite_raise_record_and_write_as_the_reference(small_ranges, fmt, bad):
    x = hard(40, 128, 5)
    x[33, 7] = bad  # in a later range
    fq = (lambda t, **k: fake_quantize_nvfp4(t, compile="off", **k)) if fmt.format == "nvfp4" else \
        (lambda t, **k: fake_quantize_mxfp4(t, compile="off", **k))
    with pytest.raises(NonFiniteInputError, match="'x' has 1 non-finite"):
        fq(x)
    with pytest.raises(NonFiniteInputError, match="'x' has 1 non-finite"):
        portable_resq_quantize(x, fmt, compile="off")
    got_flags, want_flags = NonFiniteFlags(), NonFiniteFlags()
    got = fq(x, nonfinite=got_flags)
    want = ref_fq(x, fmt, want_flags)
    assert torch.equal(bits(got), bits(want))
    got = portable_resq_quantize(x, fmt, compile="off", nonfinite=got_flags, name="y")
    want = ref_resq(x, fmt, want_flags, name="y")
    assert torch.equal(bits(got), bits(want))
    assert {k: bool(v) for k, v in got_flags._flags.items()} == {k: bool(v) for k, v in want_flags._flags.items()}
    assert len(got_flags) == 3 and got_flags.any_flag().item() == 1.0


def test_sweeps_finite_flags_recorded_under_the_reference_names():
    x = hard(32, 64, 6)
    got, want = NonFiniteFlags(), NonFiniteFlags()
    portable_resq_quantize(x, OperandFormat(), compile="off", nonfinite=got, name="act")
    ref_resq(x, OperandFormat(), want, name="act")
    fake_quantize_nvfp4(x, scale="tensor", block="2d", compile="off", nonfinite=got, name="w")
    ref_nvfp4(x, "tensor", "2d", nonfinite=want, name="w")
    assert sorted(got._flags) == sorted(want._flags)
    assert got.any_flag().item() == 0.0


def test_sweeps_in_threads_share_no_scratch(small_ranges):
    """Each thread borrows its own scratch (``formats._Pool`` is thread-local)."""
    xs = [hard(48, 96, 10 + i) for i in range(4)]
    want = [ref_resq(x, OperandFormat()) for x in xs]
    got = [None] * 4

    def run(i):
        for _ in range(5):
            got[i] = portable_resq_quantize(xs[i], OperandFormat(), compile="off")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want))


def test_sweep_scratch_serves_inference_mode_and_autograd_off_alike():
    """vLLM runs its forward under inference mode, the trainer's scoring beside it in the same process
    does not: scratch pooled by one must serve the other (an inference tensor refuses in-place writes
    outside inference mode), with the same bits either way."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    formats._POOL.idle.clear()
    with torch.inference_mode():
        first = fake_quantize_nvfp4(x)
    with torch.no_grad():
        second = fake_quantize_nvfp4(x)
    with torch.inference_mode():
        third = fake_quantize_nvfp4(x)
    assert torch.equal(first, second) and torch.equal(second, third)
