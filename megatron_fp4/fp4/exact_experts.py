"""The batch-invariant forward of many MoEResQ linears over consecutive runs of rows (MoE experts).

`exact_grouped_fp4` gives every run the bits `moeresq_linear` gives it in the batch-invariant mode
(the exact FP4 GEMM of ``exact_gemm``), with the input quantized once for all rows instead of once
per run, and the exact sums' scaling and rounding (elementwise, per row) done once for all runs. That is the same computation only where a row's FP4 codes depend on that row alone
(`row_local`: nearest rounding with per-row NVFP4 scales in 1-D blocks, or MXFP4) and the weight is
rounded to nearest (no stochastic stream keyed by the expert), without autograd and with eager
non-finite checks (a deferred check records per-layer flags); callers check `can_group_exact_fp4`.

`shared_input_linear` is the other sharing: several linears on one input (vLLM's fused q/k/v and
gate/up), each the bits `moeresq_linear(x, w_i, b_i)` gives, with ``Q̃(x)`` computed once (under
nearest rounding it is a function of ``x`` alone) and, in the batch-invariant mode, one exact GEMM
over the shards' concatenated weight splits (each output element is the exact sum of its own row
and column, scaled elementwise: the concatenation cannot change it).
"""
from __future__ import annotations

from typing import Sequence

import torch

from megatron_fp4.fp4 import invariant
from megatron_fp4.fp4.exact_gemm import (CHUNK, Split, cached_for_weight, exact_fp4_gemm, exact_fp4_terms,
                                         exact_sum_products, pair_bound)
from megatron_fp4.fp4.moeresq import _accumulate_dtype, _cached_weight, _gemm, _no_autocast, _Site
from megatron_fp4.fp4.numerics import STANDARD, Numerics
from megatron_fp4.fp4.recipe import Recipe, row_local



def can_group_exact_fp4(recipe: Recipe, x: torch.Tensor, weights, numerics: Numerics = STANDARD) -> bool:
    if recipe.mode not in ("fp4", "fp4_resq") or not invariant.exact(numerics):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return False
    if numerics.position.nonfinite_flags_for(x.device) is not None:
        return False
    return row_local(recipe.input) and recipe.weight.rounding == "nearest"


def exact_grouped_fp4(x: torch.Tensor, weights: Sequence[torch.Tensor], counts: Sequence[int], recipe: Recipe,
                      names: Sequence[str], group_name: str, numerics: Numerics = STANDARD) -> torch.Tensor:
    """Rows of ``x`` (R, K) in runs of ``counts[i]``, run i through ``moeresq_linear(run, weights[i],
    recipe=recipe, name=names[i])``'s batch-invariant forward (bias-free); ``group_name`` names the
    shared input quantization in non-finite errors.

    A run's terms (Q(x) and the residual) go through one GEMM on its weight: the rows of
    ``x_terms`` stacked term-minor, so run i's rows of every term are one contiguous block, written
    in place into a (R, terms, N) buffer (each sum is exact: the GEMM's shape cannot change it)."""
    r = recipe
    x_terms = _Site.at(r, group_name, numerics, x.device, defer=False).split(x, r.input, "input", r.compensated)
    T, R = len(x_terms), x.shape[0]
    ints = x_terms[0].ints.unsqueeze(1) if T == 1 else torch.stack([t.ints for t in x_terms], 1)  # (R, T, K)
    sums = x.new_empty(R, T, weights[0].shape[0], dtype=torch.float64)
    w_exp, w_scale, units, start = [], [], set(), 0
    for w, n, name in zip(weights, counts, names):
        if not n:
            continue
        site = _Site.at(r, name, numerics, x.device, defer=False)
        w_split = _cached_weight(site, w, True, lambda at, w=w: at.split(w.reshape(-1, w.shape[-1]), r.weight, "weight",
                                                                         False)[0])
        bounds = [pair_bound(t, w_split) for t in x_terms]
        bound = None if None in bounds else max(bounds)
        exact_sum_products(ints[start:start + n].reshape(n * T, -1), w_split.ints, CHUNK,
                           w_split.abs_max() if bound is None and w_split.ints.numel() else None, bound,
                           out=sums[start:start + n].view(n * T, -1))
        units.add(w_split.unit)
        w_exp.append(w_split.exp.expand(n, -1))
        if w_split.scale is not None:  # a per-tensor scale (stride 0) broadcasts as one column
            ws = w_split.scale_f64()
            w_scale.append((ws[:1] if ws.stride(0) == 0 else ws).expand(n, -1))
        start += n
    scale = torch.cat(w_scale) if w_scale else None
    exp = units.pop() if len(units) == 1 and None not in units else torch.cat(w_exp)
    return exact_fp4_terms(x_terms, sums.unbind(1), exp, scale, None, x.dtype)


