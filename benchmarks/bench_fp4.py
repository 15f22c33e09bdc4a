"""FP4 fake-quant throughput vs a tensor copy, and MoEResQ linear fwd+bwd time vs bf16 mode.

Everything is measured side by side in one run on the same tensors: each row times its candidates
(clone or bf16 reference, eager, compiled) interleaved for ``--rounds`` rounds and keeps the best
median of each (torch.utils.benchmark), so a noisy shared machine hurts all columns alike.
"compiled" is the ``torch.compile`` path of ``megatron_fp4/fp4/fused.py`` (switched on here with
``set_fp4_compile``; its first call per variant compiles and is excluded from the timing).

Usage: ``python benchmarks/bench_fp4.py [--small] [--threads N] [--no-compile]``.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.utils import benchmark

from megatron_fp4.fp4 import Recipe, fake_quantize_mxfp4, fake_quantize_nvfp4, fused, moeresq_linear


def _median_s(fn, min_run_time: float) -> float:
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def _side_by_side(fns: dict, min_run_time: float, rounds: int) -> dict:
    """Best-of-rounds median time of each (name -> (callable, compiled?)), candidates interleaved."""
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, (fn, comp) in fns.items():
            fused.set_fp4_compile(comp)
            best[k] = min(best[k], _median_s(fn, min_run_time))
    fused.set_fp4_compile(False)
    return best


def _warm(fn) -> float:
    fused.set_fp4_compile(True)
    t0 = time.perf_counter()
    fn()
    fn()
    fused.set_fp4_compile(False)
    return time.perf_counter() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--small", action="store_true", help="256 tokens x 256 -> 512 (quick check)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--in-features", type=int, default=1024)
    p.add_argument("--out-features", type=int, default=2816)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--min-run-time", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-compile", action="store_true", help="eager columns only")
    a = p.parse_args(argv)
    if a.small:
        a.tokens, a.in_features, a.out_features, a.min_run_time = 256, 256, 512, 0.2
    torch.set_num_threads(a.threads)
    comp = not a.no_compile
    g = torch.Generator().manual_seed(0)
    x32 = torch.randn(a.tokens, a.in_features, generator=g)
    w32 = torch.randn(a.out_features, a.in_features, generator=g) / a.in_features ** 0.5
    dy32 = torch.randn(a.tokens, a.out_features, generator=g)
    t = a.min_run_time
    print(f"device cpu, {a.threads} thread(s), activations {a.tokens}x{a.in_features}, "
          f"best median of {a.rounds} interleaved rounds")
    print(f"{'operation':<32} {'dtype':>5} {'clone ms':>9} {'eager ms':>9} {'x clone':>8}"
          + (f" {'compiled ms':>11} {'x clone':>8} {'compile s':>9}" if comp else ""))
    for dtype in (torch.float32, torch.bfloat16):
        x = x32.to(dtype)
        name = "fp32" if dtype == torch.float32 else "bf16"
        rows = {
            "nvfp4 fake-quant (row, 1d)": lambda: fake_quantize_nvfp4(x),
            "nvfp4 fake-quant (tensor, 2d)": lambda: fake_quantize_nvfp4(x, scale="tensor", block="2d"),
            "mxfp4 fake-quant (floor)": lambda: fake_quantize_mxfp4(x),
        }
        for label, fn in rows.items():
            warm = _warm(fn) if comp else 0.0
            fns = {"clone": (lambda: x.clone(), False), "eager": (fn, False)}
            if comp:
                fns["compiled"] = (fn, True)
            s = _side_by_side(fns, t, a.rounds)
            line = f"{label:<32} {name:>5} {s['clone'] * 1e3:9.3f} {s['eager'] * 1e3:9.3f} {s['eager'] / s['clone']:8.2f}"
            if comp:
                line += f" {s['compiled'] * 1e3:11.3f} {s['compiled'] / s['clone']:8.2f} {warm:9.1f}"
            print(line)
    print(f"\nMoEResQ linear fwd+bwd, {a.tokens} tokens x {a.in_features} -> {a.out_features} (bf16 tensors)")
    print(f"{'mode':<32} {'bf16 ms':>9} {'eager ms':>9} {'x bf16':>8}"
          + (f" {'compiled ms':>11} {'x bf16':>8} {'compile s':>9}" if comp else ""))
    xb = x32.bfloat16().requires_grad_()
    wb = w32.bfloat16().requires_grad_()
    dyb = dy32.bfloat16()

    def step(mode, fmt="nvfp4"):
        recipe = Recipe.for_format(mode, fmt)
        return lambda: moeresq_linear(xb, wb, recipe=recipe).backward(dyb)

    ref = step("bf16")
    for mode, fmt in (("fp4", "nvfp4"), ("fp4_resq", "nvfp4"), ("fp4_resq", "mxfp4")):
        fn = step(mode, fmt)
        warm = _warm(fn) if comp else 0.0
        fns = {"bf16": (ref, False), "eager": (fn, False)}
        if comp:
            fns["compiled"] = (fn, True)
        s = _side_by_side(fns, t, a.rounds)
        line = f"{mode + ' ' + fmt:<32} {s['bf16'] * 1e3:9.3f} {s['eager'] * 1e3:9.3f} {s['eager'] / s['bf16']:8.2f}"
        if comp:
            line += f" {s['compiled'] * 1e3:11.3f} {s['compiled'] / s['bf16']:8.2f} {warm:9.1f}"
        print(line)


if __name__ == "__main__":
    main()
