"""The memory planner under tensor parallel (``parallel.tp``, ``sequence_parallel``, ``etp``,
``moe_tp_tokens``): its per-rank parameter, gradient and optimizer bytes equal the tensors a real
tp `Trainer` holds after one step on a gloo mesh, exactly (helpers of tests/unit/test_memory_plan.py);
the planner cuts the meta model with `parallelize_tp` itself (``size_rank``)."""
import pytest
import torch

from megatron_fp4.config import default_config_path, load_config
from megatron_fp4.training.memory_plan import plan_memory
from tests.distributed.launch import run_distributed
from tests.unit.test_memory_plan import TINY, _one_step, _planned, _real_state_bytes


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
