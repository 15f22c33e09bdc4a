"""Publishing HF weights from a tensor-parallel trainer (tp2 × pp2 on 4 gloo ranks, fp64): the rollout
receives the single-process model's whole tensors under HF Qwen3-MoE names (also with expert-tensor
parallel etp 2: the experts' ffn slices gathered).

At init bitwise (tp shards are slices of the single-process init and the gather only moves bytes);
after one step within FP64_REL (tests/numerics.py: the tp partial sums add in another order).
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run_distributed
from tests.distributed.test_tp_trainer import layout_cfg
from tests.distributed.test_weight_sync_sharded import Recorder
from tests.numerics import FP64_REL, rel

pytestmark = pytest.mark.distributed


def cfg_for(**parallel):
    cfg = layout_cfg(dict(kv_heads=1, **parallel))
    cfg.model.num_shared_experts = 0  # HF Qwen3-MoE has no shared expert
    return cfg


def _publish(rank, world_size, etp=1):
    from megatron_fp4.integrations.hf.sharded import local_hf_state_dict
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.rollout.weight_sync.publisher import InProcessTransport
    from megatron_fp4.rollout.weight_sync.sharded import ShardedWeightPublisher
    from megatron_fp4.training.trainer import Trainer

    trainer = Trainer(cfg_for(tp=2, pp=2, etp=etp), ParallelMesh.build(2, 1, 1, tp=2, etp=etp))
    recorder = Recorder()
    transports = [InProcessTransport(recorder)] if rank == 0 else []
    publisher = ShardedWeightPublisher(lambda: local_hf_state_dict(trainer.model), trainer.mesh, transports,
                                       16 << 10, model=trainer.model)
    publisher.publish(0).wait_loaded(timeout=120)
    trainer.train_step()
    publisher.publish(1).wait_loaded(timeout=120)
    try:
        ShardedWeightPublisher(lambda: local_hf_state_dict(trainer.model), trainer.mesh, transports, 16 << 10)
        refusal = None
    except ValueError as err:
        refusal = str(err)
    trainer.optimizer.remove_hooks()
    return dict(got=recorder.got, refusal=refusal)


@pytest.mark.parametrize("etp", [1, 2])  # etp 2: every expert's ffn slices all-gathered over etp
def test_tp2_pp2_publishes_the_single_process_weights(etp):
    from megatron_fp4.integrations.hf import to_hf_state_dict
    from megatron_fp4.training.trainer import Trainer

    results = run_distributed(_publish, 4, (etp,), timeout_s=600)
    trainer = Trainer(cfg_for())
    init = {k: v.clone() for k, v in to_hf_state_dict(trainer.model).items()}
    trainer.train_step()
    after = to_hf_state_dict(trainer.model)
    got = results[0]["got"]
    assert set(got[0]) == set(init) and set(got[1]) == set(after)
    for name, want in init.items():
        assert got[0][name].shape == want.shape and torch.equal(got[0][name], want), name
    for name, want in after.items():
        assert rel(got[1][name], want) <= FP64_REL, (name, rel(got[1][name], want))
    assert all("needs model=" in r["refusal"] for r in results)
