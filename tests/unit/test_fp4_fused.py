"""The compiled fake-quant path (``fp4/fused.py``) gives the eager path's bits, tolerance 0.

The eager path is itself bit-exact against the spec reference (``test_fp4_formats.py``), so equality
here carries that over; one test also compares the compiled kernels with that reference directly.
Compiles are few and small (a few variants, seconds each; inductor's on-disk cache makes reruns
faster): tests ask for them with ``compile="on"`` per call, nothing process-wide is switched.
"""
from __future__ import annotations

import math
import os
import shutil
import sys
import warnings

import pytest
import torch

from megatron_fp4.fp4 import Recipe, fused
from megatron_fp4.fp4 import mxfp4, nvfp4
from megatron_fp4.fp4.e2m1 import E2M1_VALUES, round_e2m1, round_e2m1_select

from tests.unit.test_fp4_formats import f32, ref_mxfp4, ref_nvfp4, tricky_rows, E2M1


# The quantizers take their compiled backend as an argument (None: the eager reference alone); these
# tests hand them the process's store (tests/conftest.py makes it fresh for every test) unless they name one.
def fake_quantize_nvfp4(x, **kw):
    return nvfp4.fake_quantize_nvfp4(x, **{"kernels": fused.PROCESS, **kw})


def fake_quantize_mxfp4(x, **kw):
    return mxfp4.fake_quantize_mxfp4(x, **{"kernels": fused.PROCESS, **kw})


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _inductor_problem() -> str | None:
    """Why inductor cannot compile the fake-quant kernels here (None when it can). Besides a missing
    compiler: with ATen's vector unit forced off (``ATEN_CPU_CAPABILITY=default``) torch 2.13's
    inductor still emits ``at::vec`` code, which does not compile (seen on this project's CI class of
    machine); the product then falls back to the eager path with a warning, which these tests would
    count as a failure."""
    try:
        import torch._inductor  # noqa: F401
    except Exception as err:  # pragma: no cover - torch without inductor
        return f"torch._inductor does not import: {err}"
    if shutil.which("g++") is None and shutil.which("c++") is None:
        return "no C++ compiler for inductor"
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        return "inductor's C++ codegen does not compile with ATEN_CPU_CAPABILITY=default (torch 2.13)"
    return None


_PROBLEM = _inductor_problem()
needs_inductor = pytest.mark.skipif(_PROBLEM is not None, reason=str(_PROBLEM))


@pytest.fixture
def compiled():
    """The test's compiled kernels (``fused.PROCESS``: a fresh store for every test, tests/conftest.py)."""
    assert not fused.PROCESS.variants and fused.PROCESS.broken is None
    yield fused.PROCESS


