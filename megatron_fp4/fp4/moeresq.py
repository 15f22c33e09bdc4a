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
- ``segments`` (row counts of consecutive token runs, e.g. the rows an expert received from each
  expert-parallel source rank): wgrad becomes ``Σ_s Q̃_col(dY_s)ᵀ · Q̃_col(X_s)``, each run quantized
  along its own tokens (padded to the block on its own), as if each run were a call of its own; the
  sum is one GEMM over the runs' padded blocks side by side. Forward and dgrad quantize per row and
  ignore it. Under EP this makes an expert's wgrad the sum of the per-micro-batch wgrads of the
  single process (up to sum order), instead of mixing micro-batches in one block and one amax.
- ``recipe.grad_output`` formats ``dY`` (both directions); ``recipe.input`` formats ``X`` (both).
- Stochastic rounding: every operand draws from its own ``torch.Generator``, seeded by
  ``sr_seed(recipe.seed, layer, step, micro-batch, operand)`` (``context.py``) with operands
  ``weight``, ``input``, ``grad_output``, ``grad_output (columnwise)``, ``input (columnwise)``
  (each Q before its residual's Q on one stream; run ``i > 0`` of ``segments`` appends
  ``" segment i"`` to the columnwise names, so runs draw independent noise). ``layer`` is the module's global name
  (``quant_name``), step and micro-batch come from ``numerics.position`` captured in forward, so
  every layer, micro-batch and step draws fresh, reproducible noise.
- ``recipe.quantize_backward=False``: dgrad ``dY · Q(W)`` and wgrad ``dYᵀ · X`` in fp32
  (the straight-through gradient of the quantized forward).
- ``bf16`` mode is exactly ``F.linear(x, weight, bias)`` (``invariant.linear`` in the
  batch-invariant mode).
- ``batch`` level (``numerics.invariance``): the same fp32 GEMM over fixed row tiles
  (``tiled.py``): a row's bits depend on nothing but the row and ``W`` at one layout and build.
- ``exact`` level: the forward GEMM is formed exactly from
  the same quantized operands, ``Q(x)·Q(W)ᵀ`` and ``Q(x − Q(x))·Q(W)ᵀ`` as two exact sums with
  the global scales factored out, then rounded once (``exact_gemm.py`` states the bound). Its bits
  then depend on nothing but the row and ``W``. Backward is unchanged. Off (the default), the bits
  are the fp32-GEMM ones above.

