"""The plugin's standard-kernel path (``batch_invariant: false``): fewer, larger calls per layer.

Outside the batch-invariant mode the plugin owes the trainer its FP4 MoEResQ numerics up to fp32
GEMM rounding, not its bits (those are the batch-invariant mode's promise, which keeps the
trainer's own modules, quant.py). The operands are the trainer's, computed by the same functions:
``Q(W)`` of every logical weight (each q/k/v shard, each expert) by `fp4.resq_quantize` under its
trainer name, cached once per weight version in the plugin's store (cleared by every weight load),
and ``Q̃(x) = Q(x) + Q(x − Q(x))`` of the activations (the compiled one-call ResQ where it serves).
What changes is how the GEMMs and the glue around them are issued:

- a fused linear (q/k/v, gate/up) is one GEMM over the row-wise concatenation of its shards'
  ``Q(W)`` (the quantization stays per shard, as the trainer's separate projections; only the GEMM
  is one): `standard_linear`;
- the routed experts (`StandardExperts`): ``Q̃`` of the T token rows before the gather (a row-local
  format quantizes a row alone, so these are the bits of quantizing the gathered rows), both expert
  GEMMs as one ``grouped_mm`` each over the stacked ``Q(W)``, and the combine as a weighted
  ``index_add_`` in ascending expert order per token (the trainer's summation order). No
  per-layer dispatcher objects, checks or Python lists: the expert offsets stay a tensor.

Each piece runs only where its preconditions hold (`linear_ok`, `experts_ok`); anything else
(autograd, deferred non-finite checks, stochastic rounding, a per-tensor input scale, another
device) takes the trainer's modules, as the batch-invariant mode always does.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_fp4.fp4 import Numerics, Recipe, invariant, resq_quantize
from megatron_fp4.fp4.exact_gemm import cached_for_weight
from megatron_fp4.fp4.recipe import row_local
from megatron_fp4.model.experts import _GROUPED_MM, GroupedExperts


def _plain(x: torch.Tensor, numerics: Numerics, *weights) -> bool:
    """No batch-invariant mode, no autograd, no deferred non-finite flags, a CPU fp32/bf16 input."""
    if invariant.enabled(numerics, x) or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return False
    return numerics.position.nonfinite_flags_for(x.device) is None and not torch.is_autocast_enabled("cpu")


def linear_ok(recipe: Recipe, x: torch.Tensor, weight: torch.Tensor, numerics: Numerics) -> bool:
    """Whether `standard_linear` serves: FP4 with nearest rounding (no stream keyed by a shard's
    name), or FP4 off; outside the batch-invariant mode (`_plain`)."""
    if not _plain(x, numerics, weight) or x.numel() == 0:
        return False
    return recipe.mode == "bf16" or (recipe.mode in ("fp4", "fp4_resq") and recipe.input.rounding == "nearest"
                                     and recipe.weight.rounding == "nearest")


def fused_qw(weight: torch.Tensor, shards, names, recipe: Recipe, numerics: Numerics) -> torch.Tensor:
    """The row-wise concatenation of each shard's ``Q(W)`` (fp32), each quantized as its own tensor
    under its trainer name, once per weight version (`Numerics.weight_cache`)."""
    r = recipe

    def compute():
        return torch.cat([resq_quantize(w, r.weight, compensated=False, name=f"{n}:weight", compile=r.compile,
                                        triton=numerics.triton)
                          for w, n in zip(weight.detach().split(list(shards), 0), names)])
    return cached_for_weight(numerics.weight_cache, weight, ("fused Q(W)", r.weight, tuple(shards)), compute)


def standard_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], shards, names,
                    recipe: Recipe, numerics: Numerics, group: str) -> torch.Tensor:
    """``x · weight.T (+ bias)`` with MoEResQ per shard and one GEMM (needs `linear_ok`)."""
    if recipe.mode == "bf16":
        return F.linear(x, weight, bias)
    r = recipe
    x2 = x.reshape(-1, x.shape[-1])
    xq = resq_quantize(x2, r.input, r.compensated, name=f"{group}:input", compile=r.compile, triton=numerics.triton)
    wq = fused_qw(weight, shards, names, recipe, numerics)
    b = None if bias is None else bias.detach().to(torch.float32)
    return F.linear(xq, wq, b).to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def experts_ok(experts: GroupedExperts, x: torch.Tensor) -> bool:
    """Whether `StandardExperts` serves: the trainer's own grouped FP4 condition (row-local input,
    nearest weight rounding, `grouped_mm` on CPU) outside the batch-invariant mode, whole experts."""
    r = experts.recipe
    if _GROUPED_MM is None or r.mode not in ("fp4", "fp4_resq") or not _plain(x, experts.numerics,
                                                                              experts.w13, experts.w2):
        return False
    if experts.w13_cut is not None or experts.w2_cut is not None or experts.token_exchange is not None:
        return False
    return row_local(r.input) and r.weight.rounding == "nearest" and x.shape[0] > 0


class StandardExperts:
    """The routed experts of one MoE layer on `GroupedExperts` ``experts``' weights."""

    def __init__(self, experts: GroupedExperts):
        self.experts = e = experts
        self.input_names = {w: f"{e.quant_name}.<grouped>.{w}:input" for w in ("w13", "w2")}

    def stacked_qw(self, which: str) -> torch.Tensor:
        """``Q(W_e)`` of every expert stacked and transposed for ``grouped_mm`` ([E, in, out] view):
        the trainer's own grouped ``Q(W)`` (`GroupedExperts.stacked_qw`, the same cache entry)."""
        return self.experts.stacked_qw(getattr(self.experts, which), which).transpose(1, 2)

    def _q(self, x: torch.Tensor, which: str) -> torch.Tensor:
        r = self.experts.recipe
        return resq_quantize(x, r.input, r.compensated, name=self.input_names[which], compile=r.compile,
                             triton=self.experts.numerics.triton)

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]: Σ_k w_k · expert_k(x), the terms added in ascending expert index."""
        e = self.experts
        T, k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # rows grouped by expert, a token's rows in ascending expert
        token = order.div(k, rounding_mode="floor")
        offs = torch.bincount(flat, minlength=e.num_experts).cumsum(0).to(torch.int32)
        xq = self._q(x, "w13")[token]  # row-local: quantizing the token rows is quantizing the gathered ones
        h = _GROUPED_MM(xq, self.stacked_qw("w13"), offs=offs).to(x.dtype)  # in the model dtype, as the trainer
        gate, up = h.split(e.ffn, dim=-1)
        y = _GROUPED_MM(self._q(F.silu(gate) * up, "w2"), self.stacked_qw("w2"), offs=offs).to(x.dtype)
        y = y.mul_(topk_w.reshape(-1)[order].to(y.dtype)[:, None])
        return y.new_zeros(T, y.shape[-1]).index_add_(0, token, y)