def _same_both_ways(fn, x, **kw):
    ref = fn(x, compile="off", **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        out = fn(x, compile="on", **kw)
    fallbacks = [str(w.message) for w in caught if "compiled FP4 fake-quant disabled" in str(w.message)]
    if fallbacks:
        # The self-check refused a kernel that is not bit-exact: acceptable only on a kernel set
        # forced below the machine's own (inductor's codegen for it, not ours, is what differs).
        assert os.environ.get("ATEN_CPU_CAPABILITY") and "not bit-exact" in fallbacks[0], fallbacks
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.equal(_bits(out), _bits(ref)), (x.shape, x.dtype, kw)


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    tricky = tricky_rows(dtype)
    yield tricky  # ties, saturation, subnormal / zero E4M3 scales, zero blocks, a huge outlier
    yield torch.cat([tricky, tricky.flip(0) * 3]).reshape(16, 64)
    yield -tricky  # signs, −0 after rounding
    yield torch.randn(48, 128, generator=g).to(dtype)
    yield torch.randn(128, 32, generator=g).to(dtype).t()  # non-contiguous (32, 128)
    yield (torch.randn(16, 96, generator=g) * torch.logspace(-40, 38, 96)).to(dtype)
    yield torch.randn(1, 64, generator=g).to(dtype)  # one token


@needs_inductor
def test_nvfp4_row_1d_fp32_matches_eager(compiled):
    for x in _inputs(torch.float32):
        _same_both_ways(fake_quantize_nvfp4, x)


@needs_inductor
def test_nvfp4_tensor_2d_bf16_matches_eager(compiled):
    for x in _inputs(torch.bfloat16):
        if x.shape[-2] % 16 == 0:
            _same_both_ways(fake_quantize_nvfp4, x, scale="tensor", block="2d", dtype=torch.float32)


@needs_inductor
def test_mxfp4_rceil_matches_eager_and_raises_on_non_finite(compiled):
    for x in _inputs(torch.float32):
        if x.shape[-1] % 32 == 0:
            _same_both_ways(fake_quantize_mxfp4, x, scale_mode="rceil")
    x = torch.randn(4, 64)
    x[1, 3], x[2, 40] = float("nan"), float("inf")
    with pytest.raises(ValueError, match=r"'act' has 2 non-finite element"):
        fake_quantize_mxfp4(x, scale_mode="rceil", name="act", compile="on")


@needs_inductor
def test_compiled_kernels_match_the_definition_reference(compiled):
    """Against the pure-Python reference written from the definitions (test_fp4_formats.py), not only
    against the eager path: both kernels of each format, on the rows that cover the definition."""
    x = tricky_rows()
    for scale in ("row", "tensor"):
        assert fake_quantize_nvfp4(x, scale=scale, compile="on").tolist() == ref_nvfp4(x, scale, "1d")[3]
    x2 = torch.cat([tricky_rows(), tricky_rows().flip(0) * 3]).reshape(32, 32)
    out = fake_quantize_nvfp4(x2, scale="tensor", block="2d", compile="on")
    assert out.tolist() == ref_nvfp4(x2, "tensor", "2d")[3]
    for mode in ("floor", "rceil"):
        codes, exps = ref_mxfp4(x, mode)
        want = [[f32(math.copysign(E2M1[c & 7], -1.0 if c & 8 else 1.0) * 2.0 ** erow[i // 32])
                 for i, c in enumerate(crow)] for crow, erow in zip(codes, exps)]
        assert fake_quantize_mxfp4(x, scale_mode=mode, compile="on").tolist() == want


def _non_finite_inputs(dtype):
    """NaN, +Inf and −Inf each alone, all three in one tensor (other blocks finite), and all NaN."""
    g = torch.Generator().manual_seed(2)
    for bad in ([float("nan")], [float("inf")], [float("-inf")], [float("nan"), float("inf"), float("-inf")]):
        x = torch.randn(32, 64, generator=g)
        for i, v in enumerate(bad):
            x[5 * i + 1, 17 * i + 3] = v
        yield x.to(dtype)
    yield torch.full((32, 64), float("nan")).to(dtype)


# (function, options): every kernel the compiled fake-quant path serves (both formats, scale kinds,
# block layouts, input and output dtypes).
FAKE_QUANT_KERNELS = [
    (fake_quantize_nvfp4, dict(scale="row")),
    (fake_quantize_nvfp4, dict(scale="tensor")),
    (fake_quantize_nvfp4, dict(scale="tensor", block="2d")),
    (fake_quantize_nvfp4, dict(scale="row", dtype=torch.float32)),
    (fake_quantize_mxfp4, dict(scale_mode="floor")),
    (fake_quantize_mxfp4, dict(scale_mode="rceil", dtype=torch.float32)),
]


@needs_inductor
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", range(len(FAKE_QUANT_KERNELS)))
def test_non_finite_input_gives_the_eager_bits_and_report(compiled, monkeypatch, dtype, kernel):
    """A NaN/Inf input: the compiled path's output has the eager path's bits (its NaNs included),
    records the same deferred flags and raises the same error. The compiled kernels run on each
    input (counted), so a path that never compiled cannot pass vacuously."""
    from megatron_fp4.fp4.formats import NonFiniteInputError
    from megatron_fp4.fp4.nonfinite import NonFiniteFlags

    fn, kw = FAKE_QUANT_KERNELS[kernel]
    ran = []
    run = fused._Variant.run
    monkeypatch.setattr(fused._Variant, "run",
                        lambda self, fns, xb: (ran.append(fns is self.fns), run(self, fns, xb))[1])
    _same_both_ways(fn, torch.randn(32, 64).to(dtype), **kw)  # compiles (and checks) the variant
    if not any(ran):  # refused: not bit-exact on a kernel set forced below the machine's own
        assert os.environ.get("ATEN_CPU_CAPABILITY")
        return
    for x in _non_finite_inputs(dtype):
        records, outs = [], []
        for mode in ("off", "on"):
            flags = NonFiniteFlags()
            del ran[:]
            outs.append(fn(x, compile=mode, nonfinite=flags, **kw))
            records.append({k: bool(v) for k, v in flags._flags.items()})
            with pytest.raises(NonFiniteInputError) as err:
                fn(x, compile=mode, name="act", **kw)
            records.append(str(err.value))
        assert any(ran), "the compiled kernels did not run"
        assert records[0] == records[2] and records[1] == records[3]
        assert list(records[0].values()) == [True]  # flagged non-finite
        assert torch.equal(_bits(outs[1]), _bits(outs[0])), (x.dtype, kw)


@needs_inductor
def test_a_non_finite_first_input_does_not_refuse_the_kernel(compiled, monkeypatch):
    """``on`` checks a new variant on the caller's first input too; a NaN there (whose bits the
    kernel need not match: such inputs run eager) must not refuse a good kernel for the process."""
    from megatron_fp4.fp4.nonfinite import NonFiniteFlags

    x = torch.randn(32, 64)
    x[3, 5] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fake_quantize_nvfp4(x, compile="on", nonfinite=NonFiniteFlags())
    (variant,) = fused.PROCESS.variants.values()
    assert variant.state == "ready" or os.environ.get("ATEN_CPU_CAPABILITY")


def test_errors_and_fallbacks_do_not_compile(compiled):
    """Bad input fails before compiling; stochastic rounding, grad-recording inputs and ``off`` stay eager."""
    with pytest.raises(ValueError, match="not a multiple of 16"):
        fake_quantize_nvfp4(torch.randn(2, 40), compile="on")
    with pytest.raises(ValueError, match="not one of"):
        fake_quantize_mxfp4(torch.randn(2, 64), scale_mode="up", compile="on")
    with pytest.raises(ValueError, match="compile='yes' is not one of"):
        fake_quantize_nvfp4(torch.randn(2, 64), compile="yes")
    x = torch.randn(4, 64, requires_grad=True)
    assert not fused.use_fused(x, "nearest", "on") and not fused.use_fused(x.detach(), "stochastic", "on")
    assert fused.use_fused(x.detach(), "nearest", "on") and not fused.use_fused(x.detach(), "nearest", "off")


def test_compile_setting_recipe_field_and_env_override(monkeypatch):
    assert Recipe().compile == "auto" and Recipe(compile="off") == Recipe(compile="on")  # not part of the numerics
    with pytest.raises(ValueError, match=r"Recipe.compile='always' is not one of"):
        Recipe(compile="always")
    from megatron_fp4.config import load_config

    monkeypatch.delenv("MEGATRON_FP4_COMPILE", raising=False)
    assert fused.resolve_compile(None) == "auto" and fused.resolve_compile("on") == "on"
    # MEGATRON_FP4_COMPILE is read while the config loads (fp4.compile), nowhere else
    for env, want in (("0", "off"), ("1", "on"), ("auto", "auto"), ("OFF", "off"), ("", "on")):
        monkeypatch.setenv("MEGATRON_FP4_COMPILE", env)
        assert load_config(overrides=["fp4.compile=on"]).fp4.compile == want, env
        assert fused.resolve_compile("on") == "on", env  # the call's setting: never the environment
    monkeypatch.setenv("MEGATRON_FP4_COMPILE", "maybe")
    with pytest.raises(ValueError, match="MEGATRON_FP4_COMPILE='maybe' is not one of auto/on/off"):
        load_config()


def test_auto_stays_eager_below_the_threshold(monkeypatch, compiled):
    """``auto`` never compiles for a small job: no warm-up process, no compiled kernels, eager's bits."""
    monkeypatch.delenv("MEGATRON_FP4_COMPILE", raising=False)
    x = torch.randn(64, 128)
    out = fake_quantize_nvfp4(x)
    assert torch.equal(_bits(out), _bits(fake_quantize_nvfp4(x, compile="off")))
    (variant,) = fused.PROCESS.variants.values()
    assert variant.state == "new" and variant.seen == x.numel() and not fused.PROCESS.warmups


@needs_inductor
def test_auto_compiles_in_a_child_then_switches_when_adopted(monkeypatch, compiled):
    """Past the threshold ``auto`` starts one warm-up process and returns eager results meanwhile,
    also once the warm-up is done: the switch happens only at ``adopt_ready``. Then calls run the
    checked kernels (counted) with the same bits, and a call that would recompile in the caller (a
    size-1 dim) runs eager."""
    monkeypatch.delenv("MEGATRON_FP4_COMPILE", raising=False)
    monkeypatch.setattr(fused, "AUTO_MIN_ELEMENTS", 1000)
    x = torch.randn(48, 64) * torch.logspace(-3, 3, 64)
    ref = fake_quantize_mxfp4(x, compile="off")
    assert torch.equal(_bits(fake_quantize_mxfp4(x)), _bits(ref))  # eager while the compile runs
    ((_, proc, _),) = fused.PROCESS.warmups
    proc.wait()
    (variant,) = fused.PROCESS.variants.values()
    assert torch.equal(_bits(fake_quantize_mxfp4(x)), _bits(ref)) and variant.state == "warming"
    fused.adopt_ready()
    (variant,) = fused.PROCESS.variants.values()
    if variant.state == "refused":  # not bit-exact on a kernel set forced below the machine's own
        assert os.environ.get("ATEN_CPU_CAPABILITY")
        assert torch.equal(_bits(fake_quantize_mxfp4(x)), _bits(ref))
        return
    assert variant.state == "ready" and fused.compiled_ready("mxfp4")
    calls = []
    run = variant.run
    monkeypatch.setattr(variant, "run", lambda fns, xb: calls.append(xb.shape) or run(fns, xb))
    assert torch.equal(_bits(fake_quantize_mxfp4(x)), _bits(ref)) and calls == [(48, 2, 32)]
    one = x[:1].contiguous()  # a size-1 dim: dynamo would specialize and recompile
    assert torch.equal(_bits(fake_quantize_mxfp4(one)), _bits(fake_quantize_mxfp4(one, compile="off")))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # other global state: the guard fails, eager runs
        assert torch.equal(_bits(fake_quantize_mxfp4(x)), _bits(ref))
    assert not fused.PROCESS.warmups and variant.state == "ready"


def test_a_kernel_that_is_not_bit_exact_is_refused(monkeypatch, compiled):
    """A variant's first compile checks the compiled kernels against the uncompiled bodies (on hard
    probes, random data and the input); kernels with other bits are not used, and the result is eager's."""
    x = torch.randn(8, 64)
    ref = fake_quantize_nvfp4(x, compile="off")

    def wrong_apply(xb, enc, s1, s2, out_dtype):
        return xb.to(torch.float32).to(out_dtype)

    monkeypatch.setattr(fused, "_compiled_copy", lambda body, tag: wrong_apply if body is fused._apply2 else body)
    with pytest.warns(RuntimeWarning, match="not bit-exact"):
        out = fake_quantize_nvfp4(x, compile="on")
    assert torch.equal(_bits(out), _bits(ref))
    (variant,) = fused.PROCESS.variants.values()
    assert variant.state == "refused" and not fused.compiled_ready("nvfp4")


def test_select_step_rounding_equals_bit_step_rounding():
    """The compare-chosen grid step (compiled path) equals the exponent-bit step (eager) on [-6, 6]."""
    every_bf16 = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor(E2M1_VALUES)
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, grid, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1),
                      torch.nextafter(grid, grid + 1), torch.nextafter(grid, grid - 1)])
    y = torch.cat([every_bf16, torch.rand(1 << 20, generator=g) * 12 - 6, near, -near,
                   torch.tensor([1e-45, -1e-45, 1e-39, 0.0, -0.0])])
    y = y[y.isfinite()].clamp(-6.0, 6.0)
    assert torch.equal(_bits(round_e2m1(y)), _bits(round_e2m1_select(y)))


