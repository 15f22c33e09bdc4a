"""The MoEResQ linear: FP4 GEMM operands with a quantized-residual compensation.

Notation: ``Q`` is quantize-then-dequantize in the operand's format (fp32 result), and
``Q̃(A) = Q(A) + Q(A − Q(A))`` in ``fp4_resq`` mode, ``Q̃(A) = Q(A)`` in ``fp4`` mode. With
``X`` the input flattened to (tokens, in), ``W`` (out, in), ``dY`` (tokens, out), the GEMMs are
(all fp32, results cast back to the input's / weight's dtype):

    forward   Y  = Q̃_row(X) · Q(W)ᵀ                  (+ bias)
    dgrad     dX = Q̃_row(dY) · Q(W)
    wgrad     dW = Q̃_col(dY)ᵀ · Q̃_col(X)
    bias      db = Σ_tokens dY                           (unquantized)

- ``Q(W)`` uses ``recipe.weight`` (default NVFP4 16×16 tiles, per-tensor scale, so ``Q(W)`` and
  ``Q(W)ᵀ`` are the same numbers). It is computed once in forward and saved; dgrad reuses it.
- The forward is written with one GEMM on ``Q(x) + Q(x − Q(x))`` (the sum formed in fp32); it
  equals ``Q(x)·Q(W)ᵀ + Q(x − Q(x))·Q(W)ᵀ`` up to fp32 rounding of the operand sum, which a GPU
  kernel running two FP4 GEMMs reproduces to its accumulation order.
- ``_row``: blocks run along the GEMM's contraction dim = the tensor's last dim (input features
  for ``X``, output features for ``dY``). With ``scale='row'`` a token quantizes to the same bits
  alone or in any batch, so the *forward* is batch invariant in its quantization.
- ``_col`` (wgrad contracts over tokens): like Transformer Engine's "columnwise" data, ``dY`` and
  ``X`` are quantized transposed, i.e. in blocks of consecutive tokens, with the token dim
  zero-padded to the block size (zeros add nothing to the GEMM and do not change any amax). Its
  scales depend on the other tokens in the batch: wgrad is *not* batch invariant, by design.
- ``recipe.grad_output`` formats ``dY`` (both directions); ``recipe.input`` formats ``X`` (both).
  Stochastic rounding draws from one ``torch.Generator`` seeded with ``recipe.seed`` at each
  call, in a fixed order (forward: X; backward: dY row, dY col, X col; each Q before its
  residual's Q), so the same inputs and seed give the same bits. Callers fold the step and layer
  into ``recipe.seed`` when they want fresh noise.
- ``recipe.quantize_backward=False``: dgrad ``dY · Q(W)`` and wgrad ``dYᵀ · X`` in fp32
  (the straight-through gradient of the quantized forward).
- ``bf16`` mode is exactly ``F.linear(x, weight, bias)``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_fp4.fp4.mxfp4 import fake_quantize_mxfp4
from megatron_fp4.fp4.nvfp4 import fake_quantize_nvfp4
from megatron_fp4.fp4.recipe import OperandFormat, Recipe


def _fq32(x, fmt: OperandFormat, generator=None, name: str = "x") -> torch.Tensor:
    if fmt.format == "nvfp4":
        return fake_quantize_nvfp4(x, scale=fmt.scale, block=fmt.block, rounding=fmt.rounding,
                                   generator=generator, name=name, dtype=torch.float32)
    return fake_quantize_mxfp4(x, scale_mode=fmt.mx_scale_mode, rounding=fmt.rounding,
                               generator=generator, name=name, dtype=torch.float32)


def fake_quantize(x: torch.Tensor, fmt: OperandFormat, generator=None, name: str = "x") -> torch.Tensor:
    """Quantize-dequantize ``x`` in ``fmt``; returns ``x.dtype``."""
    return _fq32(x, fmt, generator, name).to(x.dtype)


def resq_quantize(x: torch.Tensor, fmt: OperandFormat, compensated: bool = True, generator=None,
                  name: str = "x") -> torch.Tensor:
    """``Q(x) + Q(x − Q(x))`` (or ``Q(x)`` when not compensated) in fp32."""
    xf = x.to(torch.float32)
    q = _fq32(xf, fmt, generator, name)
    if not compensated:
        return q
    return q + _fq32(xf - q, fmt, generator, name + " residual")


def sqnr_db(x: torch.Tensor, fmt: OperandFormat) -> float:
    """Signal-to-quantization-noise ratio of ``fake_quantize(x, fmt)`` in dB (float64 sums)."""
    xd = x.to(torch.float64)
    noise = (fake_quantize(x, fmt).to(torch.float64) - xd).pow(2).sum().item()
    signal = xd.pow(2).sum().item()
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise)


def _generator(recipe: Recipe, device, formats) -> torch.Generator | None:
    if not any(f.rounding == "stochastic" for f in formats):
        return None
    return torch.Generator(device=device).manual_seed(recipe.seed)


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """GEMM accumulation: fp32 (what FP4 tensor cores do), fp64 for fp64 inputs (the verification
    mode, where every op's rounding is ~1e-16 so layouts and batch shapes agree on any CPU)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _col_quantize(a: torch.Tensor, fmt: OperandFormat, compensated: bool, generator, name):
    """Q̃ of ``a`` (tokens, features) in blocks along tokens; returns (features, padded tokens)."""
    bs = fmt.block_size
    pad = (-a.shape[0]) % bs
    at = F.pad(a.t(), (0, pad)) if pad else a.t()
    at = at.contiguous()  # one transposing copy; strided x − Q(x) on a transposed view is ~10x slower
    return resq_quantize(at, fmt, compensated, generator, name + " (columnwise)")


class _MoEResQFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Recipe):
        x2 = x.reshape(-1, x.shape[-1])
        gen = _generator(recipe, x.device, (recipe.input, recipe.weight))
        wq = _fq32(weight, recipe.weight, gen, "weight")
        xq = resq_quantize(x2, recipe.input, recipe.compensated, gen, "input")
        acc = _accumulate_dtype(x.dtype)
        y = F.linear(xq.to(acc), wq.to(acc), None if bias is None else bias.to(acc))
        ctx.save_for_backward(x2, wq)
        ctx.recipe = recipe
        ctx.meta = (x.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, wq = ctx.saved_tensors
        recipe: Recipe = ctx.recipe
        x_shape, x_dtype, w_dtype, b_dtype = ctx.meta
        acc = _accumulate_dtype(dy.dtype)
        dy2 = dy.reshape(-1, dy.shape[-1]).to(acc)  # quantizers read it as fp32, as the formats define
        wq = wq.to(acc)
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx = dw = db = None
        if recipe.quantize_backward:
            comp = recipe.compensated
            gen = _generator(recipe, dy.device, (recipe.input, recipe.grad_output))
            if need_dx:
                dyq = resq_quantize(dy2, recipe.grad_output, comp, gen, "grad_output")
                dx = dyq.to(acc) @ wq
            if need_dw:
                dyt = _col_quantize(dy2, recipe.grad_output, comp, gen, "grad_output")
                xt = _col_quantize(x2, recipe.input, comp, gen, "input")
                dw = dyt.to(acc) @ xt.t().to(acc)
        else:
            if need_dx:
                dx = dy2 @ wq
            if need_dw:
                dw = dy2.t() @ x2.to(acc)
        if dx is not None:
            dx = dx.to(x_dtype).reshape(x_shape)
        if dw is not None:
            dw = dw.to(w_dtype)
        if need_db and b_dtype is not None:
            db = dy2.sum(0).to(b_dtype)
        return dx, dw, db, None


def moeresq_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   recipe: Recipe) -> torch.Tensor:
    """``x`` (…, in) · ``weight`` (out, in)ᵀ under ``recipe`` (see the module docstring)."""
    if not isinstance(recipe, Recipe):
        raise ValueError(f"moeresq_linear: recipe must be a Recipe, got {type(recipe).__name__}")
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"moeresq_linear: input last dim {x.shape[-1]} != weight in_features {weight.shape[-1]}")
    if recipe.mode == "bf16":
        return F.linear(x, weight, bias)
    return _MoEResQFunction.apply(x, weight, bias, recipe)


class MoEResQLinear(nn.Module):
    """A linear layer computed by :func:`moeresq_linear`; assign ``recipe`` to switch modes."""

    def __init__(self, in_features, out_features, bias=False, *, recipe: Recipe | None = None, dtype=None,
                 device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.recipe = recipe or Recipe()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x):
        return moeresq_linear(x, self.weight, self.bias, recipe=self.recipe)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, mode={self.recipe.mode}")
