"""The one-call compiled ResQ (`fp4/fused_resq.py`) gives the eager `portable_resq_quantize` bits.

The oracle is the eager path itself (``compile="off"``: two reference fake quantizations, a
subtraction, an addition). Every comparison is bitwise and also asserts the compiled call served
(a silent eager fallback would make the comparison vacuous).
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch

from megatron_fp4.fp4 import OperandFormat, fused, fused_resq
from megatron_fp4.fp4.formats import NonFiniteInputError
from megatron_fp4.fp4.nonfinite import NonFiniteFlags
from megatron_fp4.fp4.resq import portable_resq_quantize
from tests.unit.test_fp4_fused import _bits, _inputs, _non_finite_inputs, compiled, needs_inductor  # noqa: F401  (fixture)


def _fmt(scale: str) -> OperandFormat:
    return OperandFormat(format="nvfp4", scale=scale, block="1d", rounding="nearest")


@pytest.fixture
def served(monkeypatch):
    """Counts the calls the compiled ResQ body served (not the reference runs of its self-check)."""
    calls = []
    run = fused_resq.ResqVariant.run

    def counting(self, fns, xb):
        if fns is self.fns:
            calls.append(tuple(xb.shape))
        return run(self, fns, xb)
    monkeypatch.setattr(fused_resq.ResqVariant, "run", counting)
    return calls


def _adversarial(dtype):
    yield from _inputs(dtype)  # ties, saturation, subnormal / zero scales, outliers, non-contiguous, one token
    g = torch.Generator().manual_seed(1)
    yield torch.zeros(4, 32, dtype=dtype)  # all-zero: zero scales, zero residual
    yield (torch.randn(3, 5, 48, generator=g) * 1e3).to(dtype)  # 3-D (leading dims flattened)
    yield torch.full((2, 32), 6.0 * 2.0 ** -140).to(dtype)  # subnormal fp32 values
    yield torch.randn(2, 16, generator=g).to(dtype)  # one block a row: eager


@needs_inductor
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", ["row", "tensor"])
def test_compiled_resq_gives_the_eager_bits(compiled, served, dtype, scale):
    assert fused_resq.prepare(scale, dtype)
    for x in _adversarial(dtype):
        want = portable_resq_quantize(x, _fmt(scale), True, compile="off")
        before = len(served)
        got = portable_resq_quantize(x, _fmt(scale), True, compile="auto")  # a prepared variant serves in auto
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(_bits(got), _bits(want)), (x.shape, dtype, scale)
        serves = min(x.numel() // x.shape[-1], x.shape[-1] // 16) >= 2  # a size-1 dim would recompile: eager
        assert len(served) == before + serves, "the compiled ResQ did not serve (or served a size-1 layout)"


@needs_inductor
def test_compiled_resq_serves_inference_mode_when_prepared_for_it(compiled, served):
    assert fused_resq.prepare("row", torch.float32, inference=True)
    with torch.inference_mode():
        x = torch.randn(16, 128) * torch.logspace(-8, 8, 128)
        got = portable_resq_quantize(x, _fmt("row"), True, compile="auto")
        want = portable_resq_quantize(x, _fmt("row"), True, compile="off")
    assert served and torch.equal(_bits(got), _bits(want))


@needs_inductor
def test_non_finite_input_reports_like_the_eager_path(compiled, served):
    assert fused_resq.prepare("row", torch.float32)
    x = torch.randn(8, 64)
    x[3, 7] = float("nan")
    with pytest.raises(NonFiniteInputError) as eager:
        portable_resq_quantize(x, _fmt("row"), True, name="layers.0.x", compile="off")
    with pytest.raises(NonFiniteInputError) as got:
        portable_resq_quantize(x, _fmt("row"), True, name="layers.0.x", compile="auto")
    assert str(got.value) == str(eager.value) and served  # the compiled call ran, then the eager one reported
    # deferred checks: the same flags under the same names as the eager path records
    for bad in (float("nan"), float("inf"), None):
        y = torch.randn(8, 64)
        if bad is not None:
            y[0, 0] = bad
        flags = {}
        for mode in ("off", "auto"):
            f = NonFiniteFlags()
            out = portable_resq_quantize(y, _fmt("row"), True, name="h", nonfinite=f, compile=mode)
            flags[mode] = ({k: bool(v) for k, v in f._flags.items()}, out)
        assert flags["auto"][0] == flags["off"][0] and len(flags["off"][0]) == 2
        assert torch.equal(_bits(flags["auto"][1]), _bits(flags["off"][1]))


@needs_inductor
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", ["row", "tensor"])
def test_non_finite_input_gives_the_eager_bits_in_any_order(compiled, served, dtype, scale):
    """With every compiled kernel in use (``on``: the one-call ResQ and, under its eager fallback,
    the fake-quant kernels), a NaN/Inf input gives the eager path's bits, NaNs included, and its
    flags: whatever an earlier caller compiled (the order-dependent failure of issue 38)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (a refusal's warning, checked below)
        portable_resq_quantize(torch.randn(8, 64).to(dtype), _fmt(scale), True, compile="on")
    if not served:  # refused: not bit-exact on a kernel set forced below the machine's own (the bits still must match)
        assert os.environ.get("ATEN_CPU_CAPABILITY") and fused_resq.variant_of(fused_resq.key_of(scale, dtype)).state == "refused"
    for x in _non_finite_inputs(dtype):
        outs, records = [], []
        for mode in ("off", "on"):
            f = NonFiniteFlags()
            outs.append(portable_resq_quantize(x, _fmt(scale), True, name="h", nonfinite=f, compile=mode))
            records.append({k: bool(v) for k, v in f._flags.items()})
        assert records[0] == records[1] and len(records[0]) == 2
        assert outs[0].isnan().any() and torch.equal(_bits(outs[1]), _bits(outs[0])), (dtype, scale)


def test_off_and_invalid_inputs_stay_eager(served):
    x = torch.randn(4, 40)  # not a multiple of 16: the eager path raises its own error
    with pytest.raises(ValueError, match="16"):
        portable_resq_quantize(x, _fmt("row"), True, compile="auto")
    portable_resq_quantize(torch.randn(4, 64), _fmt("row"), True, compile="off")
    assert not served
    key = fused_resq.key_of("row", torch.float32)
    assert fused_resq.variant_of(key) is fused_resq.variant_of(key) and isinstance(fused_resq.variant_of(key), fused_resq.ResqVariant)


@needs_inductor
def test_the_auto_warm_up_worker_builds_a_resq_variant():
    """``auto``'s child process (compile_worker.py) finds the ResQ kind and checks it bit-exact (exit 0)."""
    import json
    import os
    import subprocess

    spec = json.dumps({"key": ["resq_nvfp4", "row", "1d", "float32", "float32"], "blocks": [4, 4, 16],
                       "parent": os.getpid()})
    proc = subprocess.run(fused._worker_command(spec), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