def test_config_field_is_validated():
    from megatron_fp4.config import Config, ConfigError

    cfg = Config()
    assert cfg.fp4.compile == "auto"
    cfg.fp4.compile = "sometimes"
    with pytest.raises(ConfigError, match=r"fp4.compile='sometimes'"):
        cfg.validate()


@pytest.mark.parametrize("mode", ["on", "off"])
def test_config_field_reaches_the_layers(mode):
    """`fp4.compile` is carried by every FP4 layer's recipe (the layers choose kernels from it)."""
    from megatron_fp4.config import Config
    from megatron_fp4.model.specs import attention_recipe, expert_recipe

    cfg = Config()
    cfg.fp4.compile = mode
    cfg.fp4.scope = "experts+attention"
    for mode_name in ("fp4", "fp4_resq"):
        assert expert_recipe(cfg.fp4, mode_name).compile == mode
        assert attention_recipe(cfg.fp4, mode_name).compile == mode


@pytest.mark.parametrize("rc", [fused.WORKER_NOT_EXACT, fused.WORKER_BROKEN, -9])
def test_a_failed_warm_up_leaves_auto_eager(monkeypatch, compiled, rc):
    """A warm-up whose kernels are not bit-exact, whose backend failed, or that was killed: the
    variant stays eager (same bits); only a backend failure stops compiles in this process."""
    monkeypatch.delenv("MEGATRON_FP4_COMPILE", raising=False)
    monkeypatch.setattr(fused, "AUTO_MIN_ELEMENTS", 1)
    code = "import os, sys; print('no compiler here', file=sys.stderr, flush=True); " + (
        f"sys.exit({rc})" if rc > 0 else "import signal; os.kill(os.getpid(), signal.SIGKILL)")
    monkeypatch.setattr(fused, "_worker_command", lambda spec: [sys.executable, "-c", code, spec])
    x = torch.randn(8, 64)
    ref = fake_quantize_nvfp4(x, compile="off")
    assert torch.equal(_bits(fake_quantize_nvfp4(x)), _bits(ref))
    fused.wait_compiled()
    (variant,) = fused.PROCESS.variants.values()
    assert variant.state == "refused" and not fused.PROCESS.warmups
    assert fused.PROCESS.broken == ("no compiler here" if rc == fused.WORKER_BROKEN else None)
    assert torch.equal(_bits(fake_quantize_nvfp4(x)), _bits(ref))