Autograd layout (why three Functions): zero-bubble pipeline schedules run backward as an
input-grad pass (``torch.autograd.grad`` w.r.t. the stage inputs) and a later weight-grad pass
started from the node where the two paths meet. With one node holding both GEMMs each pass would
re-run its whole backward (dgrad and wgrad twice). Here ``_ForwardGemm`` (the forward GEMM) only hands
``dY`` to two halves, ``_DgradHalf`` (edge to ``x``; holds ``Q(W)``) and ``_WgradHalf`` (edges to
``weight``/``bias``; holds ``X``), so the input pass runs only dgrad and the weight pass only
wgrad, each once; a plain ``backward()`` runs both (``_dgrad``, ``_wgrad``, ``_bgrad``: the formulas
``tests/unit/test_fp4_split_backward.py`` writes out).
"""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatron_fp4.fp4 import invariant, triton_batch, triton_fp4
from megatron_fp4.fp4.context import sr_seed
from megatron_fp4.fp4.exact_gemm import cached_for_weight, exact_fp4_gemm, split_fp4
from megatron_fp4.fp4.nonfinite import FlagTee, NonFiniteFlags
from megatron_fp4.fp4.numerics import STANDARD, Numerics
from megatron_fp4.fp4.recipe import OperandFormat, Recipe
from megatron_fp4.fp4.tensor_cut import TensorCut
from megatron_fp4.fp4.resq import _fq32, _no_autocast, fake_quantize, portable_resq_quantize, sqnr_db  # noqa: F401


def resq_quantize(x: torch.Tensor, fmt: OperandFormat, compensated: bool = True, generator=None,
                  name: str = "x", nonfinite=None, compile: str | None = None, scratch: bool = False,
                  triton: str = "auto", amax_reduce=None, kernels=None) -> torch.Tensor:
    """``Q(x) + Q(x − Q(x))`` (or ``Q(x)`` when not compensated) in fp32: the Triton kernels where
    they serve under ``triton`` (``Numerics.triton``; CUDA: same bits, one pass), else the portable
    quantizer (`resq.portable_resq_quantize`, whose ``scratch`` and ``amax_reduce`` see; the
    kernels do not take a reduction). ``kernels``: the compiled kernels of the caller's numerics
    (``Numerics.kernels``; None: the process's)."""
    out = None if amax_reduce is not None else triton_fp4.dispatch(x, fmt, compensated, generator, name, nonfinite,
                                                                    mode=triton)
    if out is not None:
        return out
    return portable_resq_quantize(x, fmt, compensated, generator, name, nonfinite, compile, scratch, amax_reduce,
                                  kernels)


@dataclass(frozen=True)
class _Site:
    """One call of the linear: its layer name, recipe, training position and backend (captured in
    forward from the caller's ``Numerics``)."""

    recipe: Recipe
    layer: str
    step: int
    micro_batch: int
    nonfinite: Optional[NonFiniteFlags]
    segments: Optional[tuple] = None  # wgrad's token runs (≥ 2 non-empty), None: one run
    triton: str = "auto"  # Numerics.triton
    cache: Optional[dict] = field(default=None, compare=False)  # Numerics.weight_cache
    cut: Optional[TensorCut] = None  # a tensor-parallel slice of the linear (tensor_cut.py)
    kernels: object = field(default=None, compare=False)  # Numerics.kernels (fused.CompiledKernels)
    packs: Optional[dict] = field(default=None, compare=False)  # Numerics.weight_packs()

    @classmethod
    def at(cls, recipe: Recipe, layer: str, numerics: Numerics, device, segments=None, defer: bool = True,
           cut: Optional[TensorCut] = None) -> "_Site":
        """The site of a call now under ``numerics`` (``defer=False``: eager non-finite checks)."""
        now = numerics.position
        return cls(recipe, layer, now.step, now.micro_batch, now.nonfinite_flags_for(device) if defer else None,
                   segments, numerics.triton, numerics.weight_cache, cut, numerics.kernels,
                   numerics.weight_packs())

    def reducer(self, fmt: OperandFormat, operand: str):
        """The amax reduction of ``operand`` over a tensor-parallel cut (None: none needed)."""
        return None if self.cut is None else self.cut.reducer(fmt, operand)

    def _stream(self, a: torch.Tensor, fmt: OperandFormat, operand: str):
        """(generator, name) of one operand's quantization (no generator for nearest rounding)."""
        gen = None
        if fmt.rounding == "stochastic":
            seed = sr_seed(self.recipe.seed, self.layer, self.step, self.micro_batch, operand)
            gen = torch.Generator(device=a.device).manual_seed(seed)
        return gen, (f"{self.layer}:{operand}" if self.layer else operand)

    def quantize(self, a: torch.Tensor, fmt: OperandFormat, operand: str, compensated: bool,
                 scratch: bool = False) -> torch.Tensor:
        """Q̃ of one operand on its own stochastic-rounding stream (none for nearest rounding)."""
        gen, name = self._stream(a, fmt, operand)
        return resq_quantize(a, fmt, compensated, gen, name, self.nonfinite, self.recipe.compile, scratch, self.triton,
                             self.reducer(fmt, operand), self.kernels)

    def split(self, a: torch.Tensor, fmt: OperandFormat, operand: str, compensated: bool) -> list:
        """The terms of Q̃ as exact-GEMM splits (same codes and draws as :meth:`quantize`)."""
        gen, name = self._stream(a, fmt, operand)
        af = a.to(torch.float32)
        first = split_fp4(af, fmt, gen, name, self.nonfinite)
        if not compensated:
            return [first]
        return [first, split_fp4(af - first.deq, fmt, gen, name + " residual", self.nonfinite)]


def _col_quantize(site: _Site, a: torch.Tensor, fmt: OperandFormat, operand: str) -> torch.Tensor:
    """Q̃ of ``a`` (tokens, features) in blocks along tokens; returns (features, padded tokens),
    each of ``site.segments`` quantized alone and padded to the block on its own."""
    stream = operand + " (columnwise)"
    if site.segments is None:
        return _col_quantize_run(site, a, fmt, stream)
    runs = a.split(list(site.segments))
    return torch.cat([_col_quantize_run(site, run, fmt, stream + (f" segment {i}" if i else ""))
                      for i, run in enumerate(runs)], dim=1)


def _col_quantize_run(site: _Site, a: torch.Tensor, fmt: OperandFormat, stream: str) -> torch.Tensor:
    if site.reducer(fmt, stream) is None and triton_fp4.use_triton(a, site.triton):  # the kernel reads ``a`` transposed and zero-pads as it goes
        out = triton_fp4.dispatch(a, fmt, site.recipe.compensated, *site._stream(a, fmt, stream),
                                  site.nonfinite, columns=True, mode=site.triton)
        if out is not None:
            return out
    bs = fmt.block_size
    pad = (-a.shape[0]) % bs
    at = F.pad(a.t(), (0, pad)) if pad else a.t()
    at = at.contiguous()  # one transposing copy; strided x − Q(x) on a transposed view is ~10x slower
    own = at.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()  # a copy: may hold the residual
    return site.quantize(at, fmt, stream, site.recipe.compensated, scratch=own)


# -- the GEMMs of the three nodes below -----------------------------------------------------------------
def _cached_weight(site: _Site, weight: torch.Tensor, exact: bool, compute):
    """``compute(site)`` (``Q(W)``, or its exact-GEMM split when ``exact``), reused through the site's
    weight cache (``Numerics.cached_weights``). While non-finite flags are deferred, the entry keeps
    the flags its computation recorded and a hit records them again, so every micro-batch's flags
    see the weight as if it had been quantized again."""
    fmt = site.recipe.weight
    seed = sr_seed(site.recipe.seed, site.layer, site.step, site.micro_batch, "weight") \
        if fmt.rounding == "stochastic" else None
    if site.cut is not None:  # a slice's Q(W) depends on the group's amax too: keyed apart
        seed = (seed, site.cut)
    if site.nonfinite is None:
        return cached_for_weight(site.cache, weight, (fmt, exact, seed), lambda: compute(site))
    tee = FlagTee(site.nonfinite)
    value, seen = cached_for_weight(site.cache, weight, (fmt, exact, seed, "flags"),
                                    lambda: (compute(dataclasses.replace(site, nonfinite=tee)), tee.seen))
    if seen is not tee.seen:  # a hit: its flags again, into this call's flags
        for name, what, finite in seen:
            site.nonfinite.record(name, what, finite)
    return value


@_no_autocast
def _forward_operands(site: _Site, x2: torch.Tensor, weight: torch.Tensor):
    """(Q̃_row(X), Q(W)) in fp32."""
    r = site.recipe
    wq = _cached_weight(site, weight, False, lambda at: at.quantize(weight, r.weight, "weight", compensated=False))
    return site.quantize(x2, r.input, "input", r.compensated), wq


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """GEMM accumulation: fp32 (what FP4 tensor cores do), fp64 for fp64 inputs (the verification
    mode, where every op's rounding is ~1e-16 so layouts and batch shapes agree on any CPU).
    Quantizers always read their operand as fp32, as the formats define."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@_no_autocast
def _gemm(xq, wq, bias32, out_shape, out_dtype, tile: Optional[str] = None,
          packs: Optional[dict] = None) -> torch.Tensor:
    """``Q̃(X)·Q(W)ᵀ (+ b)`` accumulated in fp32; ``tile``: over fixed row tiles (the ``batch`` level),
    the value the model's ``Numerics.triton`` (`triton_batch.linear`: the Triton kernel where it serves;
    ``packs``: ``Numerics.weight_packs()``)."""
    acc = _accumulate_dtype(out_dtype)
    bias = None if bias32 is None else bias32.to(acc)
    if tile is None:
        return F.linear(xq.to(acc), wq.to(acc), bias).to(out_dtype).reshape(out_shape)
    return triton_batch.linear(xq.to(acc), wq.to(acc), bias, tile, packs).to(out_dtype).reshape(out_shape)


def _rows32(dy: torch.Tensor) -> torch.Tensor:
    """dY as rows in its accumulation dtype (fp32; fp64 in the verification mode)."""
    return dy.reshape(-1, dy.shape[-1]).to(_accumulate_dtype(dy.dtype))


@_no_autocast
def _dgrad(site: _Site, dy: torch.Tensor, wq: torch.Tensor, x_shape, x_dtype) -> torch.Tensor:
    """dX = Q̃_row(dY) · Q(W) (dY · Q(W) without backward quantization)."""
    dy2 = _rows32(dy)
    if site.recipe.quantize_backward:  # a converted dY is this function's own buffer: it may hold the residual
        own = dy2.untyped_storage().data_ptr() != dy.untyped_storage().data_ptr()
        dy2 = site.quantize(dy2, site.recipe.grad_output, "grad_output", site.recipe.compensated, scratch=own)
    acc = _accumulate_dtype(x_dtype)
    return (dy2.to(acc) @ wq.to(acc)).to(x_dtype).reshape(x_shape)


@_no_autocast
def _wgrad(site: _Site, dy: torch.Tensor, x2: torch.Tensor, w_dtype) -> torch.Tensor:
    """dW = Q̃_col(dY)ᵀ · Q̃_col(X) (dYᵀ · X without backward quantization)."""
    dy2, r = _rows32(dy), site.recipe
    if not r.quantize_backward:
        return (dy2.t() @ x2.to(dy2.dtype)).to(w_dtype)
    dyt = _col_quantize(site, dy2, r.grad_output, "grad_output")
    xt = _col_quantize(site, x2, r.input, "input")
    return (dyt.to(dy2.dtype) @ xt.t().to(dy2.dtype)).to(w_dtype)


@_no_autocast
def _bgrad(dy: torch.Tensor, b_dtype) -> torch.Tensor:
    return _rows32(dy).sum(0).to(b_dtype)


def _link(out_shape, dtype, device) -> torch.Tensor:
    """A value-less carrier of dY's shape (zero strides: one element of storage)."""
    return torch.zeros((), dtype=dtype, device=device).expand(out_shape)


