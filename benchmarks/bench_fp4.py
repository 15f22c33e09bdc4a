"""FP4 fake-quant throughput vs a tensor copy, and MoEResQ linear fwd+bwd time vs bf16 mode.

Everything is measured side by side in one run on the same tensors (median of repeats via
torch.utils.benchmark). Usage: ``python benchmarks/bench_fp4.py [--small] [--threads N]``.
"""
from __future__ import annotations

import argparse

import torch
from torch.utils import benchmark

from megatron_fp4.fp4 import Recipe, fake_quantize_mxfp4, fake_quantize_nvfp4, moeresq_linear


def _median_s(fn, min_run_time: float) -> float:
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--small", action="store_true", help="256 tokens x 256 -> 512 (quick check)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--in-features", type=int, default=1024)
    p.add_argument("--out-features", type=int, default=2816)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--min-run-time", type=float, default=1.0)
    a = p.parse_args(argv)
    if a.small:
        a.tokens, a.in_features, a.out_features, a.min_run_time = 256, 256, 512, 0.3
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    x32 = torch.randn(a.tokens, a.in_features, generator=g)
    w32 = torch.randn(a.out_features, a.in_features, generator=g) / a.in_features ** 0.5
    dy32 = torch.randn(a.tokens, a.out_features, generator=g)
    t = a.min_run_time
    print(f"device cpu, {a.threads} thread(s), activations {a.tokens}x{a.in_features}")
    print(f"{'operation':<34} {'dtype':>6} {'time ms':>9} {'x clone':>8}")
    for dtype in (torch.float32, torch.bfloat16):
        x = x32.to(dtype)
        base = _median_s(lambda: x.clone(), t)
        name = "fp32" if dtype == torch.float32 else "bf16"
        print(f"{'clone (same bytes)':<34} {name:>6} {base * 1e3:9.3f} {1.0:8.2f}")
        rows = {
            "nvfp4 fake-quant (row, 1d)": lambda: fake_quantize_nvfp4(x),
            "nvfp4 fake-quant (tensor, 2d)": lambda: fake_quantize_nvfp4(x, scale="tensor", block="2d"),
            "mxfp4 fake-quant (floor)": lambda: fake_quantize_mxfp4(x),
        }
        for label, fn in rows.items():
            s = _median_s(fn, t)
            print(f"{label:<34} {name:>6} {s * 1e3:9.3f} {s / base:8.2f}")
    print(f"\nMoEResQ linear fwd+bwd, {a.tokens} tokens x {a.in_features} -> {a.out_features}")
    print(f"{'mode':<34} {'dtype':>6} {'time ms':>9} {'x bf16':>8}")
    xb = x32.bfloat16().requires_grad_()
    wb = w32.bfloat16().requires_grad_()
    dyb = dy32.bfloat16()

    def step(mode, fmt="nvfp4"):
        recipe = Recipe.for_format(mode, fmt)
        return lambda: moeresq_linear(xb, wb, recipe=recipe).backward(dyb)

    ref = _median_s(step("bf16"), t)
    print(f"{'bf16 (F.linear)':<34} {'bf16':>6} {ref * 1e3:9.3f} {1.0:8.2f}")
    for mode, fmt in (("fp4", "nvfp4"), ("fp4_resq", "nvfp4"), ("fp4_resq", "mxfp4")):
        s = _median_s(step(mode, fmt), t)
        print(f"{mode + ' ' + fmt:<34} {'bf16':>6} {s * 1e3:9.3f} {s / ref:8.2f}")


if __name__ == "__main__":
    main()