def test_each_owner_has_its_own_kernels(monkeypatch):
    """Two owners' stores (two models' ``Numerics.kernels``, or a test's and the next test's) share
    nothing: what one compiles, counts towards ``auto``, leaves warming or refuses is not the other's;
    a call that names a store uses it, one that names none the process's; a copy starts empty."""
    import copy
    import pickle

    from megatron_fp4.fp4 import Numerics, fused_resq
    from megatron_fp4.fp4.resq import portable_resq_quantize
    from megatron_fp4.fp4.recipe import OperandFormat

    monkeypatch.setattr(fused, "AUTO_MIN_ELEMENTS", 1 << 40)  # count, never start a warm-up
    a, b = fused.CompiledKernels(), fused.CompiledKernels()
    x = torch.randn(8, 64)
    fake_quantize_nvfp4(x, kernels=a)
    fake_quantize_mxfp4(x, kernels=a)
    portable_resq_quantize(x, OperandFormat(format="nvfp4", scale="row", block="1d", rounding="nearest"), True,
                           kernels=a)
    key = ("nvfp4", "row", "1d", torch.float32, torch.float32)
    assert set(a.variants) == {key, ("mxfp4", "floor", torch.float32, torch.float32),
                               fused_resq.key_of("row", torch.float32)}
    assert a.variants[key].seen == 3 * x.numel()  # the input, and the ResQ's eager Q(x) and Q(residual)
    assert not b.variants and not fused.PROCESS.variants
    a.broken = "no compiler (a's)"
    assert not fused.use_fused(x, "nearest", "on", a) and fused.use_fused(x, "nearest", "on", b)
    fake_quantize_nvfp4(x)
    assert list(fused.PROCESS.variants) == [key] and fused.PROCESS.variants[key].seen == x.numel()
    n = Numerics()
    n.kernels = a
    for twin in (copy.deepcopy(n).kernels, pickle.loads(pickle.dumps(n)).kernels, copy.deepcopy(a)):
        assert isinstance(twin, fused.CompiledKernels) and twin is not a and not twin.variants and twin.broken is None