# -- split layout: the forward GEMM node and its dgrad / wgrad halves ---------------------------------
class _ForwardGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dgrad_link, wgrad_link, gemm):
        return gemm()

    @staticmethod
    def backward(ctx, dy):
        need_d, need_w = ctx.needs_input_grad[:2]
        return dy if need_d else None, dy if need_w else None, None


class _DgradHalf(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wq, site: _Site, out_shape):
        ctx.save_for_backward(wq)
        ctx.site, ctx.x_meta = site, (x.shape, x.dtype)
        return _link(out_shape, x.dtype, x.device)

    @staticmethod
    def backward(ctx, dy):
        (wq,) = ctx.saved_tensors
        return _dgrad(ctx.site, dy, wq, *ctx.x_meta), None, None, None


class _WgradHalf(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, bias, x2, site: _Site, out_shape, out_dtype):
        ctx.save_for_backward(x2)
        ctx.site, ctx.dtypes = site, (weight.dtype, None if bias is None else bias.dtype)
        return _link(out_shape, out_dtype, x2.device)

    @staticmethod
    def backward(ctx, dy):
        (x2,) = ctx.saved_tensors
        need_dw, need_db = ctx.needs_input_grad[:2]
        w_dtype, b_dtype = ctx.dtypes
        dw = _wgrad(ctx.site, dy, x2, w_dtype) if need_dw else None
        db = _bgrad(dy, b_dtype) if need_db and b_dtype is not None else None
        return dw, db, None, None, None, None


