"""The Triton section of tools/gpu_check.py: the FP4 kernels bitwise against the portable quantizers,
the MoEResQ hook, and (CUDA) their speed against a copy of the same bytes.

On CUDA the kernels run compiled; on the CPU (``--device cpu`` dry run, tests/unit/test_fp4_triton.py)
the same comparisons run under Triton's interpreter when ``TRITON_INTERPRET=1`` was set before
triton was imported, and are skipped with that reason otherwise. The reference is always the
portable code (``triton="off"``): on the CPU for round-to-nearest-even; on the checked
device for stochastic rounding, whose draws come from the device's generator (the portable path
itself is checked CUDA == CPU by gpu_check's quantizer section).
"""
from __future__ import annotations

import itertools
import json
import statistics
import time

import torch
import torch.nn.functional as F

from megatron_fp4.fp4 import NonFiniteFlags, NonFiniteInputError, Numerics, Recipe, moeresq_linear, triton_fp4
from megatron_fp4.fp4.moeresq import fake_quantize, resq_quantize
from megatron_fp4.fp4.recipe import OperandFormat

FORMATS = {
    "nvfp4 row/1d": OperandFormat(),
    "nvfp4 tensor/1d": OperandFormat(scale="tensor"),
    "nvfp4 tensor/2d": OperandFormat(scale="tensor", block="2d"),
    "mxfp4 floor": OperandFormat(format="mxfp4", scale="tensor"),
    "mxfp4 rceil": OperandFormat(format="mxfp4", scale="tensor", mx_scale_mode="rceil"),
}
TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0]


