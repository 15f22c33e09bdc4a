"""Tensor parallel (+ sequence parallel) for the decoder, applied to a built model from outside.

`parallelize_tp(model, group, sequence_parallel)` cuts the weights in place and registers forward
hooks for the collectives, in the spirit of torchtitan's ``parallelize_module``: the model code
(`model/layers.py`, `model/transformer.py`) stays the single-process code.

- Attention: q/k/v column-parallel (heads split), o row-parallel. GQA: kv heads split when
  ``num_kv_heads % tp == 0``; with fewer kv heads than ranks (``tp % num_kv_heads == 0``) each rank
  holds the kv head its query heads read, replicated as Megatron-Core does, and the ranks sharing
  one sum its gradient (`TPPlan.finish_grads`).
  GPT-OSS (`model/gpt_oss.py`): the q/k/v biases and the per-head sinks cut by head, o_proj's
  bias added once after the reduction (`_row_bias`). DeepSeek-V3's latent attention (`_mla`):
  q_b_proj (or q_proj) and kv_b_proj by head, o_proj row-parallel, the down-projections
  q_a_proj / kv_a_proj_with_mqa and their norms replicated with partial gradients.
- Dense MLP layers: gate/up column-parallel, down row-parallel.
- Embedding and LM head: split along the vocabulary; the loss is `vocab_parallel_cross_entropy`
  on the local logits (`TPPlan.loss`), `TPPlan.gather_logits` gives full logits (scoring).
- MoE layers (router, routed and shared experts) are not cut (`parallel/moe/tp_moe.py`): with
  ``moe_tokens='whole'`` (default) they route every token of the sequence on every rank, also under
  sequence parallel (all-gathered in, the rank's chunk out); with ``moe_tokens='local'`` each rank
  routes its own 1/tp chunk of the sequence (Megatron's parallel folding: the ep group may refold
  the stage's dp·tp ranks) and the routed experts' gradients are left to the edp reduction
  (`TPPlan.expert_grads`).
- Sequence parallel: norms and residuals see a 1/tp chunk of the sequence; an all-gather enters
  each attention/MLP region and a reduce-scatter leaves it. Their weights get partial gradients:
  `finish_grads` sums them over the group (q/k-norm weights too, with or without sequence
  parallel: each rank applies them to its own heads).

FP4 linears it cuts (attention under ``fp4.scope=experts+attention``, the dense MLP of
``model.dense_layers`` under an FP4 recipe) get a `fp4.tensor_cut.TensorCut` (``linear.tp_cut``):
their blocks must lie inside a rank's slice (checked here) and every global amax that spans the cut
is max-reduced over the group before quantizing, so their codes are the single process's slices.

Not here yet (refused with a message): FP4 attention with fewer kv heads than ranks (the replicated
heads' dY would be quantized per rank before the ranks sum it); router replay under sequence
parallel; KV-cache decoding.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron_fp4.config.choices import check_choice
from megatron_fp4.fp4 import MoEResQLinear, invariant, moeresq_linear
from megatron_fp4.fp4.tensor_cut import TensorCut
from megatron_fp4.model.deepseek_v3 import MLAttention
from megatron_fp4.model.layers import Attention, SwiGLU
from megatron_fp4.model.moe import MoELayer
from megatron_fp4.parallel.tp_comm import (_all_reduce, _gather, amax_reducer, copy_to_tp, gather_seq, reduce_from_tp,
                                           scatter_seq, vocab_parallel_cross_entropy)
from megatron_fp4.parallel.moe.tp_moe import MOE_TOKENS, moe_local_tokens, moe_whole_tokens


@dataclass
class TPPlan:
    """What `parallelize_tp` did to a model: the group, which parameters need their gradients
    summed over it, and the vocabulary slice of this rank."""
    group: object
    rank: int
    size: int
    sequence_parallel: bool
    vocab_start: int = 0
    vocab_size: int = 0
    partial_grads: list = field(default_factory=list)      # params whose grads are per-rank partial sums
    expert_grads: list = field(default_factory=list)       # moe_tokens='local': routed experts, partial (edp)
    kv_slots: list = field(default_factory=list)           # (param, full rows, slot) of replicated kv heads
    _mask: Optional[torch.Tensor] = None                   # the decoder layer's attention mask (SP)
    _moe_batch: int = 1                                    # moe_tokens='local': the MoE call's batch size

    def finish_grads(self) -> None:
        """Sum the partial gradients over the group (call after backward, before clipping)."""
        grads = [p.grad for p in self.partial_grads if p.grad is not None]
        if grads:
            flat = _all_reduce(torch.cat([g.reshape(-1) for g in grads]), self.group)
            for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(piece.view_as(g))
        for p, rows, slot in self.kv_slots:
            if p.grad is None:
                continue
            buf = torch.zeros((rows, *p.grad.shape[1:]), dtype=p.grad.dtype, device=p.grad.device)
            buf[slot] = p.grad
            p.grad.copy_(_all_reduce(buf, self.group)[slot])

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy of this rank's logits slice [..., V/tp] (`model.lm_loss`)."""
        wide = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return vocab_parallel_cross_entropy(logits.to(wide).reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                            self.vocab_start, self.group)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits from each rank's slice (no gradient path needed for scoring)."""
        return _gather(logits, self.group, logits.dim() - 1)


