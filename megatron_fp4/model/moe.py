"""The MoE feed-forward: an fp32 router, grouped SwiGLU experts in FP4 (MoEResQ), auxiliary losses.

Token movement is delegated to a *dispatcher* (`LocalDispatcher` here; `parallel/expert_parallel.py`
supplies the expert-parallel ones) so the model knows nothing about process groups. Every
dispatcher ends with `combine_expert_outputs`, which sums a token's k expert outputs in ascending
expert-index order — never arrival order — so all layouts give the same bits.
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
from megatron_fp4.model.layers import SwiGLU, upcast
from megatron_fp4.model.moe_balance import seq_balance_loss, update_expert_bias  # noqa: F401 (the trainer's hook)


class AuxLossAutoScaler(torch.autograd.Function):
    """Megatron's trick: return `output` unchanged, and in backward inject d(aux)/d(aux) = scale.

    The auxiliary loss then reaches the router gradients from whichever pipeline stage computed
    it, without being threaded through the stage outputs to the loss function.
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


class Router(nn.Module):
    """Top-k softmax router computed in fp32 (fp64 for an fp64 model) from an fp32 weight; never quantized.

    `expert_bias` (aux-loss-free balancing, DeepSeek-V3; only with ``expert_bias=True``): a per-expert
    buffer added to the probabilities for the top-k selection alone, updated outside the gradient
    (`update_expert_bias`); saved in checkpoints and published to the rollout with the weights."""

    zero_buffers = ("expert_bias",)  # `transformer.materialize` starts these at zero
    numerics = STANDARD  # the model's (`fp4.apply_numerics`)

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool, expert_bias: bool = False):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.register_buffer("expert_bias", torch.zeros(num_experts) if expert_bias else None)

    def forward(self, x: torch.Tensor, replay: Optional[torch.Tensor] = None):
        """x [T, H] -> (logits fp32 [T, E], probs fp32 [T, E], topk_idx [T, k], topk_w fp32 [T, k]).

        `replay` [T, k] (router replay, R2/R3): expert ids to use instead of the top-k; a row with a
        negative id routes live. The combine weights are the live probabilities gathered at the
        replayed ids (renormalized when `norm_topk_prob`), so the router still gets its gradient, as
        in Megatron-Core's `RouterReplay` (REPLAY_FORWARD: ``scores.gather(1, target_topk_idx)``).
        Replaying the ids the router picks itself gives the same bits as not replaying."""
        logits = router_logits(x, self.weight, self.numerics)
        return (logits, *route_from_logits(logits, self.top_k, self.norm_topk_prob, replay, self.expert_bias,
                                           self.numerics))


def router_logits(x: torch.Tensor, weight: torch.Tensor, numerics: Numerics = STANDARD) -> torch.Tensor:
    """The router's logits [T, E] in fp32 (fp64 for an fp64 model) from x [T, H] and weight [E, H]."""
    return invariant.linear(upcast(x), upcast(weight), None, numerics)


def route_from_logits(logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
                      replay: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                      numerics: Numerics = STANDARD):
    """(probs [T, E], topk_idx [T, k], topk_w [T, k]) of router logits: softmax, top-k (or the
    replayed ids, `replay_topk`), optional renormalisation (also what the vLLM plugin routes with,
    from the same logits). `bias` [E] (aux-loss-free balancing): the top-k of ``probs + bias``
    selects the experts; the combine weights are the unbiased probabilities there."""
    probs = invariant.softmax(logits, numerics)
    if bias is None:
        topk_w, topk_idx = torch.topk(probs, top_k, dim=-1)
    else:
        topk_idx = torch.topk(probs + bias.to(probs.dtype), top_k, dim=-1).indices
        topk_w = probs.gather(1, topk_idx)
    if replay is not None:
        topk_idx, topk_w = replay_topk(probs, topk_idx, topk_w, replay, logits.shape[-1])
    if norm_topk_prob:
        denom = invariant.tree_sum(topk_w, -1, keepdim=True) if invariant.enabled(numerics, topk_w) else \
            topk_w.sum(dim=-1, keepdim=True)
        topk_w = topk_w / denom
    return probs, topk_idx, topk_w


