"""FP4 fake-quant vs a copy of the same bytes, MoEResQ fwd+bwd vs bf16 mode, and first-call latency.

One run prints the three goals of issue 16 side by side:

1. fake-quant time ÷ ``clone`` of the same tensor, for the plain ops (``compile="off"``) and the
   default path (``compile="auto"`` in its steady state: the kernels that ``auto`` compiles in the
   background once a job has quantized enough; warmed here up front so the columns compare kernels);
2. MoEResQ linear fwd+bwd time ÷ the same layer in ``bf16`` mode, plain ops and default path;
3. first-call latency in a fresh process: the first fake-quant call and the first MoEResQ step on
   the default path next to a steady eager call, and what ``compile="on"`` would cost there (inductor
   cache cold and warm).

Candidates are interleaved for ``--rounds`` rounds and each keeps its best median
(torch.utils.benchmark). With one thread the timer is the thread's CPU time, so on a shared machine
the other processes' load does not land in the numbers (a background compile thread does not either).

Usage: ``python benchmarks/bench_fp4.py [--small] [--threads N] [--only fake-quant|moeresq|first-call]``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils import benchmark

from megatron_fp4.fp4 import Recipe, fake_quantize_mxfp4, fake_quantize_nvfp4, fused, moeresq_linear


def _side_by_side(fns: dict, min_run_time: float, rounds: int, timer) -> dict:
    """Best-of-rounds median seconds of each name -> callable, candidates interleaved."""
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = benchmark.Timer(stmt="fn()", globals={"fn": fn}, timer=timer)
            best[k] = min(best[k], t.blocked_autorange(min_run_time=min_run_time).median)
    return best


def _fq_rows(x):
    return {
        "nvfp4 fake-quant (row, 1d)": lambda c: fake_quantize_nvfp4(x, compile=c),
        "nvfp4 fake-quant (tensor, 2d)": lambda c: fake_quantize_nvfp4(x, scale="tensor", block="2d", compile=c),
        "mxfp4 fake-quant (floor)": lambda c: fake_quantize_mxfp4(x, compile=c),
    }


def _moeresq_step(x, w, dy, mode, fmt, comp):
    recipe = Recipe.for_format(mode, fmt, compile=comp)
    return lambda: moeresq_linear(x, w, recipe=recipe).backward(dy)


def _bench_fake_quant(a, timer) -> None:
    g = torch.Generator().manual_seed(0)
    x32 = torch.randn(a.tokens, a.in_features, generator=g)
    print(f"\n1) fake-quant of {a.tokens}x{a.in_features}, time / clone of the same tensor")
    print(f"{'operation':<32} {'dtype':>5} {'clone ms':>9} {'plain ms':>9} {'x clone':>8} {'default ms':>10} "
          f"{'x clone':>8} {'compiled':>8}")
    worst = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = x32.to(dtype)
        for label, fn in _fq_rows(x).items():
            fn("on")  # what auto reaches in a long job: the checked kernels of this variant
            fns = {"clone": x.clone, "plain": lambda fn=fn: fn("off"), "default": lambda fn=fn: fn(None)}
            s = _side_by_side(fns, a.min_run_time, a.rounds, timer)
            worst[dtype] = max(worst.get(dtype, 0.0), s["default"] / s["clone"])
            used = "yes" if fused.compiled_ready(label[:5]) and fused.resolve_compile(None) != "off" else "no"
            print(f"{label:<32} {str(dtype)[6:]:>5} {s['clone'] * 1e3:9.3f} {s['plain'] * 1e3:9.3f} "
                  f"{s['plain'] / s['clone']:8.2f} {s['default'] * 1e3:10.3f} {s['default'] / s['clone']:8.2f} {used:>8}")
    print("ratios (default path, worst of the three, this run; goals of issue 27 in brackets):")
    for dtype, r in worst.items():
        print(f"  fake-quant, {str(dtype)[6:]} input, vs a copy: {r:.2f}x  [<= 3x]")


def _bench_moeresq(a, timer) -> None:
    g = torch.Generator().manual_seed(1)
    xb = torch.randn(a.tokens, a.in_features, generator=g).bfloat16().requires_grad_()
    wb = (torch.randn(a.out_features, a.in_features, generator=g) / a.in_features ** 0.5).bfloat16().requires_grad_()
    dyb = torch.randn(a.tokens, a.out_features, generator=g).bfloat16()
    print(f"\n2) MoEResQ linear fwd+bwd, {a.tokens} tokens x {a.in_features} -> {a.out_features} (bf16 tensors), "
          "time / the bf16-mode layer")
    print(f"{'mode':<32} {'bf16 ms':>9} {'plain ms':>9} {'x bf16':>8} {'default ms':>10} {'x bf16':>8}")
    ref = _moeresq_step(xb, wb, dyb, "bf16", "nvfp4", "off")
    for mode, fmt in (("fp4", "nvfp4"), ("fp4_resq", "nvfp4"), ("fp4_resq", "mxfp4")):
        _moeresq_step(xb, wb, dyb, mode, fmt, "on")()  # compile and check this layer's variants
        fns = {"bf16": ref, "plain": _moeresq_step(xb, wb, dyb, mode, fmt, "off"),
               "default": _moeresq_step(xb, wb, dyb, mode, fmt, "auto")}
        s = _side_by_side(fns, a.min_run_time, a.rounds, timer)
        print(f"{mode + ' ' + fmt:<32} {s['bf16'] * 1e3:9.1f} {s['plain'] * 1e3:9.1f} {s['plain'] / s['bf16']:8.2f} "
              f"{s['default'] * 1e3:10.1f} {s['default'] / s['bf16']:8.2f}")


def _first_call_probe(compile_mode: str, tokens: int, d_in: int, d_out: int) -> dict:
    """In this fresh process: seconds of the first fake-quant call and first MoEResQ step, then of a
    steady eager call and step (medians of 5)."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, d_in, generator=g)
    w = (torch.randn(d_out, d_in, generator=g) / d_in ** 0.5).requires_grad_()
    dy = torch.randn(tokens, d_out, generator=g)
    xg = x.clone().requires_grad_()
    step = _moeresq_step(xg, w, dy, "fp4_resq", "nvfp4", compile_mode)
    t0 = time.perf_counter()
    fake_quantize_nvfp4(x, compile=compile_mode)
    t1 = time.perf_counter()
    step()
    t2 = time.perf_counter()

    def median(fn):
        ts = []
        for _ in range(5):
            s = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - s)
        return sorted(ts)[2]

    return {"first_fq": t1 - t0, "first_step": t2 - t1,
            "steady_fq_eager": median(lambda: fake_quantize_nvfp4(x, compile="off")),
            "steady_step_eager": median(_moeresq_step(xg, w, dy, "fp4_resq", "nvfp4", "off"))}