def _cut(module: nn.Module, name: str, dim: int, index) -> nn.Parameter:
    """Replace `module.name` by the rows (dim 0) or columns (dim 1) `index` of it, a new leaf that
    remembers where it came from (``tp_shard = (dim, index)``: checkpoints and weight sync gather it)."""
    old = getattr(module, name)
    new = nn.Parameter(old.detach().index_select(dim, index).clone(), requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)
    new.tp_shard = (dim, index)
    module._parameters[name] = new
    return new


def _rows(start: int, stop: int, per: int = 1) -> torch.Tensor:
    return torch.arange(start * per, stop * per)


def _fp4(linear: nn.Module) -> bool:
    return isinstance(linear, MoEResQLinear) and linear.recipe.quantized


def _cut_fp4(linears: dict, kind: str, plan: TPPlan) -> None:
    """Give the FP4 linears among ``linears`` ({name: module}, already cut) their `TensorCut`, after
    checking that their blocks lie inside this rank's slice."""
    cut = TensorCut(kind, plan.size, amax_reducer(plan.group))
    for name, linear in linears.items():
        if _fp4(linear):
            out_local, in_local = linear.weight.shape
            cut.check(linear.recipe, out_local, in_local, linear.quant_name or name)
            linear.tp_cut = cut


def parallelize_tp(model: nn.Module, group, sequence_parallel: bool = False, *, moe_tokens: str = "whole",
                   size_rank: Optional[tuple] = None) -> TPPlan:
    """Cut `model` (a `MoETransformer`, whole or a pipeline stage's layers) for tensor parallelism
    over `group` and return the plan (see the module docstring; ``moe_tokens``: `parallel/moe/tp_moe.py`).
    ``size_rank=(tp, rank)`` with ``group=None``: the same cut without a process group (the memory
    planner's meta model, `training/memory_plan.py`; its hooks must never run)."""
    check_choice("parallelize_tp: moe_tokens", moe_tokens, MOE_TOKENS)
    tp, rank = size_rank if size_rank is not None else (dist.get_world_size(group), dist.get_rank(group))
    cfg = model.cfg
    plan = TPPlan(group, rank, tp, sequence_parallel)
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"model.num_heads={cfg.num_heads} is not a multiple of parallel.tp={tp}")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        problems.append(f"model.num_kv_heads={cfg.num_kv_heads} neither divides nor is divided by parallel.tp={tp}")
    if cfg.vocab_size % tp:
        problems.append(f"model.vocab_size={cfg.vocab_size} is not a multiple of parallel.tp={tp}")
    if cfg.dense_layers and cfg.dense_ffn_hidden_size % tp:
        problems.append(f"model.dense_ffn_hidden_size={cfg.dense_ffn_hidden_size} is not a multiple of parallel.tp={tp}")
    if problems:
        raise ValueError("tensor parallel layout: " + "; ".join(problems))
    for module in model.modules():
        if isinstance(module, MLAttention):
            _mla(module, plan)
        elif isinstance(module, Attention):
            if tp > cfg.num_kv_heads and _fp4(module.k_proj):
                raise ValueError(f"parallel.tp={tp} with FP4 attention (fp4.scope=experts+attention) needs "
                                 f"model.num_kv_heads={cfg.num_kv_heads} >= tp: replicated kv heads would quantize "
                                 "their gradient per rank before the ranks sum it; use fp4.scope=experts or more "
                                 "kv heads")
            _attention(module, plan)
            _cut_fp4({"q_proj": module.q_proj, "k_proj": module.k_proj, "v_proj": module.v_proj}, "column", plan)
            _cut_fp4({"o_proj": module.o_proj}, "row", plan)
        elif isinstance(module, SwiGLU) and not _inside_moe(model, module):
            _dense_mlp(module, plan)
        elif isinstance(module, MoELayer) and moe_tokens == "local":
            if module.shared_expert is not None:
                _shared_expert(module.shared_expert, plan)
            moe_local_tokens(module, plan)
        elif isinstance(module, MoELayer) and sequence_parallel:
            moe_whole_tokens(module, plan)
    _vocab(model, plan)
    if sequence_parallel:
        _sequence_parallel(model, plan)
    return plan


