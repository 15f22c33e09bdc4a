"""MoE layer: grouped expert GEMMs vs the per-expert loop, at 8 / 64 / 128 experts.

    python benchmarks/bench_moe_grouped.py                  # hidden 256, ffn 256, 1024 tokens, top-2
    python benchmarks/bench_moe_grouped.py --experts 8,64,128 --tokens 4096 --repeats 7

Two cases per expert count: ``bf16 fwd+bwd`` (FP4 off, a training step's MoE layer) and
``fp4_resq fwd`` (no autograd, Q(W) cached as in a rollout: `GroupedExperts.grouped_fp4_forward`).
One `MoELayer` per case; timed calls alternate grouped / loop (`GroupedExperts.grouped`) so machine
noise hits both alike, and every call's output (and gradients) are compared: the largest
difference relative to the output's largest magnitude is printed (0 = bitwise equal). Prints
tokens/s and the speed-up.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_fp4.fp4 import Numerics, Recipe, apply_numerics
from megatron_fp4.model.moe import MoELayer


def infer(layer, x, dy):
    with torch.no_grad(), layer.experts.numerics.cached_weights():
        start = time.perf_counter()
        y = layer(x)
        return time.perf_counter() - start, (y,)


def step(layer, x, dy):
    layer.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_(True)
    start = time.perf_counter()
    y = layer(xx)
    y.backward(dy)
    dt = time.perf_counter() - start
    return dt, (y.detach(), xx.grad, layer.experts.w13.grad, layer.experts.w2.grad)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", default="8,64,128")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(f"threads={torch.get_num_threads()} hidden={args.hidden} ffn={args.ffn} tokens={args.tokens} "
          f"top_k={args.top_k} repeats={args.repeats}")
    print(f"{'experts':>7} {'case':<15} {'loop tok/s':>11} {'grouped tok/s':>14} {'speed-up':>9} {'max |diff|/max|y|':>18}")
    rows = []
    for E in (int(e) for e in args.experts.split(",")):
        for case, mode, fn in (("bf16 fwd+bwd", "bf16", step), ("fp4_resq fwd", "fp4_resq", infer)):
            torch.manual_seed(0)
            layer = MoELayer(args.hidden, E, args.top_k, args.ffn, Recipe(mode=mode))
            apply_numerics(layer, Numerics())
            with torch.no_grad():
                for prm in layer.parameters():
                    prm.normal_(0, 0.05)
            x = torch.randn(args.tokens, args.hidden)
            dy = torch.randn(args.tokens, args.hidden)
            times = {"loop": [], "grouped": []}
            worst = 0.0
            for i in range(args.repeats + 1):  # round 0 warms up
                res = {}
                for name in (("loop", "grouped") if i % 2 else ("grouped", "loop")):
                    layer.experts.grouped = name == "grouped"
                    dt, res[name] = fn(layer, x, dy)
                    if i:
                        times[name].append(dt)
                for a, b in zip(res["grouped"], res["loop"]):
                    worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
            t_l, t_g = statistics.median(times["loop"]), statistics.median(times["grouped"])
            rows.append((E, case, args.tokens / t_l, args.tokens / t_g, t_l / t_g, worst))
            print(f"{E:>7} {case:<15} {args.tokens / t_l:>11.0f} {args.tokens / t_g:>14.0f} {t_l / t_g:>8.2f}x "
                  f"{worst:>18.1e}", flush=True)
    return rows


if __name__ == "__main__":
    main()