def replay_topk(probs: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, replay: torch.Tensor,
                num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's (ids, weights) with the rows of `replay` [T, k] that hold ids (>= 0) replaced by
    them and the live `probs` gathered there; rows with a negative id keep the live top-k."""
    if replay.shape != topk_idx.shape:
        raise ValueError(f"router replay: routes of shape {tuple(replay.shape)} for {tuple(topk_idx.shape)} "
                         "(tokens, top_k) router picks; give one row of top_k expert ids per token")
    replay = replay.to(device=topk_idx.device, dtype=topk_idx.dtype)
    replayed = (replay >= 0).all(-1, keepdim=True)
    ordered = replay.sort(-1).values
    too_big, mixed = replay >= num_experts, (replay >= 0) != replayed
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & replayed
    if bool(too_big.any() | mixed.any() | repeated.any()):  # one device sync for all three checks
        if bool(too_big.any()):
            raise ValueError(f"router replay: expert id {int(replay.max())} out of range for {num_experts} experts")
        if bool(mixed.any()):
            raise ValueError("router replay: a token's routes must be all expert ids or all negative (route live)")
        raise ValueError("router replay: a token's replayed expert ids must be distinct")
    idx = torch.where(replayed, replay, topk_idx)
    return idx, torch.where(replayed, probs.gather(1, idx), topk_w)


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts with stacked weights: w13 [E, 2F, H] (gate rows, then up rows)
    and w2 [E, H, F]. Each expert GEMM is the MoEResQ linear with `recipe`.

    `forward` takes the experts' weights as `unbind` views: backward then writes every expert's
    gradient into one stacked buffer per weight. Indexing `w13[e]` per expert (`select_per_expert`,
    kept only as the benchmark's "before") makes each expert's backward allocate a zeroed
    full-size [E, ...] gradient that autograd then sums: the same values, E times the memory traffic.
    `numerics`: the model's `fp4.Numerics` (`apply_numerics`), passed to every FP4 / invariant op.

    With FP4 off, outside the batch-invariant mode, the experts run as two grouped GEMMs over all
    local experts (`grouped_forward`, `can_group`) instead of the loop: per expert the same GEMM on
    the same rows, one kernel launch and no Python loop. Its SiLU runs over all rows at once, and
    ATen's SiLU rounds its vector tail differently from its body, so the result equals the loop's
    within fp32 rounding (the same bits where the kernels do; `grouped = False` forces the loop).

    FP4 experts under autograd run `grouped_resq_forward`: each MoEResQ linear over all experts as
    one grouped call (`fp4.moeresq_grouped`: forward, dgrad and wgrad each one node for all experts,
    `segments` kept) and the SwiGLU per expert slice, with per expert the loop's bits.
    """

    select_per_expert = False
    numerics = STANDARD
    grouped = True  # one grouped GEMM over all experts where `can_group` allows; False: the loop
    # FP4 off: above this many rows per expert on average the loop is as fast (its per-expert SiLU
    # and products stay in cache; bench_moe_grouped.py: 0.9x at 8 experts x 256 rows, 1.3-1.5x at 64-128)
    max_group_rows = 128

    def __init__(self, num_experts: int, hidden: int, ffn: int, recipe: Recipe):
        super().__init__()
        self.num_experts, self.hidden, self.ffn = num_experts, hidden, ffn
        self.recipe = recipe
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.quant_name = ""  # global module name (fp4 `name_quant_sites`); keys SR streams per expert

    def expert_forward(self, e: int, x: torch.Tensor, w13: Optional[torch.Tensor] = None,
                       w2: Optional[torch.Tensor] = None, segments: Optional[list[int]] = None) -> torch.Tensor:
        """Expert `e` on its tokens `x`; `w13`/`w2`: its weights as views (default `self.w13[e]`, ...);
        `segments`: row counts of `x`'s runs from distinct micro-batches (see `forward`)."""
        name = f"{self.quant_name}.{getattr(self, 'expert_offset', 0) + e}"  # global expert id
        w13 = self.w13[e] if w13 is None else w13
        w2 = self.w2[e] if w2 is None else w2
        nx = self.numerics
        h = moeresq_linear(x, w13, recipe=self.recipe, name=name + ".w13", segments=segments, numerics=nx)
        gate, up = h.split(self.ffn, dim=-1)
        return moeresq_linear(invariant.silu(gate, nx) * up, w2, recipe=self.recipe, name=name + ".w2",
                              segments=segments, numerics=nx)

    def forward(self, x_sorted: torch.Tensor, counts: list[int],
                segments: Optional[list[list[int]]] = None) -> torch.Tensor:
        """x_sorted [N, H]: tokens grouped by local expert, `counts[e]` rows for expert e.

        `segments[e]` (expert parallelism: rows from each source rank, i.e. each source's
        micro-batch) splits expert e's rows into consecutive runs whose FP4 weight gradient is
        quantized run by run (`moeresq_linear(segments=)`), so it equals the sum of the
        single process's per-micro-batch wgrads. Forward values do not depend on it."""
        assert len(counts) == self.num_experts and sum(counts) == x_sorted.shape[0]
        if segments is not None and (len(segments) != self.num_experts
                                     or any(sum(s) != n for s, n in zip(segments, counts))):
            raise ValueError(f"GroupedExperts: segments={segments} must hold, per local expert, row counts "
                             f"summing to that expert's count in counts={counts}")
        if self.grouped and not self.select_per_expert and x_sorted.shape[0]:
            nx = self.numerics
            if can_group(self.recipe, x_sorted, nx) and x_sorted.shape[0] <= self.max_group_rows * self.num_experts:
                return self.grouped_forward(x_sorted, counts)
            if can_group_fp4(self.recipe, x_sorted, (self.w13, self.w2), nx):
                return self.grouped_fp4_forward(x_sorted, counts)
            if can_group_exact(self.recipe, x_sorted, (self.w13, self.w2), nx):
                return self.grouped_exact_forward(x_sorted, counts)
            if can_group_resq(self.recipe, x_sorted, nx):
                return self.grouped_resq_forward(x_sorted, counts, segments)
        if self.select_per_expert:
            w13s = w2s = [None] * self.num_experts
        else:
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

    def grouped_exact_forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The batch-invariant mode without autograd (`can_group_exact`): the loop's exact GEMMs with
        the input's limbs (FP4 off, `invariant.grouped_linear`) or FP4 codes (`exact_grouped_fp4`),
        the SiLU and the combination done once for all rows (a row's bits depend on that row and
        its expert alone)."""
        w13s, w2s, nx = self.w13.unbind(0), self.w2.unbind(0), self.numerics
        if self.recipe.mode == "bf16":
            gate, up = invariant.grouped_linear(x_sorted, w13s, counts, nx).split(self.ffn, dim=-1)
            return invariant.grouped_linear(invariant.silu(gate, nx) * up, w2s, counts, nx)
        first = getattr(self, "expert_offset", 0)
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
        first = getattr(self, "expert_offset", 0)
        names = [f"{self.quant_name}.{first + e}" for e in range(self.num_experts)]

        def linear(x, weight, which):
            return grouped_moeresq_linear(x, weight, counts, recipe=self.recipe, names=[n + which for n in names],
                                          name=f"{self.quant_name}.<grouped>{which}", segments=segments,
                                          numerics=self.numerics)

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

    def _fp4_grouped_linear(self, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, which: str):
        r, nx = self.recipe, self.numerics
        name, first = f"{self.quant_name}.<grouped>.{which}", getattr(self, "expert_offset", 0)
        wq = cached_for_weight(nx.weight_cache, weight, ("grouped Q(W)", r.weight), lambda: torch.stack([
            resq_quantize(w, r.weight, compensated=False, name=f"{self.quant_name}.{first + e}.{which}:weight",
                          triton=nx.triton) for e, w in enumerate(weight.detach().unbind(0))]))
        xq = resq_quantize(x, r.input, r.compensated, name=f"{name}:input", triton=nx.triton)
        return _GROUPED_MM(xq, wq.transpose(1, 2), offs=offs).to(x.dtype)


def can_group_fp4(recipe: Recipe, x: torch.Tensor, weights, numerics: Numerics = STANDARD) -> bool:
    """Whether FP4 experts may run `GroupedExperts.grouped_fp4_forward`: no autograd (the backward's
    columnwise blocks run along each expert's tokens), outside the batch-invariant mode (exact
    GEMMs), nearest rounding (stochastic streams are keyed by expert), row-local input quantization,
    eager non-finite checks, fp32/bf16 on CPU (fp32 GEMM operands, which CPU `grouped_mm` takes)."""
    if _GROUPED_MM is None or recipe.mode not in ("fp4", "fp4_resq") or invariant.enabled(numerics, x):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return False
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if torch.is_autocast_enabled(x.device.type) or numerics.position.nonfinite_flags_for(x.device) is not None:
        return False
    return row_local(recipe.input) and recipe.weight.rounding == "nearest"


def can_group_exact(recipe: Recipe, x: torch.Tensor, weights, numerics: Numerics = STANDARD) -> bool:
    """Whether experts in the batch-invariant mode may run `grouped_exact_forward`: no autograd (the
    loop carries the backward); FP4 also as `exact_experts.can_group_exact_fp4` says."""
    if recipe.mode != "bf16":
        return can_group_exact_fp4(recipe, x, weights, numerics)
    if not invariant.enabled(numerics, x):
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


def combine_expert_outputs(y_slots: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
    """y_slots [T, k, H] (slot j = output of expert topk_idx[:, j]) -> weighted sum [T, H], adding
    the k terms in ascending expert index order (a fixed order, whatever the arrival order)."""
    order = torch.argsort(topk_idx, dim=1, stable=True)
    y = torch.gather(y_slots, 1, order[..., None].expand_as(y_slots))
    w = torch.gather(topk_w, 1, order).to(y_slots.dtype)
    out = y[:, 0] * w[:, 0, None]
    for j in range(1, y.shape[1]):
        out = out + y[:, j] * w[:, j, None]
    return out


def permute_by_expert(topk_idx: torch.Tensor, num_experts: int):
    """Stable sort of the T·k (token, slot) pairs by expert. Returns (order, token_of_row, counts)."""
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, order // topk_idx.shape[1], counts


class LocalDispatcher:
    """All experts on this process: permute, run grouped experts, un-permute, combine."""

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor:
        T, k = topk_idx.shape
        order, token_of_row, counts = permute_by_expert(topk_idx, experts.num_experts)
        y_sorted = experts(x[token_of_row], counts.tolist())
        y_slots = torch.empty(T * k, x.shape[-1], dtype=y_sorted.dtype, device=x.device)
        y_slots = y_slots.index_copy(0, order, y_sorted)
        return combine_expert_outputs(y_slots.view(T, k, -1), topk_idx, topk_w)


class MoELayer(nn.Module):
    """Router + experts (+ optional shared expert). Records per-step statistics for logging."""

    zero_buffers = ("tokens_per_expert",)  # `transformer.materialize` starts these at zero

    def __init__(self, hidden: int, num_experts: int, top_k: int, ffn: int, recipe: Recipe,
                 norm_topk_prob: bool = True, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0,
                 num_shared_experts: int = 0, shared_ffn: int = 0, bias_update_rate: float = 0.0,
                 aux_loss_type: str = "global"):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.aux_loss_type = aux_loss_type  # global: over all of the batch's tokens | seq: per sequence, mean
        self.bias_update_rate = bias_update_rate
        self.router = Router(hidden, num_experts, top_k, norm_topk_prob, expert_bias=bias_update_rate > 0)
        # real tokens per expert since the last `update_expert_bias` (training forwards, not recomputes)
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float64)
                             if bias_update_rate > 0 else None, persistent=False)
        self.count_load = True  # off while activation recomputation re-runs the forward
        self.experts = GroupedExperts(num_experts, hidden, ffn, recipe)
        self.shared_expert = SwiGLU(hidden, shared_ffn * num_shared_experts, recipe) if num_shared_experts else None
        self.dispatcher = LocalDispatcher()
        # Gradient scale of the auxiliary losses (1/num_microbatches, set by the trainer).
        self.aux_loss_scale = 1.0
        self.stats: list[dict] = []  # appended each training forward; drained by the trainer
        self.record_stats = False

    def aux_losses(self, logits: torch.Tensor, probs: torch.Tensor, topk_idx: torch.Tensor,
                   valid: Optional[torch.Tensor] = None):
        """Switch-style load balancing E·Σ f_e·P_e and the router z-loss mean(logsumexp²), over the
        tokens `valid` [T] marks (None: all; padding is left out, as Megatron-Core and HF's
        ``load_balancing_loss_func(attention_mask=)`` do). Statistics of this rank's tokens."""
        if valid is None:  # packed batches: the unmasked path, unchanged bits
            T = logits.shape[0]
            counts = torch.bincount(topk_idx.reshape(-1), minlength=self.num_experts)
            f = counts.float() / max(T * self.top_k, 1)
            p = probs.mean(dim=0)
            balance = self.num_experts * (f * p).sum()
            z = torch.logsumexp(logits, dim=-1).pow(2).mean()
            return balance, z, counts
        keep = valid.reshape(-1).to(torch.bool)
        w = keep.to(probs.dtype)
        n = w.sum().clamp_min(1.0)  # no real token: both losses 0 (and no device sync)
        counts = torch.bincount(topk_idx.reshape(-1), weights=keep.repeat_interleave(self.top_k).to(torch.float64),
                                minlength=self.num_experts).to(torch.long)
        f = counts.to(probs.dtype) / (n * self.top_k)
        p = (probs * w[:, None]).sum(dim=0) / n
        balance = self.num_experts * (f * p).sum()
        z = (torch.logsumexp(logits, dim=-1).pow(2) * w).sum() / n
        return balance, z, counts

    def forward(self, x: torch.Tensor, routing_out: Optional[list] = None,
                routing_in: Optional[torch.Tensor] = None, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [..., H]; `routing_out`: the experts used are appended ([..., k]); `routing_in` [..., k]:
        expert ids to replay (negative rows route live, see `Router.forward`); `valid` [...]: the real
        (non-padding) tokens, the only ones the auxiliary losses count (None: all). The auxiliary
        losses are computed from the ids used and the live probabilities (Megatron-Core: the same)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        replay = None if routing_in is None else routing_in.reshape(-1, self.top_k)
        # without replay the router is called as before (its one-argument form, which tests wrap)
        logits, probs, topk_idx, topk_w = self.router(x2) if replay is None else self.router(x2, replay)
        out = self.dispatcher(x2, topk_idx, topk_w, self.experts)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x2)
        out = out.view(shape)
        if routing_out is not None:
            routing_out.append(topk_idx.view(*shape[:-1], self.top_k))
        if self.training and x2.shape[0] > 0:
            balance, z, counts = self.aux_losses(logits, probs, topk_idx, valid)
            if self.aux_loss_type == "seq":
                balance = seq_balance_loss(probs, topk_idx, valid, shape[0] if len(shape) == 3 else 1)
            if self.tokens_per_expert is not None and self.count_load:
                self.tokens_per_expert += counts
            aux = self.aux_loss_coef * balance + self.z_loss_coef * z
            # Both coefficients 0 (e.g. RL): no auxiliary gradient at all, not even 0·NaN.
            if torch.is_grad_enabled() and aux.requires_grad and (self.aux_loss_coef or self.z_loss_coef):
                out = AuxLossAutoScaler.apply(out, aux, self.aux_loss_scale)
            if self.record_stats:
                self.stats.append({"aux_loss": balance.detach(), "z_loss": z.detach(), "counts": counts.detach()})
        return out


def init_moe_params(layer: MoELayer, std: float, out_std: float, generator: torch.Generator) -> None:
    """A bare layer's init from one generator (tests and benchmarks of a single MoE layer; the
    model's own init is `transformer.init_weights`)."""
    with torch.no_grad():
        layer.router.weight.normal_(0, std, generator=generator)
        layer.experts.w13.normal_(0, std, generator=generator)
        layer.experts.w2.normal_(0, out_std, generator=generator)