def _inside_moe(model: nn.Module, module: nn.Module) -> bool:
    return any(isinstance(m, MoELayer) and m.shared_expert is module for m in model.modules())


def _enter(x: torch.Tensor, plan: TPPlan, dim: int = 1) -> torch.Tensor:
    return gather_seq(x, plan.group, dim) if plan.sequence_parallel else copy_to_tp(x, plan.group)


def _leave(y: torch.Tensor, plan: TPPlan, dim: int = 1) -> torch.Tensor:
    return scatter_seq(y, plan.group, dim) if plan.sequence_parallel else reduce_from_tp(y, plan.group)


def _region(module: nn.Module, plan: TPPlan, dim: int = 1) -> None:
    module.register_forward_pre_hook(lambda m, args: (_enter(args[0], plan, dim), *args[1:]))
    module.register_forward_hook(lambda m, args, out: _leave(out, plan, dim))


def _column(proj: nn.Module, index: torch.Tensor) -> list:
    """Cut `proj`'s output rows (and its bias, if any) to `index`; the new parameters."""
    return [_cut(proj, name, 0, index) for name in ("weight", "bias") if getattr(proj, name, None) is not None]


def _attention(attn: Attention, plan: TPPlan) -> None:
    """Qwen3's and GPT-OSS's GQA attention: q/k/v by head (with their biases), o by its input
    columns; GPT-OSS's sinks by head, its o bias added once after the reduction (`_row_bias`)."""
    tp, r, hd = plan.size, plan.rank, attn.head_dim
    nh, nkv = attn.num_heads // tp, attn.num_kv_heads
    _column(attn.q_proj, _rows(r * nh, (r + 1) * nh, hd))
    _cut(attn.o_proj, "weight", 1, _rows(r * nh, (r + 1) * nh, hd))
    if nkv % tp == 0:
        kv = nkv // tp
        for proj in (attn.k_proj, attn.v_proj):
            _column(proj, _rows(r * kv, (r + 1) * kv, hd))
    else:  # fewer kv heads than ranks: the one kv head this rank's query heads read, replicated
        kv, head = 1, r * nkv // tp
        for proj in (attn.k_proj, attn.v_proj):
            for p in _column(proj, _rows(head, head + 1, hd)):
                plan.kv_slots.append((p, nkv * hd, slice(head * hd, (head + 1) * hd)))
    attn.num_heads, attn.num_kv_heads = nh, kv
    if isinstance(getattr(attn, "sinks", None), nn.Parameter):  # GPT-OSS: one sink logit per query head
        _cut(attn, "sinks", 0, _rows(r * nh, (r + 1) * nh))
    if hasattr(attn, "q_norm"):
        plan.partial_grads += [attn.q_norm.weight, attn.k_norm.weight]  # shared by every head
    _region(attn, plan)
    _row_bias(attn, attn.o_proj, plan)


def _row_bias(region: nn.Module, proj: nn.Module, plan: TPPlan) -> None:
    """A row-parallel linear's bias added once: `proj` computes without it on every rank and the
    region's output (after the reduction over the group) adds it. Under sequence parallel each rank
    adds it to its chunk of the sequence, so its gradient is partial."""
    bias = getattr(proj, "bias", None)
    if bias is None:
        return
    proj.forward = types.MethodType(_without_bias, proj)  # a bound method: a deepcopy rebinds it
    region.register_forward_hook(lambda m, args, out: out + bias.to(out.dtype))
    if plan.sequence_parallel:
        plan.partial_grads.append(bias)


