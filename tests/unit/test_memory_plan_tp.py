"""The memory planner under tensor parallel (``parallel.tp``, ``sequence_parallel``, ``etp``,
``moe_tp_tokens``): its per-rank parameter, gradient and optimizer bytes equal the tensors a real
tp `Trainer` holds after one step on a gloo mesh, exactly (helpers of tests/unit/test_memory_plan.py);
the planner cuts the meta model with `parallelize_tp` itself (``size_rank``); and its activation bytes
equal the tensors autograd saves in a real tp forward (saved_tensors_hooks, as test_memory_plan.py)."""
import pytest
import torch

from megatron_fp4.config import default_config_path, load_config
from megatron_fp4.training.memory_plan import chunk_activation_bytes, fp4_weight_bytes, local_meta_model, plan_memory
from tests.distributed.launch import run_distributed
from tests.unit.test_memory_plan import TINY, _one_step, _planned, _real_state_bytes, _saved_bytes


def _rank_state_tp(rank, world, overrides):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    cfg = load_config(default_config_path(), TINY + overrides)
    p = cfg.parallel
    mesh = ParallelMesh.build(p.pp, world // (p.pp * p.tp), p.ep, tp=p.tp, etp=p.etp, device=torch.device("cpu"))
    trainer = Trainer(cfg, mesh, build_data=False)
    _one_step(trainer)
    return trainer.mesh.coord("pp"), _real_state_bytes(trainer)


@pytest.mark.distributed
@pytest.mark.parametrize("world, overrides", [
    (2, ["parallel.tp=2"]),
    (2, ["parallel.tp=2", "parallel.sequence_parallel=false", "dtype=bf16", "model.dense_layers=[0]"]),
    (2, ["parallel.tp=2", "parallel.etp=2", "parallel.zero_stage=2"]),
    (4, ["parallel.tp=2", "parallel.pp=2", "model.tie_embeddings=true"]),
    (4, ["parallel.tp=2", "parallel.ep=2", "parallel.moe_tp_tokens=local", "model.num_shared_experts=1"]),
])
def test_state_bytes_tp_exact(world, overrides):
    cfg = load_config(default_config_path(), TINY + overrides)
    plans = plan_memory(cfg, world)
    assert sum(len(p.ranks) for p in plans) == world
    for pp_rank, real in run_distributed(_rank_state_tp, world, args=(overrides,)):
        assert _planned(plans[pp_rank]) == real, (pp_rank, overrides)


def _rank_saved(rank, world, overrides):
    import torch.distributed as dist

    from megatron_fp4.parallel.moe.expert_tensor_parallel import apply_expert_tensor_parallel
    from megatron_fp4.parallel.tensor_parallel import parallelize_tp

    cfg = load_config(default_config_path(), TINY + overrides)
    s, m, p = cfg.schedule, cfg.model, cfg.parallel
    tokens = torch.randint(0, m.vocab_size, (s.micro_batch_size, s.seq_len), generator=torch.Generator().manual_seed(1))

    def cut(model):
        if p.etp > 1:  # the trainer's order: experts cut over etp before tp
            apply_expert_tensor_parallel(model, dist.group.WORLD, replicated=True)
        plan = parallelize_tp(model, dist.group.WORLD, p.sequence_parallel, moe_tokens=p.moe_tp_tokens)
        return plan.loss

    measured, routing = _saved_bytes(cfg, tokens, cut)
    meta = local_meta_model(cfg, 0, 0, rank)
    planned = chunk_activation_bytes(cfg, meta, range(m.num_layers), True, True, s.micro_batch_size, s.seq_len)
    planned += fp4_weight_bytes(meta)
    empty = sum(m.num_experts - len(torch.unique(r)) for r in routing if r is not None)
    return planned, measured, empty


@pytest.mark.distributed
@pytest.mark.parametrize("overrides", [
    ["fp4.scope=none"],
    ["parallel.sequence_parallel=false", "model.dense_layers=[0]", "model.num_shared_experts=1"],
    ["parallel.moe_tp_tokens=local", "fp4.scope=none", "model.num_shared_experts=1", "dtype=bf16"],
    ["model.num_kv_heads=1", "dtype=fp64"],
    ["parallel.etp=2", "model.dense_layers=[0]"],
])
def test_activation_bytes_tp_match_saved_tensors(overrides):
    """Saved tensors of one tp forward + vocab-parallel loss (`_saved_bytes`, the real `parallelize_tp`
    over gloo) against the planner's, on each rank. Bound as in test_memory_plan.py: planned −
    measured lies in [0, Q(W) of the experts the router left empty on this rank] (0 without FP4)."""
    cfg = load_config(default_config_path(), TINY + ["parallel.tp=2"] + overrides)
    m = cfg.model
    per_expert_qw = (3 * m.moe_ffn_hidden_size // cfg.parallel.etp * m.hidden_size * 4) if cfg.fp4.scope != "none" else 0
    for planned, measured, empty in run_distributed(_rank_saved, 2, args=(["parallel.tp=2"] + overrides,)):
        assert 0 <= planned - measured <= empty * per_expert_qw, (planned, measured, empty, overrides)