def can_share_input(recipe: Recipe, x: torch.Tensor, weight: torch.Tensor, numerics: Numerics = STANDARD) -> bool:
    """Whether `shared_input_linear` gives the per-shard bits: FP4 modes, nearest rounding (no
    stochastic stream keyed by the shard's name), no autograd, eager non-finite checks, rows."""
    if recipe.mode not in ("fp4", "fp4_resq") or x.numel() == 0:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    if numerics.position.nonfinite_flags_for(x.device) is not None:
        return False
    return recipe.input.rounding == "nearest" and recipe.weight.rounding == "nearest"


def _cat_splits(parts: Sequence[Split]) -> Split:
    """The row-wise concatenation of weight splits (rows are independent)."""
    scale = None if parts[0].scale is None else torch.cat([p.scale for p in parts])
    units = {p.unit for p in parts}
    return Split(torch.cat([p.ints for p in parts]), torch.cat([p.exp for p in parts]), scale,
                 torch.cat([p.deq for p in parts]), max(p.bound for p in parts) if None not in
                 {p.bound for p in parts} else None, units.pop() if len(units) == 1 else None)


@_no_autocast
def shared_input_linear(x: torch.Tensor, weight: torch.Tensor, bias, shards: Sequence[int], names: Sequence[str],
                        recipe: Recipe, group_name: str, numerics: Numerics = STANDARD) -> torch.Tensor:
    """``x · weight.T (+ bias)``, ``weight`` the row-wise concatenation of ``shards`` logical weights
    named ``names``: the bits of ``cat([moeresq_linear(x, w_i, b_i, recipe=recipe, name=names[i])])``
    where `can_share_input` holds, with ``Q̃(x)`` once (``group_name`` names it in errors)."""
    r = recipe
    x2 = x.reshape(-1, x.shape[-1])
    weights = weight.split(list(shards), 0)
    sites = [_Site.at(r, n, numerics, x.device, defer=False) for n in names]
    shared = _Site.at(r, group_name, numerics, x.device, defer=False)
    if invariant.exact(numerics):
        x_terms = shared.split(x2, r.input, "input", r.compensated)

        def concatenated():  # each shard quantized as its own tensor (its own per-tensor scale)
            return _cat_splits([site.split(w.reshape(-1, w.shape[-1]), r.weight, "weight", False)[0]
                                for site, w in zip(sites, weights)])
        w_split = cached_for_weight(numerics.weight_cache, weight, ("shards", r.weight, tuple(shards)), concatenated)
        b = None if bias is None else bias.detach()
        return exact_fp4_gemm(x_terms, w_split, b, x.dtype).reshape(*x.shape[:-1], weight.shape[0])
    xq = shared.quantize(x2, r.input, "input", r.compensated)
    biases = [None] * len(weights) if bias is None else bias.detach().to(_accumulate_dtype(x.dtype)).split(list(shards))
    outs, tile = [], numerics.triton if invariant.tiled(numerics, x) else None
    for site, w, b in zip(sites, weights, biases):
        wq = _cached_weight(site, w, False, lambda at, w=w: at.quantize(w, r.weight, "weight", compensated=False))
        outs.append(_gemm(xq, wq, b, (*x.shape[:-1], w.shape[0]), x.dtype, tile, numerics.weight_packs()))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
