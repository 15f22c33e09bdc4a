"""The one model-cut sequence: which part of the model a rank holds, cut in one order.

    pipeline, tp_plan = cut_model(model, cfg, mesh=trainer_mesh, materialize=init)   # the Trainer
    cut_model(meta_model, cfg, ranks=RankCoords(pp=1, ep=0, tp=1))                     # the memory planner

On a model still on the meta device: the experts over ep (and their edp marks), the pipeline chunks,
then — after ``materialize`` where the trainer initialises only what this rank kept — the experts'
ffn dim over etp and the dense weights over tp. With a mesh every cut is the collective one (the
ep dispatcher, the pipeline runner, the tp/etp groups and hooks); without, the same cuts are made
for the given rank coordinates by shape alone (no process group; nothing materialised), so the
planner counts exactly the parameters the trainer holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from megatron_fp4.parallel.moe import expert_parallel as ep_mod
from megatron_fp4.parallel.moe.expert_tensor_parallel import apply_expert_tensor_parallel
from megatron_fp4.parallel.pipeline import PLACEMENT, PipelineRunner, build_chunks
from megatron_fp4.parallel.tensor_parallel import parallelize_tp


@dataclass(frozen=True)
class RankCoords:
    """A rank's place on the axes that cut the model (the planner's: no process group)."""
    pp: int = 0
    ep: int = 0
    tp: int = 0


def moe_tokens(cfg, tp: int) -> str:
    """The tokens a tp rank's MoE layers route (``parallel.moe_tp_tokens``; "whole" without tp)."""
    return cfg.parallel.moe_tp_tokens if tp > 1 else "whole"


def cut_model(model, cfg, mesh=None, ranks: Optional[RankCoords] = None,
              materialize: Optional[Callable] = None) -> tuple:
    """Cut `model` (meta device) to one rank's part, in the one order (module doc); returns
    (pipeline runner or None, tp plan or None) — both None without a mesh."""
    if (mesh is None) == (ranks is None):
        raise ValueError("cut_model: give the trainer's mesh (collective cut) or the rank coordinates (by shape)")
    p = cfg.parallel
    pp, ep, etp, tp = (mesh.pp, mesh.ep, mesh.etp, mesh.tp) if mesh is not None else (p.pp, p.ep, p.etp, p.tp)
    if ep > 1 or etp > 1:  # (ep 1: only marks the experts edp params)
        if mesh is not None:  # moe_tp_tokens=local with ep holding whole tp groups: the dispatcher folds tp
            fold = mesh.tp if moe_tokens(cfg, tp) == "local" and mesh.ep % mesh.tp == 0 else 1
            ep_mod.apply_expert_parallel(model, mesh, dispatcher=p.expert_dispatcher, chunk_tokens=p.gcmoe_chunk_tokens,
                                         transfer_sms=p.gcmoe_transfer_sms, ring_slots=p.gcmoe_ring_slots, tp_fold=fold)
        else:  # the same split without the collective agreement check and dispatcher (neither owns a parameter)
            for moe in model.moe_layers():
                ep_mod.shard_experts(moe, ep, ranks.ep)
    pipeline = None
    if pp > 1:
        if mesh is not None:
            pipeline = PipelineRunner(model, mesh, p.schedule, p.virtual_stages)
        else:
            build_chunks(model, pp, ranks.pp, p.virtual_stages, PLACEMENT.get(p.schedule, "loop"))
    if materialize is not None:
        materialize(model)
    if etp > 1:  # cut materialised experts (their init draws whole matrices); etp group = tp group
        if mesh is not None:
            apply_expert_tensor_parallel(model, mesh.group("etp"), replicated=True)
        else:
            for moe in model.moe_layers():
                moe.set_experts(moe.experts.shard_ffn(etp, ranks.tp, shapes_only=True))
    tp_plan = None
    if tp > 1:  # cut after init: each shard is then the single process's slice by construction
        if mesh is not None:
            tp_plan = parallelize_tp(model, mesh.group("tp"), sequence_parallel=p.sequence_parallel,
                                     moe_tokens=p.moe_tp_tokens)
        else:
            parallelize_tp(model, None, p.sequence_parallel, moe_tokens=p.moe_tp_tokens, size_rank=(tp, ranks.tp))
    return pipeline, tp_plan
