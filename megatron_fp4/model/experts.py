"""Grouped SwiGLU experts with stacked weights, each expert GEMM the MoEResQ linear of a `Recipe`.

A `GroupedExperts` holds a contiguous block of the model's experts, given at construction
(``expert_offset``, ``num_local_experts``): a single process holds them all; expert parallelism
builds each rank's block with these arguments (`shard`). The module knows no process group.

Public compute API (what dispatchers may call): ``experts(tokens, counts, segments=None)`` on
tokens grouped by local expert, ``experts.expert(e, tokens)`` for one local expert, and
``experts.parameters()``. Split from `model/moe.py`, which re-exports these names.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_fp4.fp4 import STANDARD, Numerics, Recipe, invariant, moeresq_linear, resq_quantize
from megatron_fp4.fp4.exact_experts import can_group_exact_fp4, exact_grouped_fp4
from megatron_fp4.fp4.exact_gemm import cached_for_weight
from megatron_fp4.fp4.moeresq_grouped import can_group_resq, grouped_moeresq_linear
from megatron_fp4.fp4.recipe import row_local
from megatron_fp4.fp4 import triton_batch
from megatron_fp4.fp4.tiled import tiled_grouped_mlp


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts with stacked weights: w13 [E, 2F, H] (gate rows, then up rows)
    and w2 [E, H, F]. Each expert GEMM is the MoEResQ linear with `recipe`.

    `forward` takes the experts' weights as `unbind` views: backward then writes every expert's
    gradient into one stacked buffer per weight. Indexing `w13[e]` per expert (`expert_forward`'s
    default) would make each expert's backward allocate a zeroed full-size [E, ...] gradient that
    autograd then sums: the same values, E times the memory traffic.

    With FP4 off, outside the batch-invariant mode, the experts run as two grouped GEMMs over all
    local experts (`grouped_forward`, `can_group`) instead of the loop: per expert the same GEMM on
    the same rows, one kernel launch and no Python loop. Its SiLU runs over all rows at once, and
    ATen's SiLU rounds its vector tail differently from its body, so the result equals the loop's
    within fp32 rounding (the same bits where the kernels do; `grouped = False` forces the loop).

    FP4 experts under autograd run `grouped_resq_forward`: each MoEResQ linear over all experts as
    one grouped call (`fp4.moeresq_grouped`: forward, dgrad and wgrad each one node for all experts,
    `segments` kept) and the SwiGLU per expert slice, with per expert the loop's bits.
    """

    numerics = STANDARD  # the model's (`fp4.apply_numerics`), passed to every FP4 / invariant op
    grouped = True  # one grouped GEMM over all experts where `can_group` allows; False: the loop
    # FP4 off: above this many rows per expert on average the loop is as fast (its per-expert SiLU
    # and products stay in cache; bench_moe_grouped.py: 0.9x at 8 experts x 256 rows, 1.3-1.5x at 64-128)
    max_group_rows = 128

    def __init__(self, num_experts: int, hidden: int, ffn: int, recipe: Recipe, *, expert_offset: int = 0,
                 num_local_experts: Optional[int] = None):
        """`num_experts`: the model's experts; this module holds ``num_local_experts`` of them (default:
        all), global ids ``[expert_offset, expert_offset + num_local_experts)``, as the rows of w13/w2."""
        super().__init__()
        local = num_experts - expert_offset if num_local_experts is None else num_local_experts
        if not (0 <= expert_offset and local >= 1 and expert_offset + local <= num_experts):
            raise ValueError(f"GroupedExperts: experts [{expert_offset}, {expert_offset + local}) are not a "
                             f"non-empty block of the model's {num_experts} experts")
        self.num_global_experts, self.expert_offset, self.num_local_experts = num_experts, expert_offset, local
        self.hidden, self.ffn = hidden, ffn
        self.recipe = recipe
        self.w13 = nn.Parameter(torch.empty(local, 2 * ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(local, hidden, ffn))
        self.quant_name = ""  # global module name (fp4 `name_quant_sites`); keys SR streams per expert
        # Expert-tensor parallel (`parallel/moe/expert_tensor_parallel.py`): the FP4 cuts of w13 (column)
        # and w2 (row) and the object that brings every etp rank's rows in and the outputs back out.
        self.w13_cut = self.w2_cut = None
        self.token_exchange = None

    @property
    def num_experts(self) -> int:
        """Experts this module holds (the stacked weights' first dim): `num_local_experts`."""
        return self.num_local_experts

    def shard(self, expert_offset: int, num_local_experts: int) -> "GroupedExperts":
        """A new module holding experts ``[expert_offset, expert_offset + num_local_experts)`` of this
        one's (global ids), built through the constructor, on this module's device and dtype, with
        those rows of w13/w2 copied (nothing copied on the meta device: the model's per-expert init
        later gives the shard the same bits) and the same `requires_grad` and `quant_name`."""
        lo = expert_offset - self.expert_offset
        if not (0 <= lo and lo + num_local_experts <= self.num_local_experts):
            held = f"[{self.expert_offset}, {self.expert_offset + self.num_local_experts})"
            raise ValueError(f"GroupedExperts.shard: experts [{expert_offset}, {expert_offset + num_local_experts}) "
                             f"are not held here ({held})")
        with torch.device(self.w13.device):  # type(self): a family's experts (gpt_oss.py) shard as themselves
            out = type(self)(self.num_global_experts, self.hidden, self.ffn, self.recipe,
                             expert_offset=expert_offset, num_local_experts=num_local_experts).to(self.w13.dtype)
        if not self.w13.is_meta:
            with torch.no_grad():
                out.w13.copy_(self.w13[lo:lo + num_local_experts])
                out.w2.copy_(self.w2[lo:lo + num_local_experts])
        out.w13.requires_grad_(self.w13.requires_grad)
        out.w2.requires_grad_(self.w2.requires_grad)
        out.quant_name = self.quant_name  # fp4 SR streams are keyed by the global name + expert id
        out.numerics = self.numerics  # the model's fp4.Numerics
        return out

    def shard_ffn(self, parts: int, index: int, *, shapes_only: bool = False) -> "GroupedExperts":
        """A new module holding slice `index` of `parts` of every expert's ffn dim (expert-tensor
        parallel): gate and up rows ``[index·F/parts, (index+1)·F/parts)`` of w13 (column cut), those
        columns of w2 (row cut); parameters keep their attributes and remember the slice
        (``etp_shard = (dim, index)`` of the stacked tensor). The FP4 cuts are the caller's.
        ``shapes_only``: a meta model's cut (the memory planner: shapes, no values)."""
        f = self.ffn // parts
        if f * parts != self.ffn or not 0 <= index < parts:
            raise ValueError(f"GroupedExperts.shard_ffn: ffn={self.ffn} does not split into {parts} parts "
                             f"(model.moe_ffn_hidden_size must be a multiple of parallel.etp), or index {index}")
        if self.w13.is_meta and not shapes_only:  # the per-expert init draws whole matrices: cut materialised weights
            raise ValueError("GroupedExperts.shard_ffn: the experts are still on the meta device; materialise the "
                             "model (model.materialize) before cutting it for expert-tensor parallel")
        cols = torch.arange(index * f, (index + 1) * f)
        rows = torch.cat([cols, cols + self.ffn])
        with torch.device(self.w13.device):
            out = GroupedExperts(self.num_global_experts, self.hidden, f, self.recipe, expert_offset=self.expert_offset,
                                 num_local_experts=self.num_local_experts).to(self.w13.dtype)
        for name, dim, index_ in (("w13", 1, rows), ("w2", 2, cols)):
            old, new = getattr(self, name), getattr(out, name)
            with torch.no_grad():
                new.copy_(old.index_select(dim, index_.to(old.device)))
            new.requires_grad_(old.requires_grad)
            new.__dict__.update(old.__dict__)
            new.etp_shard = (dim, index_)
        out.quant_name, out.numerics = self.quant_name, self.numerics
        return out

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Public: local expert `e` (global id ``expert_offset + e``) on its tokens `x` [n, H]."""
        if self.token_exchange is not None:
            raise ValueError("expert-tensor parallel experts run all local experts at once (their rows are "
                             "exchanged over the etp group): GC-MoE's per-expert calls are not supported, use "
                             "parallel.expert_dispatcher=alltoall")
        return self.expert_forward(e, x)

    def expert_forward(self, e: int, x: torch.Tensor, w13: Optional[torch.Tensor] = None,
                       w2: Optional[torch.Tensor] = None, segments: Optional[list[int]] = None) -> torch.Tensor:
        """Expert `e` on its tokens `x`; `w13`/`w2`: its weights as views (default `self.w13[e]`, ...);
        `segments`: row counts of `x`'s runs from distinct micro-batches (see `forward`)."""
        name = f"{self.quant_name}.{self.expert_offset + e}"  # global expert id
        w13 = self.w13[e] if w13 is None else w13
        w2 = self.w2[e] if w2 is None else w2
        nx = self.numerics
        h = moeresq_linear(x, w13, recipe=self.recipe, name=name + ".w13", segments=segments, numerics=nx,
                           cut=self.w13_cut)
        gate, up = h.split(self.ffn, dim=-1)
        return moeresq_linear(invariant.silu(gate, nx) * up, w2, recipe=self.recipe, name=name + ".w2",
                              segments=segments, numerics=nx, cut=self.w2_cut)

    def forward(self, x_sorted: torch.Tensor, counts: list[int],
                segments: Optional[list[list[int]]] = None) -> torch.Tensor:
        """x_sorted [N, H]: tokens grouped by local expert, `counts[e]` rows for expert e.

        `segments[e]` (expert parallelism: rows from each source rank, i.e. each source's
        micro-batch) splits expert e's rows into consecutive runs whose FP4 weight gradient is
        quantized run by run (`moeresq_linear(segments=)`), so it equals the sum of the
        single process's per-micro-batch wgrads. Forward values do not depend on it. Under
        expert-tensor parallel (`token_exchange`) every etp rank's rows are computed together."""
        if self.token_exchange is not None:
            return self.token_exchange.run(self._forward_local, x_sorted, counts, segments)
        return self._forward_local(x_sorted, counts, segments)

    def _forward_local(self, x_sorted: torch.Tensor, counts: list[int],
                       segments: Optional[list[list[int]]] = None) -> torch.Tensor:
        assert len(counts) == self.num_experts and sum(counts) == x_sorted.shape[0]
        if segments is not None and (len(segments) != self.num_experts
                                     or any(sum(s) != n for s, n in zip(segments, counts))):
            raise ValueError(f"GroupedExperts: segments={segments} must hold, per local expert, row counts "
                             f"summing to that expert's count in counts={counts}")
        if self.grouped and x_sorted.shape[0]:
            nx = self.numerics
            if can_group(self.recipe, x_sorted, nx) and x_sorted.shape[0] <= self.max_group_rows * self.num_experts:
                return self.grouped_forward(x_sorted, counts)
            whole = self.w13_cut is None and self.w2_cut is None  # a cut's amax reductions: the paths below
            if whole and can_group_fp4(self.recipe, x_sorted, (self.w13, self.w2), nx):
                return self.grouped_fp4_forward(x_sorted, counts)
            if whole and can_group_exact(self.recipe, x_sorted, (self.w13, self.w2), nx):
                return self.grouped_exact_forward(x_sorted, counts)
            if can_group_resq(self.recipe, x_sorted, nx):
                return self.grouped_resq_forward(x_sorted, counts, segments)
            if whole and self.recipe.mode == "bf16" and invariant.tiled(nx, x_sorted) \
                    and not torch.is_autocast_enabled(x_sorted.device.type):
                return self.grouped_tiled_forward(x_sorted, counts)
        w13s, w2s = self.w13.unbind(0), self.w2.unbind(0)
        segs = segments or [None] * self.num_experts
        outs = [self.expert_forward(e, chunk, w13s[e], w2s[e], segs[e])
                for e, chunk in enumerate(x_sorted.split(counts)) if chunk.shape[0]]
        if not outs:  # no tokens at all: keep the graph connected so backward still visits the params
            return x_sorted.new_zeros(0, self.hidden) + 0 * (self.w13.sum() + self.w2.sum())
        return torch.cat(outs, dim=0)

    def grouped_forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """All experts in two grouped GEMMs (`F.grouped_mm`: per group the GEMM the loop runs, on
        the same rows) and one SiLU over every row; FP-off mode only (see `can_group`)."""
        offs = torch.tensor(counts, device=x_sorted.device).cumsum(0).to(torch.int32)
        h = _grouped_linear(x_sorted, self.w13, offs)
        gate, up = h.split(self.ffn, dim=-1)
        return _grouped_linear(invariant.silu(gate, self.numerics) * up, self.w2, offs)

    def grouped_tiled_forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """FP4 off at the ``batch`` level with autograd: each expert's rows in fixed row tiles (the
        bits of the no-grad `grouped_exact_forward`, which tiles the same runs), one SiLU over all
        rows (position-independent bits; its backward `swiglu`'s one pass per half), the backward
        one GEMM per expert and gradient."""
        t, packs = self.numerics.triton, self.numerics.weight_packs()  # the Triton kernel where it serves, else tiled.py's
        h = triton_batch.grouped_linear(x_sorted, self.w13, counts, t, packs)
        return triton_batch.grouped_linear(swiglu(h, self.ffn, self.numerics), self.w2, counts, t, packs)

    def grouped_exact_forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The batch-invariant mode without autograd (`can_group_exact`): the loop's exact GEMMs with
        the input's limbs (FP4 off, `invariant.grouped_linear`) or FP4 codes (`exact_grouped_fp4`),
        the SiLU and the combination done once for all rows (a row's bits depend on that row and
        its expert alone)."""
        nx = self.numerics
        if self.recipe.mode == "bf16" and invariant.tiled(nx, x_sorted) \
                and not triton_batch.serves(nx.triton, x_sorted, self.w13):
            # both GEMMs in one padded row layout (`tiled_grouped_mlp`). Not under autograd
            # (`grouped_tiled_forward`): its saved tensors would hold the padding rows, which depend
            # on the routing, where the activation plan counts the routed rows alone.
            return tiled_grouped_mlp(x_sorted, self.w13, self.w2, counts, lambda h: swiglu(h, self.ffn, nx),
                                     nx.weight_packs())
        w13s, w2s = self.w13.unbind(0), self.w2.unbind(0)  # the per-expert paths' weights
        if self.recipe.mode == "bf16":
            gate, up = invariant.grouped_linear(x_sorted, w13s, counts, nx).split(self.ffn, dim=-1)
            return invariant.grouped_linear(invariant.silu(gate, nx) * up, w2s, counts, nx)
        first = self.expert_offset
        names = [f"{self.quant_name}.{first + e}" for e in range(self.num_experts)]
        gate, up = exact_grouped_fp4(x_sorted, w13s, counts, self.recipe, [n + ".w13" for n in names],
                                     f"{self.quant_name}.<grouped>.w13", nx).split(self.ffn, dim=-1)
        return exact_grouped_fp4(invariant.silu(gate, nx) * up, w2s, counts, self.recipe, [n + ".w2" for n in names],
                                 f"{self.quant_name}.<grouped>.w2", nx)

    def grouped_resq_forward(self, x_sorted: torch.Tensor, counts: list[int],
                             segments: Optional[list[list[int]]] = None) -> torch.Tensor:
        """The loop's bits (see `moeresq_grouped`) with each MoEResQ linear one grouped call; the
        SwiGLU runs per expert slice (ATen's SiLU rounds a tensor's vector tail unlike its body, so
        one SiLU over all rows would change bits), `split` keeping the backward one gather."""
        first = self.expert_offset
        names = [f"{self.quant_name}.{first + e}" for e in range(self.num_experts)]

        def linear(x, weight, which):
            return grouped_moeresq_linear(x, weight, counts, recipe=self.recipe, names=[n + which for n in names],
                                          name=f"{self.quant_name}.<grouped>{which}", segments=segments,
                                          numerics=self.numerics, cut=self.w13_cut if which == ".w13" else self.w2_cut)

        h = linear(x_sorted, self.w13, ".w13")
        acts = []
        for chunk in h.split(counts):
            if chunk.shape[0]:
                gate, up = chunk.split(self.ffn, dim=-1)
                acts.append(invariant.silu(gate, self.numerics) * up)
        return linear(torch.cat(acts, dim=0), self.w2, ".w2")

    def grouped_fp4_forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """FP4 experts without autograd (`can_group_fp4`): MoEResQ's forward ``Q̃(X)·Q(W)ᵀ`` in
        fp32 with ``Q̃`` applied once to all rows (each row quantizes alone: its codes do not depend
        on which expert's batch it is in) and each expert's ``Q(W)`` computed per expert as
        `moeresq_linear` does, stacked (once per weight version inside `Numerics.cached_weights`),
        then the per-expert GEMMs as one grouped GEMM."""
        offs = torch.tensor(counts, device=x_sorted.device).cumsum(0).to(torch.int32)
        h = self._fp4_grouped_linear(x_sorted, self.w13, offs, "w13")
        gate, up = h.split(self.ffn, dim=-1)
        return self._fp4_grouped_linear(invariant.silu(gate, self.numerics) * up, self.w2, offs, "w2")

    def stacked_qw(self, weight: torch.Tensor, which: str) -> torch.Tensor:
        """``Q(W_e)`` of every expert of ``weight`` (``self.w13`` / ``self.w2``, named ``which``)
        stacked [E, out, in] in fp32, each quantized as `moeresq_linear` does under its trainer name,
        once per weight version inside `Numerics.cached_weights` (also the vLLM plugin's standard path)."""
        r, nx, first = self.recipe, self.numerics, self.expert_offset
        return cached_for_weight(nx.weight_cache, weight, ("grouped Q(W)", r.weight), lambda: torch.stack([
            resq_quantize(w, r.weight, compensated=False, name=f"{self.quant_name}.{first + e}.{which}:weight",
                          compile=r.compile, triton=nx.triton, kernels=nx.kernels)
            for e, w in enumerate(weight.detach().unbind(0))]))

    def _fp4_grouped_linear(self, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, which: str):
        r, nx = self.recipe, self.numerics
        name = f"{self.quant_name}.<grouped>.{which}"
        xq = resq_quantize(x, r.input, r.compensated, name=f"{name}:input", compile=r.compile, triton=nx.triton,
                           kernels=nx.kernels)
        if invariant.tiled(nx, x):  # the batch level: each expert's rows in fixed row tiles
            counts = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
            return triton_batch.grouped_linear(xq, self.stacked_qw(weight, which), counts, nx.triton,
                                               nx.weight_packs()).to(x.dtype)
        return _GROUPED_MM(xq, self.stacked_qw(weight, which).transpose(1, 2), offs=offs).to(x.dtype)


def can_group_fp4(recipe: Recipe, x: torch.Tensor, weights, numerics: Numerics = STANDARD) -> bool:
    """Whether FP4 experts may run `GroupedExperts.grouped_fp4_forward`: no autograd (the backward's
    columnwise blocks run along each expert's tokens), outside the ``exact`` level (exact GEMMs; at
    the ``batch`` level each expert's GEMM runs over fixed row tiles instead of `grouped_mm`),
    nearest rounding (stochastic streams are keyed by expert), row-local input quantization (a
    row's codes do not depend on the other rows), eager non-finite checks, fp32/bf16 on CPU."""
    if recipe.mode not in ("fp4", "fp4_resq") or invariant.exact(numerics, x):
        return False
    if _GROUPED_MM is None and not invariant.tiled(numerics, x):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return False
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if torch.is_autocast_enabled(x.device.type) or numerics.position.nonfinite_flags_for(x.device) is not None:
        return False
    return row_local(recipe.input) and recipe.weight.rounding == "nearest"


def can_group_exact(recipe: Recipe, x: torch.Tensor, weights, numerics: Numerics = STANDARD) -> bool:
    """Whether experts at a row-invariant level may run `grouped_exact_forward`: no autograd (the
    loop carries the backward); FP4 only at the ``exact`` level, as `exact_experts.can_group_exact_fp4`
    says (FP4 at the ``batch`` level: `can_group_fp4`)."""
    if recipe.mode != "bf16":
        return can_group_exact_fp4(recipe, x, weights, numerics)
    if not invariant.enabled(numerics, x):  # bf16 at the batch level: `invariant.grouped_linear` tiles each run
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)))


