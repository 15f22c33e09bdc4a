"""``megatron-fp4-demo``: forward error of one expert-sized MoEResQ linear in each mode."""
from __future__ import annotations

import argparse

import torch

from megatron_fp4.fp4.moeresq import fake_quantize, moeresq_linear, sqnr_db
from megatron_fp4.fp4.recipe import FORMATS, MODES, Recipe


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--in-features", type=int, default=1024)
    parser.add_argument("--out-features", type=int, default=2816)
    parser.add_argument("--format", choices=FORMATS, default="nvfp4")
    args = parser.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.in_features, generator=g)
    w = torch.randn(args.out_features, args.in_features, generator=g) / args.in_features ** 0.5
    exact = x.double() @ w.double().T
    print(f"MoEResQ linear {args.tokens} tokens x {args.in_features} -> {args.out_features}, {args.format}")
    exact_qw = x.double() @ fake_quantize(w, Recipe.for_format("fp4", args.format).weight).double().T
    print(f"{'mode':>10} | rel. error vs x·Wᵀ | vs x·Q(W)ᵀ (input error only)")
    for mode in MODES:
        recipe = Recipe.for_format(mode, args.format)
        xin = x.bfloat16() if mode == "bf16" else x
        y = moeresq_linear(xin, w.to(xin.dtype), recipe=recipe).double()
        err = ((y - exact).norm() / exact.norm()).item()
        err_qw = ((y - exact_qw).norm() / exact_qw.norm()).item() if mode != "bf16" else float("nan")
        print(f"{mode:>10} | {err:17.3e} | {err_qw:.3e}")
    recipe = Recipe.for_format("fp4", args.format)
    print(f"SQNR input {sqnr_db(x, recipe.input):.1f} dB, weight {sqnr_db(w, recipe.weight):.1f} dB")


if __name__ == "__main__":
    main()
