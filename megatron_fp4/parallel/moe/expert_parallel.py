"""Expert parallelism: split every MoE layer's experts over the ``ep`` group and plug in a dispatcher.

Usage (on a full model, or on one still on the meta device, which is then materialised with only
this rank's experts)::

    mesh = ParallelMesh.build(pp=1, dp=4, ep=2)
    model = apply_expert_parallel(model, mesh, dispatcher="gcmoe", chunk_tokens=64, ring_slots=8)
    ...
    full = gather_expert_params(model, mesh)   # {param name: full [E, ...] tensor}, for export

What `apply_expert_parallel` changes, per `MoELayer` of `model.moe_layers()` (or a bare `MoELayer`):

- ``moe.experts`` becomes this rank's contiguous block of ``num_experts // ep`` experts, built by
  `GroupedExperts.shard` through the constructor (``expert_offset``, ``num_local_experts``: rows
  ``[offset, offset + El)`` of the full w13/w2) and installed with `MoELayer.set_experts`;
- its parameters carry ``param.is_expert = True`` and ``param.expert_group = 'edp'``: the ZeRO
  optimizer / grad reducer must reduce them over ``mesh.group('edp')`` (ranks holding the same
  experts), not over ``dp``. `is_expert_param(p)` is the predicate to use;
- the layer's dispatcher becomes an `AllToAllDispatcher`, a `GCMoEDispatcher` (see gcmoe.py) or a
  `GCMoEDecodeDispatcher`, installed with `MoELayer.set_dispatcher`.

The router stays replicated (a dp parameter). Aux losses stay per-rank statistics of local tokens.
With ``ep == 1`` the experts are only marked (edp == dp then) and the local dispatcher is kept.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron_fp4.config.choices import check_choice
from megatron_fp4.model.experts import GroupedExperts
from megatron_fp4.model.moe import MoELayer
from megatron_fp4.parallel.dims import check_expert_split, check_gcmoe
from megatron_fp4.parallel.moe.alltoall import AllToAll, AllToAllDispatcher, DispatchPlan
from megatron_fp4.parallel.moe.gcmoe import GCMoEDispatcher, TransferChannel
from megatron_fp4.parallel.moe.gcmoe_decode import DecodeBuffers, GCMoEDecodeDispatcher
from megatron_fp4.parallel.moe.gcmoe_transfer import transfer_group
from megatron_fp4.parallel.mesh import ParallelMesh

__all__ = [
    "expert_placement", "expert_owner", "local_expert_range", "apply_expert_parallel", "shard_experts",
    "gather_expert_params", "is_expert_param", "AllToAllDispatcher",
    "GCMoEDispatcher", "DispatchPlan", "AllToAll", "DISPATCHERS",
]

DISPATCHERS = ("alltoall", "gcmoe", "gcmoe_decode")  # gcmoe_decode: forward-only (gcmoe_decode.py)


# -- placement (pure) --------------------------------------------------------------------------
def expert_placement(num_experts: int, ep: int) -> list[list[int]]:
    """Global expert ids held by each ep rank: contiguous blocks, ``[[0..El-1], [El..2El-1], ...]``."""
    check_expert_split(num_experts, ep)
    per_rank = num_experts // ep
    return [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(ep)]


def local_expert_range(num_experts: int, ep: int, ep_rank: int) -> tuple[int, int]:
    """[first, last + 1) global expert ids held by `ep_rank`."""
    if not 0 <= ep_rank < ep:
        raise ValueError(f"ep_rank={ep_rank} must be in [0, {ep})")
    block = expert_placement(num_experts, ep)[ep_rank]
    return block[0], block[-1] + 1


def expert_owner(expert: int, num_experts: int, ep: int) -> int:
    """The ep rank holding global expert `expert`."""
    expert_placement(num_experts, ep)  # validates
    if not 0 <= expert < num_experts:
        raise ValueError(f"expert={expert} must be in [0, {num_experts})")
    return expert // (num_experts // ep)


# -- model surgery ------------------------------------------------------------------------------
def is_expert_param(param: torch.Tensor) -> bool:
    """True for expert weights: reduce their grads over `mesh.group(param.expert_group)` ('edp')."""
    return bool(getattr(param, "is_expert", False))


def _mark_expert_params(experts: GroupedExperts) -> None:
    for p in experts.parameters():
        p.is_expert = True
        p.expert_group = "edp"


def shard_experts(moe: MoELayer, ep: int, ep_rank: int) -> None:
    """Give `moe` only ep rank `ep_rank`'s block of experts (`GroupedExperts.shard`, through the
    constructor; nothing allocated on the meta device), parameters marked as expert parameters.
    The model cut of `apply_expert_parallel`, without its collective check and dispatcher."""
    full = moe.experts
    if full.num_local_experts != full.num_global_experts:
        raise ValueError("apply_expert_parallel was already applied to this model; apply it once")
    lo, hi = local_expert_range(full.num_global_experts, ep, ep_rank)
    moe.set_experts(full.shard(lo, hi - lo))
    _mark_expert_params(moe.experts)


def _check_ep_agreement(mesh: ParallelMesh, dispatcher: str, chunk_tokens: int, ring_slots: int,
                        decode_tokens: int = 8) -> None:
    """Every ep rank must use the same dispatcher, and for GC-MoE the same chunk size and ring
    (both ends derive chunk boundaries and tags from them; a mismatch would hang or corrupt).
    One tiny all_gather on the ep group; every rank sees the same values, so all raise together."""
    mine = torch.tensor([DISPATCHERS.index(dispatcher), chunk_tokens, ring_slots, decode_tokens], dtype=torch.int64,
                        device=mesh.device)
    parts = [torch.empty_like(mine) for _ in range(mesh.ep)]
    dist.all_gather(parts, mine, group=mesh.group("ep"))
    values = torch.stack(parts).cpu().tolist()
    ranks = mesh.ranks["ep"]
    fields = [("parallel.expert_dispatcher", lambda v: DISPATCHERS[v]), ("parallel.gcmoe_chunk_tokens", int),
              ("parallel.gcmoe_ring_slots", int), ("apply_expert_parallel(decode_tokens=...)", int)]
    used = {"alltoall": (0,), "gcmoe": (0, 1, 2), "gcmoe_decode": (0, 3)}[dispatcher]  # decode: message size
    for i, (name, show) in enumerate(fields):
        if i not in used:
            continue
        seen = [show(v[i]) for v in values]
        if len(set(seen)) > 1:
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in zip(ranks, seen))
            raise ValueError(f"{name} differs across the expert-parallel group ({per_rank}); it must be "
                             f"the same on every rank: set it once in the config, not per rank")


def apply_expert_parallel(model: nn.Module, mesh: ParallelMesh, dispatcher: str = "alltoall",
                          chunk_tokens: int = 64, transfer_sms: int = 20, gcmoe_compute: str = "expert",
                          ring_slots: int = 8, decode_tokens: int = 8, *, tp_fold: int = 1) -> nn.Module:
    """Keep only this rank's experts in every MoE layer of `model` and install the EP dispatcher.

    Must be called on every rank (it checks collectively that every ep rank passed the same
    dispatcher, `chunk_tokens` and `ring_slots`, and GC-MoE creates a process group collectively).
    `model` is the full model, initialised identically on every rank or still on the meta device
    (then only the local experts are ever allocated, by `model.materialize`). Returns `model` (modified
    in place). `chunk_tokens`, `ring_slots` (receive ring: ``ring_slots × chunk_tokens × hidden``
    elements per rank), `transfer_sms` and `gcmoe_compute` ("expert" | "chunk") only matter for
    "gcmoe". From a config: ``apply_expert_parallel(model, mesh, cfg.parallel.expert_dispatcher,
    cfg.parallel.gcmoe_chunk_tokens, cfg.parallel.gcmoe_transfer_sms,
    ring_slots=cfg.parallel.gcmoe_ring_slots)``. "gcmoe_decode" (inference only, gcmoe_decode.py)
    carries up to `decode_tokens` tokens per rank per round in fixed-size messages. `tp_fold`: the
    tensor-parallel size when the ep group holds the tp ranks as blocks of `tp_fold` consecutive ep
    ranks and the layers route local tokens (`parallelize_tp(moe_tokens='local')`, `parallel/moe/tp_moe.py`;
    all-to-all only).
    """
    if tp_fold != 1 and (dispatcher != "alltoall" or mesh.ep % tp_fold):
        raise ValueError(f"apply_expert_parallel: tp_fold={tp_fold} (tensor parallel folded into ep) needs "
                         f"parallel.expert_dispatcher=alltoall and ep={mesh.ep} a multiple of it")
    check_choice("parallel.expert_dispatcher", dispatcher, DISPATCHERS)
    check_gcmoe(1, chunk_tokens, ring_slots, transfer_sms)  # the ring against ep: after the agreement check
    if decode_tokens < 1:
        raise ValueError(f"decode_tokens={decode_tokens} must be >= 1 (tokens per rank per decode round)")
    layers = [model] if isinstance(model, MoELayer) else model.moe_layers()  # a bare layer or a model
    ep = mesh.ep
    if ep == 1:
        for moe in layers:
            _mark_expert_params(moe.experts)
        return model
    _check_ep_agreement(mesh, dispatcher, chunk_tokens, ring_slots, decode_tokens)
    ep_rank, group = mesh.coord("ep"), mesh.group("ep")
    channel = None
    if dispatcher == "gcmoe":  # one transfer group/thread model shared by all layers of this rank
        channel = TransferChannel(transfer_group(mesh, transfer_sms), mesh.ranks["ep"], mesh.device, transfer_sms)
    buffers = DecodeBuffers(decode_tokens) if dispatcher == "gcmoe_decode" else None  # shared by all layers
    for moe in layers:
        E = moe.experts.num_global_experts
        shard_experts(moe, ep, ep_rank)
        if dispatcher == "alltoall":
            moe.set_dispatcher(AllToAllDispatcher(group, ep, E, fold=tp_fold))
        elif dispatcher == "gcmoe_decode":
            moe.set_dispatcher(GCMoEDecodeDispatcher(group, ep, E, ep_rank, mesh.ranks["ep"], buffers))
        else:
            gc = GCMoEDispatcher(group, ep, E, channel, chunk_tokens, gcmoe_compute, ring_slots)
            gc.timeout_s = mesh.timeout_s  # its waits end with the groups' timeout
            moe.set_dispatcher(gc)
    return model


def gather_expert_params(model: nn.Module, mesh: ParallelMesh) -> dict[str, torch.Tensor]:
    """Full expert weights {name: [E, ...]} (names as in the unsplit model), on every ep rank.

    Collective over the ep group: call it on every rank. Tensors are detached copies."""
    full: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not (isinstance(module, MoELayer)):
            continue
        prefix = f"{name}.experts." if name else "experts."
        for pname, p in module.experts.named_parameters():
            local = p.detach().contiguous()
            if mesh.ep > 1:
                parts = [torch.empty_like(local) for _ in range(mesh.ep)]
                dist.all_gather(parts, local, group=mesh.group("ep"))
                local = torch.cat(parts, dim=0)
            full[prefix + pname] = local.clone()
    return full