def _bench_first_call(a, timer=None) -> None:
    print(f"\n3) first call in a fresh process (1 thread; fake-quant {a.tokens}x{a.in_features} nvfp4, "
          f"fp4_resq step {a.tokens}x{a.in_features}->{a.out_features} fp32)")
    print(f"{'setting':<34} {'1st fake-quant s':>16} {'x steady':>8} {'1st step s':>10} {'x steady':>8}")
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_FP4_COMPILE"}
    with tempfile.TemporaryDirectory() as cold:
        for label, mode, extra in (("default (auto)", "auto", {}), ("compile=on, inductor cache warm", "on", {}),
                                   ("compile=on, inductor cache cold", "on", {"TORCHINDUCTOR_CACHE_DIR": cold})):
            cmd = [sys.executable, __file__, "--first-call-probe", mode, "--tokens", str(a.tokens),
                   "--in-features", str(a.in_features), "--out-features", str(a.out_features)]
            out = subprocess.run(cmd, env={**env, **extra, "OMP_NUM_THREADS": "1"}, capture_output=True,
                                 text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{label:<34} {r['first_fq']:16.3f} {r['first_fq'] / r['steady_fq_eager']:8.1f} "
                  f"{r['first_step']:10.3f} {r['first_step'] / r['steady_step_eager']:8.1f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--small", action="store_true", help="256 tokens x 256 -> 512 (quick check)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--in-features", type=int, default=1024)
    p.add_argument("--out-features", type=int, default=2816)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--min-run-time", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", choices=("fake-quant", "moeresq", "first-call"), help="run one section")
    p.add_argument("--first-call-probe", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.small:
        a.tokens, a.in_features, a.out_features, a.min_run_time = 256, 256, 512, 0.2
    if a.first_call_probe:
        print(json.dumps(_first_call_probe(a.first_call_probe, a.tokens, a.in_features, a.out_features)))
        return
    torch.set_num_threads(a.threads)
    timer = time.thread_time if a.threads == 1 else time.perf_counter
    print(f"device cpu, {a.threads} thread(s), {'thread CPU' if a.threads == 1 else 'wall'} time, best median "
          f"of {a.rounds} interleaved rounds; compile setting {fused.resolve_compile(None)}")
    for name, section in (("fake-quant", _bench_fake_quant), ("moeresq", _bench_moeresq),
                          ("first-call", _bench_first_call)):
        if a.only in (None, name):
            section(a, timer)


if __name__ == "__main__":
    main()