_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def can_group(recipe: Recipe, x: torch.Tensor, numerics: Numerics = STANDARD) -> bool:
    """Whether `GroupedExperts` may run one grouped GEMM instead of its per-expert loop.

    Only with FP4 off (an FP4 expert is a MoEResQ linear whose stochastic-rounding stream is keyed
    by the expert), outside the batch-invariant mode (its per-row exact GEMM is `invariant.linear`,
    run per expert), where torch has a grouped GEMM for the dtype (fp32/bf16/fp16 on CPU, bf16 on
    CUDA; fp64, the verification mode, keeps the loop), and outside `torch.autocast`, which would
    lower the loop's `F.linear` but not `grouped_mm`."""
    if (_GROUPED_MM is None or recipe.mode != "bf16" or invariant.enabled(numerics, x)
            or torch.is_autocast_enabled(x.device.type)):
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return x.device.type == "cuda" and x.dtype == torch.bfloat16


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) · up`` of ``h = [gate | up]`` [N, 2F] (`invariant.silu`: the forward's bits are
    those of ``invariant.silu(gate) * up``). The backward writes both halves of dh straight into one
    [N, 2F] gradient (``dup = dy · silu(gate)``, ``dgate`` by ATen's fused ``silu_backward`` of
    ``dy · up``): autograd through the split, SiLU and product ran seven elementwise passes over
    [N, F] and a concatenation (issue 37). ``dgate`` is SiLU's derivative ``s·(1 + x·(1 − s))``
    (s = sigmoid(x), finite where exp(−x) overflows) times ``dy · up``, rounded in ATen's order."""

    @staticmethod
    def forward(ctx, h, ffn, numerics):
        gate, up = h.split(ffn, dim=-1)
        act = invariant.silu(gate, numerics)  # no autograd in here: `silu`'s own no-grad ops, the same bits
        ctx.save_for_backward(h, act)
        ctx.ffn = ffn
        return act * up

    @staticmethod
    def backward(ctx, dy):
        h, act = ctx.saved_tensors
        gate, up = h.split(ctx.ffn, dim=-1)
        dh = torch.empty_like(h)
        torch.mul(dy, act, out=dh[:, ctx.ffn:])
        torch.ops.aten.silu_backward.grad_input(dy * up, gate, grad_input=dh[:, :ctx.ffn])
        return dh, None, None


def swiglu(h: torch.Tensor, ffn: int, numerics: Numerics = STANDARD) -> torch.Tensor:
    """``invariant.silu(gate, numerics) * up`` of ``h = [gate | up]`` [N, 2·ffn] (its bits); under
    autograd with `_SwiGLU`'s backward (one pass per half of dh, no concatenation)."""
    if torch.is_grad_enabled() and h.requires_grad and h.dim() == 2:
        return _SwiGLU.apply(h, ffn, numerics)
    gate, up = h.split(ffn, dim=-1)
    return invariant.silu(gate, numerics) * up


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient dense: `grouped_mm`'s backward rejects an expanded
    (zero-stride) gradient such as `y.sum()` produces."""

    @staticmethod
    def forward(ctx, y):
        return y

    @staticmethod
    def backward(ctx, dy):
        return dy.contiguous()


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows offs[e-1]:offs[e] of x [N, in] times weight[e]ᵀ (weight [E, out, in]) -> [N, out]."""
    y = _GROUPED_MM(x, weight.transpose(1, 2), offs=offs)
    return _ContiguousGrad.apply(y) if y.requires_grad else y