def _runs(segments, rows: int) -> tuple | None:
    """``segments`` checked against the row count; None unless ≥ 2 runs are non-empty."""
    if segments is None:
        return None
    runs = [int(n) for n in segments]
    if any(n < 0 for n in runs) or sum(runs) != rows:
        raise ValueError(f"moeresq_linear: segments={runs} must be non-negative row counts summing to the "
                         f"input's {rows} rows (one count per consecutive run of rows)")
    runs = tuple(n for n in runs if n)
    return runs if len(runs) > 1 else None


def moeresq_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   recipe: Recipe, name: str = "", segments: Sequence[int] | None = None,
                   numerics: Numerics = STANDARD, cut: Optional[TensorCut] = None) -> torch.Tensor:
    """``x`` (…, in) · ``weight`` (out, in)ᵀ under ``recipe`` (see the module docstring).

    ``name``: the layer's global name, which keys its stochastic-rounding streams and names it in
    non-finite errors (unnamed layers share streams). ``segments``: row counts of consecutive runs
    of ``x``'s rows (summing to the row count) whose FP4 wgrad operands are quantized run by run;
    None (or one non-empty run) is the plain call. ``numerics``: the caller's (the module's) value:
    batch invariance, backend, weight cache, the step position that keys SR streams. ``cut``: how
    tensor parallelism cut this linear (``tensor_cut.py``; None: whole)."""
    if not isinstance(recipe, Recipe):
        raise ValueError(f"moeresq_linear: recipe must be a Recipe, got {type(recipe).__name__}")
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"moeresq_linear: input last dim {x.shape[-1]} != weight in_features {weight.shape[-1]}")
    runs = _runs(segments, math.prod(x.shape[:-1]))
    if recipe.mode == "bf16":
        return invariant.linear(x, weight, bias, numerics)
    if x.numel() == 0:  # no rows (an expert that received no tokens): nothing to quantize, zero grads
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    if cut is not None and invariant.exact(numerics, x):
        raise ValueError(f"moeresq_linear {name!r}: the batch-invariant exact FP4 GEMM on a tensor-parallel slice "
                         "is not supported (its partial sums are rounded before the group adds them)")
    site = _Site.at(recipe, name, numerics, x.device, runs, cut=cut)
    out_shape = (*x.shape[:-1], weight.shape[0])
    x2 = x.reshape(-1, x.shape[-1])
    bias32 = None if bias is None else bias.detach().to(_accumulate_dtype(x.dtype))
    with torch.no_grad():
        if invariant.exact(numerics):
            r = recipe
            x_terms = site.split(x2, r.input, "input", r.compensated)
            w_split = _cached_weight(site, weight, True, lambda at: at.split(
                weight.reshape(-1, weight.shape[-1]), r.weight, "weight", False)[0])
            wq = w_split.deq.reshape(weight.shape)
            b = None if bias is None else bias.detach()

            def gemm():
                return exact_fp4_gemm(x_terms, w_split, b, x.dtype).reshape(out_shape)
        else:
            xq, wq = _forward_operands(site, x2, weight)

            tile = numerics.triton if invariant.tiled(numerics, x) else None

            def gemm():
                return _gemm(xq, wq, bias32, out_shape, x.dtype, tile, site.packs)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))):
        return gemm()
    dgrad_link = _DgradHalf.apply(x, wq, site, out_shape)
    wgrad_link = _WgradHalf.apply(weight, bias, x2.detach(), site, out_shape, x.dtype)
    return _ForwardGemm.apply(dgrad_link, wgrad_link, gemm)


class MoEResQLinear(nn.Module):
    """A linear layer computed by :func:`moeresq_linear`; assign ``recipe`` to switch modes.
    ``numerics``: its own by default; a model gives all its modules one (``apply_numerics``)."""

    def __init__(self, in_features, out_features, bias=False, *, recipe: Recipe | None = None, dtype=None,
                 device=None, numerics: Numerics | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.recipe = recipe or Recipe()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.quant_name = ""  # global module name, set by `name_quant_sites` on the full model
        self.numerics = Numerics() if numerics is None else numerics
        self.tp_cut: Optional[TensorCut] = None  # set by tensor parallelism when it cuts this linear

    def forward(self, x):
        return moeresq_linear(x, self.weight, self.bias, recipe=self.recipe, name=self.quant_name,
                              numerics=self.numerics, cut=self.tp_cut)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, mode={self.recipe.mode}")