def _without_bias(proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`proj`'s forward with its bias left out (`_row_bias` adds it after the reduction)."""
    if isinstance(proj, MoEResQLinear):
        return moeresq_linear(x, proj.weight, None, recipe=proj.recipe, name=proj.quant_name,
                              numerics=proj.numerics, cut=proj.tp_cut)
    return invariant.linear(x, proj.weight, None, proj.numerics)


def _mla(attn: MLAttention, plan: TPPlan) -> None:
    """DeepSeek-V3's latent attention (Megatron-Core's MLA cut): the query up-projection (q_b_proj,
    or q_proj without a q low rank) and kv_b_proj by head, o_proj by its input columns; the
    down-projections q_a_proj / kv_a_proj_with_mqa (the shared rotary key part with them) and their
    norms replicated, each rank applying them for its own heads: their gradients are partial."""
    tp, r = plan.size, plan.rank
    low_rank = [attn.kv_a_proj_with_mqa] + ([attn.q_a_proj] if attn.q_lora_rank else [])
    if any(_fp4(p) for p in low_rank):
        raise ValueError(f"parallel.tp={tp} with FP4 latent attention (fp4.scope=experts+attention) is not "
                         "implemented: the replicated down-projections would quantize their partial output "
                         "gradients per rank before the ranks sum them; use fp4.scope=experts")
    if attn.num_heads % tp:
        raise ValueError(f"tensor parallel layout: model.num_heads={attn.num_heads} is not a multiple of "
                         f"parallel.tp={tp}")
    nh = attn.num_heads // tp
    _cut(attn.q_b_proj if attn.q_lora_rank else attn.q_proj, "weight", 0, _rows(r * nh, (r + 1) * nh, attn.qk_dim))
    _cut(attn.kv_b_proj, "weight", 0, _rows(r * nh, (r + 1) * nh, attn.nope_dim + attn.v_dim))
    _cut(attn.o_proj, "weight", 1, _rows(r * nh, (r + 1) * nh, attn.v_dim))
    attn.num_heads = attn.num_kv_heads = nh
    norms = [attn.kv_a_layernorm] + ([attn.q_a_layernorm] if attn.q_lora_rank else [])
    plan.partial_grads += [p for m in low_rank + norms for p in m.parameters()]
    _region(attn, plan)


def _dense_mlp(mlp: SwiGLU, plan: TPPlan, region: bool = True) -> None:
    f = mlp.gate_proj.weight.shape[0] // plan.size
    if f * plan.size != mlp.gate_proj.weight.shape[0]:
        raise ValueError(f"tensor parallel layout: an MLP's ffn size {mlp.gate_proj.weight.shape[0]} is not a "
                         f"multiple of parallel.tp={plan.size}")
    rows = _rows(plan.rank * f, (plan.rank + 1) * f)
    _cut(mlp.gate_proj, "weight", 0, rows)
    _cut(mlp.up_proj, "weight", 0, rows)
    _cut(mlp.down_proj, "weight", 1, rows)
    if region:
        _region(mlp, plan)
    _cut_fp4({"gate_proj": mlp.gate_proj, "up_proj": mlp.up_proj}, "column", plan)
    _cut_fp4({"down_proj": mlp.down_proj}, "row", plan)


def _shared_expert(mlp: SwiGLU, plan: TPPlan) -> None:
    """moe_tokens='local': the shared expert cut like a dense MLP, on the whole sequence: the MoE
    layer's rows [B·T/tp, H] of this rank's chunk are all-gathered along the sequence (so the rows
    are the single process's, in its order: FP4 wgrad quantizes along them) and the output
    reduce-scattered back to the chunk (Megatron-Core cuts shared experts with tp too)."""
    _dense_mlp(mlp, plan, region=False)
    mlp.tp_whole_sequence = True

    def pre(m, args):
        x2 = args[0]
        x = x2.view(plan._moe_batch, -1, x2.shape[-1])
        return (gather_seq(x, plan.group, 1).reshape(-1, x2.shape[-1]), *args[1:])

    def post(m, args, out):
        return scatter_seq(out.view(plan._moe_batch, -1, out.shape[-1]), plan.group, 1).reshape(-1, out.shape[-1])

    mlp.register_forward_pre_hook(pre)
    mlp.register_forward_hook(post)


def _vocab(model: nn.Module, plan: TPPlan) -> None:
    v = model.cfg.vocab_size // plan.size
    plan.vocab_start, plan.vocab_size = plan.rank * v, v
    rows = _rows(plan.vocab_start, plan.vocab_start + v)
    emb = getattr(model, "embed_tokens", None)  # a pipeline stage holds the embedding, the head, or neither
    if getattr(model, "lm_head", None) is not None:
        _cut(model.lm_head, "weight", 0, rows)
    if getattr(model, "norm", None) is not None:
        # the head reads the final norm's output: enter the region there (the head itself is a method)
        model.norm.register_forward_hook(lambda m, args, out: _enter(out, plan))
    if emb is None:
        return
    _cut(emb, "weight", 0, rows)
    inside: list = []

    def pre(m, args):
        local = args[0] - plan.vocab_start
        keep = (local >= 0) & (local < v)
        inside.append(keep)
        return (torch.where(keep, local, torch.zeros_like(local)),)

    def post(m, args, out):
        keep = inside.pop()
        return _leave(out * keep[..., None].to(out.dtype), plan)

    emb.register_forward_pre_hook(pre)
    emb.register_forward_hook(post)


def _sequence_parallel(model: nn.Module, plan: TPPlan) -> None:
    """Norm weights see one chunk of the sequence on each rank: their gradients are partial."""
    for name, module in model.named_modules():
        if name.endswith(("input_layernorm", "post_attention_layernorm")) or name == "norm":
            plan.partial_grads.append(module.weight)
    for layer in getattr(model, "layers", []):
        layer.register_forward_pre_hook(lambda m, args: _stash_mask(plan, args))


def _stash_mask(plan: TPPlan, args) -> None:
    plan._mask = args[2] if len(args) > 2 else None
