"""Publishing from a sharded trainer (pp2 × dp2 with ep2, 4 gloo processes): the rollout receives
exactly the single-process model's weights under HF Qwen3-MoE names, gathered bucket by bucket.

- at init: bitwise (every layout starts from the single-process weights by construction, and the
  gather only moves bytes);
- after one LM step: within ``FP64_REL`` (float64 run; tests/numerics.py derives the bound);
- memory: each rank snapshots only the tensors it owns (replicas are sent once: the owned shares
  add up to the model exactly), and the source never holds more than two gathered buckets (the
  one its transport is sending, still referenced by the consumer's loop, and the next).
"""
import concurrent.futures

import pytest
import torch

from tests.distributed.launch import run_distributed
from tests.distributed.test_parallel_training import tiny_cfg
from tests.numerics import FP64_REL, rel

BUCKET_BYTES = 64 << 10


class Recorder:
    """A rollout that keeps what it was sent (through the real wire format's unpacking)."""

    name = "recorder"

    def __init__(self):
        self.got = {}

    def submit(self, version, manifest, buckets):
        from megatron_fp4.rollout.weight_sync.buckets import manifest_of, unpack_buckets

        future = concurrent.futures.Future()
        staged = unpack_buckets(buckets)
        assert manifest_of(staged.items()) == manifest
        self.got[version] = staged
        future.set_result(None)
        return future


def _publish(rank, world_size):
    from megatron_fp4.integrations.hf.sharded import local_hf_state_dict
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.rollout.weight_sync.publisher import InProcessTransport
    from megatron_fp4.rollout.weight_sync.sharded import ShardedWeightPublisher
    from megatron_fp4.training.trainer import Trainer

    cfg = tiny_cfg(pp=2, ep=2)
    trainer = Trainer(cfg, ParallelMesh.build(2, 2, 2))
    recorder = Recorder()
    transports = [InProcessTransport(recorder)] if rank == 0 else []
    publisher = ShardedWeightPublisher(lambda: local_hf_state_dict(trainer.model), trainer.mesh, transports,
                                       BUCKET_BYTES)
    local_bytes = sum(t.numel() * t.element_size() for t in local_hf_state_dict(trainer.model).values())
    publisher.publish(0).wait_loaded(timeout=120)
    owned = [publisher.snapshot_bytes]
    trainer.train_step()
    publisher.publish(1).wait_loaded(timeout=120)
    owned.append(publisher.snapshot_bytes)
    live = [g.max_live_bytes for g in publisher.gathered]
    trainer.optimizer.remove_hooks()
    return dict(got=recorder.got, owned=owned, local_bytes=local_bytes, live=live,
                total=sum(m[1].itemsize * torch.Size(m[0]).numel() for m in publisher.manifest.values()))


@pytest.fixture(scope="module")
def reference():
    from megatron_fp4.integrations.hf import to_hf_state_dict
    from megatron_fp4.training.trainer import Trainer

    trainer = Trainer(tiny_cfg())
    init = {k: v.clone() for k, v in to_hf_state_dict(trainer.model).items()}
    trainer.train_step()
    return init, {k: v.clone() for k, v in to_hf_state_dict(trainer.model).items()}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_publish, 4, timeout_s=600)


def test_rollout_receives_the_single_process_weights(reference, results):
    init, after = reference
    got = results[0]["got"]
    assert set(got) == {0, 1}
    assert set(got[0]) == set(init) and set(got[1]) == set(after)
    assert any(".experts.7." in k for k in got[0])  # experts of both ep ranks, global ids
    for name, want in init.items():
        assert torch.equal(got[0][name], want), name
    for name, want in after.items():
        assert rel(got[1][name], want) <= FP64_REL, (name, rel(got[1][name], want))
    assert any(not torch.equal(after[n], init[n]) for n in init)  # the step moved the weights


def test_no_rank_holds_more_than_its_share(results):
    total = results[0]["total"]
    assert total > 8 * BUCKET_BYTES  # many buckets
    for version in range(2):
        assert sum(r["owned"][version] for r in results) == total  # replicas sent once
    for r in results:
        assert all(o <= r["local_bytes"] < total for o in r["owned"])
    assert results[0]["live"] and all(0 < live <= 2 * BUCKET_BYTES for live in results[0]["live"])
