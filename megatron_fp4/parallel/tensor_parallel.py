"""Tensor parallel (+ sequence parallel) for the decoder, applied to a built model from outside.

`parallelize_tp(model, group, sequence_parallel)` cuts the weights in place and registers forward
hooks for the collectives, in the spirit of torchtitan's ``parallelize_module``: the model code
(`model/layers.py`, `model/transformer.py`) stays the single-process code.

- Attention: q/k/v column-parallel (heads split), o row-parallel. GQA: kv heads split when
  ``num_kv_heads % tp == 0``; with fewer kv heads than ranks (``tp % num_kv_heads == 0``) each rank
  holds the kv head its query heads read, replicated as Megatron-Core does, and the ranks sharing
  one sum its gradient (`TPPlan.finish_grads`).
- Dense MLP layers: gate/up column-parallel, down row-parallel.
- Embedding and LM head: split along the vocabulary; the loss is `vocab_parallel_cross_entropy`
  on the local logits (`TPPlan.loss`), `TPPlan.gather_logits` gives full logits (scoring).
- MoE layers (router, routed and shared experts) stay whole on every rank (expert-tensor parallel
  1) and route every token of the sequence, also under sequence parallel (all-gathered in, the
  rank's chunk out): routing, auxiliary losses and the FP4 weight gradient, which quantizes along
  tokens, then see the single process's tokens in its order.
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

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron_fp4.fp4 import MoEResQLinear
from megatron_fp4.fp4.tensor_cut import TensorCut
from megatron_fp4.model.layers import Attention, SwiGLU
from megatron_fp4.model.moe import MoELayer
from megatron_fp4.parallel.tp_comm import (_all_reduce, _gather, amax_reducer, copy_to_tp, gather_seq, gather_whole,
                                           reduce_from_tp, scatter_seq, split_whole, vocab_parallel_cross_entropy)


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
    kv_slots: list = field(default_factory=list)           # (param, full rows, slot) of replicated kv heads
    _mask: Optional[torch.Tensor] = None                   # the decoder layer's attention mask (SP)

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


def _cut_fp4(linears: dict, kind: str, plan: TPPlan, reduce_max) -> None:
    """Give the FP4 linears among ``linears`` ({name: module}, already cut) their `TensorCut`, after
    checking that their blocks lie inside this rank's slice."""
    cut = TensorCut(kind, plan.size, reduce_max)
    for name, linear in linears.items():
        if _fp4(linear):
            out_local, in_local = linear.weight.shape
            cut.check(linear.recipe, out_local, in_local, linear.quant_name or name)
            linear.tp_cut = cut


def parallelize_tp(model: nn.Module, group, sequence_parallel: bool = False) -> TPPlan:
    """Cut `model` (a `MoETransformer`, whole or a pipeline stage's layers) for tensor parallelism
    over `group` and return the plan (see the module docstring)."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
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
    reduce_max = amax_reducer(group)
    for module in model.modules():
        if isinstance(module, Attention):
            if tp > cfg.num_kv_heads and _fp4(module.k_proj):
                raise ValueError(f"parallel.tp={tp} with FP4 attention (fp4.scope=experts+attention) needs "
                                 f"model.num_kv_heads={cfg.num_kv_heads} >= tp: replicated kv heads would quantize "
                                 "their gradient per rank before the ranks sum it; use fp4.scope=experts or more "
                                 "kv heads")
            _attention(module, plan)
            _cut_fp4({"q_proj": module.q_proj, "k_proj": module.k_proj, "v_proj": module.v_proj}, "column", plan,
                     reduce_max)
            _cut_fp4({"o_proj": module.o_proj}, "row", plan, reduce_max)
        elif isinstance(module, SwiGLU) and not _inside_moe(model, module):
            _dense_mlp(module, plan)
            _cut_fp4({"gate_proj": module.gate_proj, "up_proj": module.up_proj}, "column", plan, reduce_max)
            _cut_fp4({"down_proj": module.down_proj}, "row", plan, reduce_max)
        elif isinstance(module, MoELayer) and sequence_parallel:
            _moe_sequence_parallel(module, plan)
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


def _attention(attn: Attention, plan: TPPlan) -> None:
    tp, r, hd = plan.size, plan.rank, attn.head_dim
    nh, nkv = attn.num_heads // tp, attn.num_kv_heads
    _cut(attn.q_proj, "weight", 0, _rows(r * nh, (r + 1) * nh, hd))
    _cut(attn.o_proj, "weight", 1, _rows(r * nh, (r + 1) * nh, hd))
    if nkv % tp == 0:
        kv = nkv // tp
        for proj in (attn.k_proj, attn.v_proj):
            _cut(proj, "weight", 0, _rows(r * kv, (r + 1) * kv, hd))
    else:  # fewer kv heads than ranks: the one kv head this rank's query heads read, replicated
        kv, head = 1, r * nkv // tp
        for proj in (attn.k_proj, attn.v_proj):
            p = _cut(proj, "weight", 0, _rows(head, head + 1, hd))
            plan.kv_slots.append((p, nkv * hd, slice(head * hd, (head + 1) * hd)))
    attn.num_heads, attn.num_kv_heads = nh, kv
    plan.partial_grads += [attn.q_norm.weight, attn.k_norm.weight]  # shared by every head
    _region(attn, plan)


def _dense_mlp(mlp: SwiGLU, plan: TPPlan) -> None:
    f = mlp.gate_proj.weight.shape[0] // plan.size
    rows = _rows(plan.rank * f, (plan.rank + 1) * f)
    _cut(mlp.gate_proj, "weight", 0, rows)
    _cut(mlp.up_proj, "weight", 0, rows)
    _cut(mlp.down_proj, "weight", 1, rows)
    _region(mlp, plan)


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


def _moe_sequence_parallel(moe: MoELayer, plan: TPPlan) -> None:
    """The MoE layer runs whole on every rank, on the whole sequence (all-gathered in, this rank's
    chunk out): routing, the auxiliary losses and the FP4 weight gradient (quantized along tokens)
    see the single process's tokens in its order, so the layer stays layout-invariant."""

    def pre(m, args):
        x, rest = args[0], list(args[1:])
        if len(rest) > 1 and rest[1] is not None:
            raise ValueError("router replay (routing_in) with sequence parallel is not implemented yet; "
                             "set parallel.sequence_parallel=false")
        x = gather_whole(x, plan.group, 1)
        if len(rest) > 2 and rest[2] is not None:  # the real tokens of the whole sequence
            rest[2] = plan._mask[:, :x.shape[1]] if plan._mask is not None else None
        return (x, *rest)

    moe.register_forward_pre_hook(pre)
    moe.register_forward_hook(lambda m, args, out: split_whole(out, plan.group, 1))
