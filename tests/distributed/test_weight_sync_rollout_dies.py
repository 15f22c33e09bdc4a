"""A rollout process that dies mid-load: the trainer gets a WeightSyncError naming the group and
the version (no hang), and its own weights are untouched."""
import os

import pytest
import torch
import torch.distributed as dist

from tests.distributed.launch import run_distributed
from tests.distributed.test_weight_sync_dist import _checksum, _model

pytestmark = pytest.mark.distributed


def _worker(rank, world_size):
    from megatron_fp4.rollout import RolloutEngine, WeightPublisher, WeightReceiver, WeightSyncError
    from megatron_fp4.rollout.weight_sync.distributed import DistributedReceiver, DistributedTransport

    group = dist.new_group([0, 1], backend="gloo", timeout=__import__("datetime").timedelta(seconds=60))
    if rank == 0:
        trainer = _model(1)
        pub = WeightPublisher(trainer, [DistributedTransport(group, src=0)], bucket_bytes=16 << 10)
        pub.publish(1).wait_loaded(60)
        before = _checksum(trainer)
        try:
            pub.publish(2).wait_loaded(120)
        except WeightSyncError as err:
            return {"error": str(err), "version": err.version, "failures": dict(err.failures),
                    "unchanged": _checksum(trainer) == before}
        return {"error": None}
    receiver = WeightReceiver(RolloutEngine(_model(2), mode="fp4_resq", name="rollout-rank1"))
    real_load = receiver.load

    def load(version, manifest, buckets):
        if version == 2:
            os._exit(17)  # the rollout process dies while loading version 2
        return real_load(version, manifest, buckets)
    receiver.load = load
    DistributedReceiver(receiver, group, src=0).serve_forever()


def test_rollout_process_death_reaches_the_publisher():
    trainer, rollout = run_distributed(_worker, world_size=2, timeout_s=240, may_die=frozenset({1}))
    assert rollout is None
    assert trainer["error"] is not None and trainer["version"] == 2, trainer
    assert "version 2" in trainer["error"] and trainer["unchanged"]
    (group_name, reason), = trainer["failures"].items()
    assert "dist-group" in group_name and reason