def test_the_trainer_owns_its_kernels_and_adopts_them(monkeypatch):
    """A Trainer's model quantizes through the trainer's own store (not the process's, not another
    trainer's), whose finished warm-ups its step adopts between steps (here: warm-ups that report
    "not bit-exact", so the variants end refused without a compile)."""
    from megatron_fp4.config import load_config
    from megatron_fp4.training.trainer import Trainer

    monkeypatch.setattr(fused, "AUTO_MIN_ELEMENTS", 1)
    code = f"import sys; sys.exit({fused.WORKER_NOT_EXACT})"
    monkeypatch.setattr(fused, "_worker_command", lambda spec: [sys.executable, "-c", code, spec])
    cfg = load_config(overrides=["checkpoint.dir=null", "logging.tensorboard_dir=null", "logging.progress=false",
                                 "fp4.compile=auto", "schedule.warmup_steps=0", "schedule.train_steps=2"])
    trainers = [Trainer(cfg), Trainer(cfg)]
    stores = [t.model.numerics.kernels for t in trainers]
    assert all(isinstance(s, fused.CompiledKernels) for s in stores) and stores[0] is not stores[1]
    trainers[0].train_step()  # starts the warm-ups (threshold 1); its end adopts those already done
    assert stores[0].variants and not stores[1].variants and not fused.PROCESS.variants
    for _, proc, _ in stores[0].warmups:
        proc.wait()
    trainers[0].train_step()  # adopts the rest: every warm-up (not bit-exact) ends refused
    assert not stores[0].warmups and all(v.state == "refused" for v in stores[0].variants.values())
    assert all(v.store is stores[0] for v in stores[0].variants.values())
    assert not stores[1].variants and not fused.PROCESS.variants