def special_values() -> torch.Tensor:
    """(32, 64) fp32 rows of hard cases, 16-element blocks with exact-power-of-two scales.

    A block of ``TIES`` has NVFP4 block scale 1 when the row amax is 2688 (S_enc = 1), and MXFP4
    exponent 0, so its elements sit exactly on E2M1 rounding ties; the same block scaled by 2^k gives
    E4M3-subnormal (2^-8), tie-to-zero (2^-10) and fp32-subnormal (2^-140) scales; 6.2 saturates
    (its E4M3 scale rounds down); zero blocks and zero rows; huge values (1e38)."""
    rows = []
    tie = torch.tensor(TIES)
    for k in (0, 1, -8, -10, -11, -140, 20, 100):
        first = torch.zeros(16)
        first[0] = 2688.0
        rows.append(torch.cat([first, tie * 2.0 ** k, torch.full((16,), 6.2) * torch.tensor([1.0, -1.0] * 8),
                               tie * 3 * 2.0 ** (k - 3)]))
        rows.append(torch.cat([tie * 2.0 ** k, torch.zeros(16), tie * 2.0 ** (k + 3), tie * 2.0 ** (k - 1)]))
    rows.append(torch.zeros(64))
    rows.append(-torch.zeros(64))
    rows.append(torch.linspace(-1e38, 1e38, 64))
    rows.append(torch.tensor([1e-45, -1e-44, 2e-40, 7.0] * 16))
    while len(rows) < 32:
        rows.append(torch.randn(64, generator=torch.Generator().manual_seed(len(rows))) * 10.0 ** (len(rows) - 26))
    return torch.stack(rows)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    """'' when bit-equal, else what differs."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    bad = int((_bits(a) != _bits(b)).sum())
    return f"{bad} of {a.numel()} elements differ" if bad else ""


def _reference(x, fmt, compensated, seed, columns, out_dtype, dev):
    """The portable result (on the CPU for RNE, on ``dev`` for SR: the draws come from its generator)."""
    on = dev if fmt.rounding == "stochastic" else torch.device("cpu")
    gen = torch.Generator(device=on).manual_seed(seed)
    x = x.to(on)
    if columns:
        x = F.pad(x.t(), (0, (-x.shape[0]) % fmt.block_size)).contiguous()
    if out_dtype != torch.float32:
        return fake_quantize(x, fmt, gen)  # in x's dtype
    return resq_quantize(x, fmt, compensated, gen, triton="off")


def _kernel(x, fmt, compensated, seed, columns, out_dtype, dev):
    gen = torch.Generator(device=dev).manual_seed(seed)
    return triton_fp4.quantize(x, fmt, compensated=compensated, generator=gen, columns=columns, out_dtype=out_dtype)


def bitwise_cases(quick: bool):
    """(label, x (CPU), fmt, compensated, seed, columns, out_dtype, layout) for every variant."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(48, 192, generator=g) * torch.logspace(-4, 4, 192)  # wide dynamic range
    wide[1, :32] = 0.0  # an all-zero block
    shapes = {"48x96": wide[:, :96].contiguous(), "48x96 strided": wide[:, ::2],
              "2x32x64": torch.randn(2, 32, 64, generator=g).mul(3)}
    if not quick:  # on the GPU: more blocks than threads of one program, no new compiled variant
        shapes["1024x2048"] = torch.randn(1024, 2048, generator=g)
    for (fname, fmt), rounding, comp, dtype in itertools.product(
            FORMATS.items(), ("nearest", "stochastic"), (False, True), (torch.float32, torch.bfloat16)):
        f = OperandFormat(**{**fmt.__dict__, "rounding": rounding})
        tag = f"{fname} {rounding[:3]} {'Q+Q(r)' if comp else 'Q'} {str(dtype)[6:]}"
        # fp32 contiguous, bf16 strided: each (options, dtype, layout) is a kernel to interpret or compile
        for sname, x in shapes.items():
            if (dtype == torch.float32) == (sname != "48x96 strided") and not (
                    quick and sname == "2x32x64" and rounding == "stochastic"):
                yield f"{tag} {sname}", x.to(dtype), f, comp, 7, False, torch.float32
        if dtype == torch.float32:
            yield f"{tag} columns 40x96", wide[:40, :96].to(dtype), f, comp, 8, True, torch.float32
        if rounding == "nearest":
            yield f"{tag} special values", special_values().to(dtype), f, comp, 0, False, torch.float32
            if not comp and dtype == torch.bfloat16:
                yield f"{tag} -> bf16 out", shapes["48x96"].to(dtype), f, comp, 0, False, torch.bfloat16
    for (fname, fmt), rounding, dtype in itertools.product(
            FORMATS.items(), ("nearest", "stochastic"), (torch.float16, torch.float64)):
        f = OperandFormat(**{**fmt.__dict__, "rounding": rounding})
        yield f"{fname} {rounding[:3]} Q+Q(r) {str(dtype)[6:]} 48x96", shapes["48x96"].to(dtype), f, True, 7, False, \
            torch.float32
    for seed in range(3 if quick else 20):  # more stochastic-rounding streams
        fmt = OperandFormat(rounding="stochastic")
        yield f"nvfp4 row/1d sto Q+Q(r) float32 seed {seed}", shapes["48x96"], fmt, True, seed, False, torch.float32


def check_bitwise(dev: torch.device, record, quick: bool) -> None:
    for label, x, fmt, comp, seed, columns, out_dtype in bitwise_cases(quick):
        name = f"triton {label} {dev.type}==portable"
        try:
            xd = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=dev).copy_(x)  # same strides
            got = _kernel(xd, fmt, comp, seed, columns, out_dtype, dev)
            bad = _mismatch(got, _reference(x, fmt, comp, seed, columns, out_dtype, dev))
            record(name, "FAIL" if bad else "PASS", bad or "bit-equal")
        except Exception as e:  # one broken variant must not hide the rest
            record(name, "FAIL", f"{type(e).__name__}: {e}")


def _outcome(fn):
    """(error type and message, or None; result)."""
    try:
        return None, fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}", None


