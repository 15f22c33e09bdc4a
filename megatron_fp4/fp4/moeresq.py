"""PLACEHOLDER (being replaced by the FP4 work): interface of the MoEResQ linear."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_fp4.fp4.recipe import OperandFormat, Recipe


def fake_quantize(x: torch.Tensor, fmt: OperandFormat) -> torch.Tensor:
    raise NotImplementedError


def sqnr_db(x: torch.Tensor, fmt: OperandFormat) -> float:
    raise NotImplementedError


def moeresq_linear(x, weight, bias=None, *, recipe: Recipe):
    if recipe.mode == "bf16":
        return F.linear(x, weight, bias)
    raise NotImplementedError


class MoEResQLinear(nn.Module):
    def __init__(self, in_features, out_features, bias=False, *, recipe: Recipe | None = None, dtype=None, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.recipe = recipe or Recipe()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x):
        return moeresq_linear(x, self.weight, self.bias, recipe=self.recipe)
