"""Cross-process weight sync: trainer = rank 0, rollout = rank 1, gloo, dedicated group.

Checks (one spawn for all, the CI box has 2 cores): versions load whole and bit-exact while the
rollout keeps generating on its main thread; a manifest mismatch is rejected before any bucket
is sent; a rollout that raises while loading keeps its previous version and the trainer gets a
WeightSyncError naming it and the version; publish (snapshot) vs load latency is recorded.
"""
import pytest
import torch
import torch.distributed as dist

from tests.distributed.launch import run_distributed

pytestmark = pytest.mark.distributed


def _model(seed):
    from megatron_fp4.config import Config
    from megatron_fp4.model import build_model
    cfg = Config()
    cfg.model.vocab_size = 18
    return build_model(cfg, seed=seed)


def _checksum(model):
    return [float(t.double().sum()) for t in model.state_dict().values()]


def _worker(rank, world_size):
    from megatron_fp4.rollout import RolloutEngine, SamplingParams, WeightPublisher, WeightReceiver, WeightSyncError
    from megatron_fp4.rollout.weight_sync.distributed import DistributedReceiver, DistributedTransport

    group = dist.new_group([0, 1], backend="gloo")  # dedicated: never mixes with training traffic
    if rank == 0:
        trainer = _model(1)
        transport = DistributedTransport(group, src=0)
        pub = WeightPublisher(trainer, [transport], bucket_bytes=16 << 10)
        result = {"latency": []}
        h = pub.publish(1).wait_loaded(60)
        result["latency"].append((h.snapshot_s, h.load_s, h.num_buckets, h.num_bytes))
        result["v1"] = _checksum(trainer)
        with torch.no_grad():
            trainer.norm.weight.mul_(2.0)
        h = pub.publish(2).wait_loaded(60)
        result["latency"].append((h.snapshot_s, h.load_s, h.num_buckets, h.num_bytes))
        result["v2"] = _checksum(trainer)
        # 3: wrong shape -> rejected from the manifest
        sd = dict(trainer.state_dict())
        sd["norm.weight"] = torch.ones(5)
        bad_pub = WeightPublisher(lambda: sd.items(), [transport], bucket_bytes=16 << 10)
        try:
            bad_pub.publish(3).wait_loaded(60)
        except WeightSyncError as err:
            result["mismatch"] = (str(err), dict(err.failures))
        # 4: the rollout raises while loading (injected on rank 1)
        with torch.no_grad():
            trainer.norm.weight.mul_(3.0)
        try:
            pub.publish(4).wait_loaded(60)
        except WeightSyncError as err:
            result["crash"] = (str(err), dict(err.failures), err.version)
        transport.close()
        dist.barrier(group)
        return result
    engine = RolloutEngine(_model(2), mode="fp4_resq", name="rollout-rank1")
    receiver = WeightReceiver(engine)
    real_stage = receiver.stage

    def stage(buckets):  # the 4th update fails mid-load
        if len(server.versions) + len(server.errors) == 3:
            raise RuntimeError("injected: rollout crashed while loading")
        return real_stage(buckets)
    receiver.stage = stage
    server = DistributedReceiver(receiver, group, src=0).start()
    generated = 0
    while server._thread.is_alive():  # generation continues while updates arrive
        engine.generate([[1, 4, 5, 15]], SamplingParams(max_new_tokens=2, temperature=0))
        generated += 1
    server.join()
    dist.barrier(group)
    return {"versions": server.versions, "errors": server.errors, "final_version": engine.version,
            "checksum": _checksum(engine.model), "generated": generated}


def test_cross_process_weight_sync():
    trainer, rollout = run_distributed(_worker, world_size=2, timeout_s=240)
    assert rollout["versions"] == [1, 2]
    assert rollout["final_version"] == 2  # kept serving v2 after the failed v4
    assert rollout["checksum"] == trainer["v2"] != trainer["v1"]
    msg, failures = trainer["mismatch"]
    assert "version 3" in msg and "rollout-rank1" in failures and "norm.weight" in failures["rollout-rank1"]
    msg, failures, version = trainer["crash"]
    assert version == 4 and "injected" in failures["rollout-rank1"]
    assert [v for v, _ in rollout["errors"]] == [3, 4]
    assert rollout["generated"] >= 1
    for snapshot_s, load_s, num_buckets, num_bytes in trainer["latency"]:
        assert snapshot_s > 0 and load_s > 0 and num_buckets > 1 and num_bytes > 0
    print("publish(snapshot) vs load latency [s]:", trainer["latency"])