def check_contract(dev: torch.device, record) -> None:
    """Bad input behaves as in the portable path: the same errors, the same deferred flags."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(4))
    nan = x.clone()
    nan[3, 5], nan[7, 9] = float("nan"), float("inf")
    cases = [("NaN/Inf input", nan, fname, fmt) for fname, fmt in FORMATS.items()]
    cases += [("last dim not a multiple", x[:, :40], "mxfp4 floor", FORMATS["mxfp4 floor"]),
              ("2-D tiles, rows not a multiple of 16", x[:24], "nvfp4 tensor/2d", FORMATS["nvfp4 tensor/2d"]),
              ("2-D tiles with a per-row scale", x, "nvfp4 row/2d", OperandFormat(scale="row", block="2d"))]
    for what, bad, fname, fmt in cases:
        for comp in (False, True):
            label = f"triton {what} ({fname}{' Q+Q(r)' if comp else ''}) on {dev.type}"
            want, _ = _outcome(lambda: resq_quantize(bad, fmt, comp, name="t", triton="off"))
            got, _ = _outcome(lambda: triton_fp4.quantize(bad.to(dev), fmt, compensated=comp, name="t"))
            record(label + ": same error", "PASS" if got == want and want else "FAIL", f"{got!r} vs portable {want!r}")
            if not torch.isfinite(bad.float()).all():  # deferred: the same flagged tensors, no exception
                flags = [NonFiniteFlags(), NonFiniteFlags()]
                resq_quantize(bad, fmt, comp, name="t", nonfinite=flags[0], triton="off")
                triton_fp4.quantize(bad.to(dev), fmt, compensated=comp, name="t", nonfinite=flags[1])
                err = flags[1].error()
                same = str(flags[0].error()) == str(err) and isinstance(err, NonFiniteInputError)
                record(label + ": same deferred flags", "PASS" if same else "FAIL", str(flags[1].error()))


def check_hook(dev: torch.device, record) -> None:
    """moeresq_linear forward/dgrad/wgrad through the dispatch hook == the portable path, bitwise
    (the same quantized operands feed the same GEMMs), and the kernels did serve the operands."""
    mode = "interpret" if dev.type == "cpu" else "auto"
    kernels, portable = Numerics(triton=mode), Numerics(triton="off")
    if not triton_fp4.use_triton(torch.zeros(1, device=dev), mode):
        record("triton hook: moeresq_linear", "SKIP", "the dispatch hook is off here "
               "(the kernels were disabled by a failure)")
        return
    g = torch.Generator().manual_seed(5)
    x0, w0 = torch.randn(40, 64, generator=g), torch.randn(64, 64, generator=g) * 0.1
    dy = torch.randn(40, 64, generator=g)
    recipes = {"nvfp4 fp4_resq": Recipe(), "nvfp4 fp4_resq SR": Recipe(
        input=OperandFormat(rounding="stochastic"), grad_output=OperandFormat(rounding="stochastic"), seed=3),
        "mxfp4 fp4_resq": Recipe.for_format("fp4_resq", "mxfp4"), "nvfp4 fp4": Recipe(mode="fp4")}
    for rname, recipe in recipes.items():
        outs = []
        for use in (True, False):
            x, w = x0.to(dev).requires_grad_(True), w0.to(dev).requires_grad_(True)
            served = triton_fp4.served()
            y = moeresq_linear(x, w, recipe=recipe, name="layer", numerics=kernels if use else portable)
            y.backward(dy.to(dev))
            outs.append((y, x.grad, w.grad, triton_fp4.served() - served))
        bad = [n for n, a, b in zip(("y", "dx", "dw"), outs[0], outs[1]) if _mismatch(a, b)]
        n_served = outs[0][3]
        ok = not bad and n_served == 5 and outs[1][3] == 0  # x, W, dY, dY columns, x columns
        record(f"triton hook: moeresq_linear {rname} fwd/bwd on {dev.type} == portable", "PASS" if ok else "FAIL",
               f"differs in {bad}" if bad else f"bit-equal; {n_served} operands from the kernels")


def _time_ms(fn, repeats: int, dev: torch.device) -> float:
    """Median time of ``fn``: CUDA events on a GPU, the wall clock elsewhere."""
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def check_speed(dev: torch.device, record, quick: bool) -> None:
    """Kernel time vs a device copy of the same input bytes (read x, write an fp32 tensor of its
    size), and vs the portable path; medians of alternating repeats. Times include the host side
    (checks, SR draws, 1-3 launches), as a training step sees it. On the CPU (interpreter) the same
    code runs once on a small tensor: it checks the script, its times mean nothing."""
    cuda = dev.type == "cuda"
    rows, cols = ((4096, 4096) if quick else (16384, 4096)) if cuda else (64, 128)
    x = torch.randn(rows, cols, device=dev)
    out = torch.empty_like(x)
    gen = torch.Generator(device=dev)
    variants = [(f"{name} {'Q+Q(r)' if comp else 'Q'}{' columns' if col else ''}{' SR' if sr else ''}",
                 OperandFormat(**{**fmt.__dict__, "rounding": "stochastic" if sr else "nearest"}), comp, col)
                for name, fmt, comp, col, sr in [
                    ("nvfp4 row/1d", FORMATS["nvfp4 row/1d"], False, False, False),
                    ("nvfp4 row/1d", FORMATS["nvfp4 row/1d"], True, False, False),
                    ("nvfp4 row/1d", FORMATS["nvfp4 row/1d"], True, True, False),
                    ("nvfp4 row/1d", FORMATS["nvfp4 row/1d"], True, False, True),
                    ("nvfp4 tensor/2d", FORMATS["nvfp4 tensor/2d"], False, False, False),
                    ("mxfp4 floor", FORMATS["mxfp4 floor"], True, False, False)]]
    reps, rounds = (10 if quick else 20, 3) if cuda else (1, 1)
    flags = NonFiniteFlags()  # deferred NaN checks, as inside a training step on CUDA: no host sync
    for label, fmt, comp, col in variants:
        def kern():
            return triton_fp4.quantize(x, fmt, compensated=comp, generator=gen, columns=col, nonfinite=flags)

        def port():
            a = x.t().contiguous() if col else x
            return resq_quantize(a, fmt, comp, gen, nonfinite=flags, triton="off")
        bad = "" if fmt.rounding == "stochastic" else _mismatch(kern(), port())  # also compiles, warms up
        t_copy, t_kern, t_port = ([] for _ in range(3))
        for _ in range(rounds):  # alternate, so drift hits all three alike
            t_copy.append(_time_ms(lambda: out.copy_(x), reps, dev))
            t_kern.append(_time_ms(kern, reps, dev))
            t_port.append(_time_ms(port, max(1, reps // 4), dev))
        c, k, p = (statistics.median(t) for t in (t_copy, t_kern, t_port))
        record(f"triton speed {label} {rows}x{cols} fp32{'' if cuda else ' (interpreter: not a speed)'}",
               "FAIL" if bad else "PASS", (f"not bit-equal to the portable path: {bad}; " if bad else "") + json.dumps(
                   {"kernel_ms": round(k, 4), "copy_ms": round(c, 4), "kernel/copy": round(k / c, 2),
                    "portable_ms": round(p, 4), "portable/kernel": round(p / k, 1)}))


def cannot_run(dev: torch.device):
    """Why Triton kernels cannot run on ``dev`` here (a sentence), or None when they can."""
    ok, why = triton_fp4.triton_importable()
    if not ok:
        return why
    if dev.type == "cpu" and not triton_fp4.interpreting():
        return ("CPU dry run without the interpreter: set TRITON_INTERPRET=1 before starting to run the kernel "
                "checks under Triton's interpreter")
    return None


def run(dev: torch.device, record, quick: bool) -> None:
    """Every Triton check on ``dev`` (skipped with the reason when the kernels cannot run there)."""
    why = cannot_run(dev)
    if why:
        record("triton FP4 kernels", "SKIP", why)
        return
    check_bitwise(dev, record, quick)
    check_contract(dev, record)
    check_hook(dev, record)
    check_speed(dev, record, quick)
