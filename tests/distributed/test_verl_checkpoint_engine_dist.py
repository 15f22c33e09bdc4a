"""verl checkpoint engine "megatron_fp4" across processes, deployed the way verl deploys it.

Rank 0 is the actor (a model), ranks 1.. are rollouts (MegatronFP4Rollout over a RolloutEngine
that keeps generating on its main thread while updates arrive on another). verl's controller is
emulated on the default gloo group: every worker's `prepare()` is all-gathered, each worker takes
its column of `build_topology`, then `init_process_group` builds the engine's own group (a
TCPStore + ProcessGroupGloo; the 3-process run destroys the default group first to show it is
not needed). As in verl, the group is rebuilt per cycle (prepare → init → sync → finalize).

Checks: versions arrive whole and bit-exact (sha256 of every tensor); the first completion point
lets the actor change its weights while the snapshot is delivered; a mismatched version is
rejected (by the engine's load, or from the manifest with `validator=`) with the rollout keeping
its version and the actor getting WeightSyncError naming the rollout and the version; the next
version loads after a failure. Sync latency (snapshot vs load) is printed.
"""
import asyncio
import hashlib
import threading

import pytest
import torch
import torch.distributed as dist

from tests.distributed.launch import run_distributed

import verl  # noqa: F401,E402 - the test extra installs it: a missing package fails, never skips
pytestmark = pytest.mark.distributed


def _model(seed):
    from megatron_fp4.config import Config
    from megatron_fp4.model import build_model
    cfg = Config()
    cfg.model.vocab_size = 18
    return build_model(cfg, seed=seed)


def _digest(named) -> str:
    h = hashlib.sha256()
    for name, t in named:
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _join(engine, rank, num_rollouts):
    """verl's CheckpointEngineManager.build_process_group, with the default group as the controller."""
    metadata = [None] * dist.get_world_size()
    # verl's controller moves prepare()'s dicts over Ray (the trusted launcher); emulated here on the
    # test's own default group. The weight sync itself never uses object collectives.
    dist.all_gather_object(metadata, engine.prepare())
    actor_kw, rollout_kw = type(engine).build_topology(1, num_rollouts, metadata)
    kw, i = (actor_kw, 0) if rank == 0 else (rollout_kw, rank - 1)
    kw = {k: v[i] for k, v in kw.items()}
    return kw


def _actor(rank, cycles, num_rollouts, drop_default_group):
    from megatron_fp4.verl import MegatronFP4CheckpointEngine
    from megatron_fp4.rollout import WeightSyncError

    model = _model(1)
    snapshots = []
    ce = MegatronFP4CheckpointEngine(bucket_size=16 << 10, timeout_s=60, master_addr="127.0.0.1",
                                     on_snapshot=lambda h: snapshots.append(h.version))
    out = {"digests": {}, "latency": [], "rejected": {}, "modes": []}

    async def step(tag):
        version = int(tag[-1])
        if tag.startswith("bad"):  # a wrong shape: must be rejected, nothing overwritten
            sd = dict(model.state_dict())
            sd["norm.weight"] = torch.ones(5)
            try:
                await ce.send_weights(iter(sd.items()), global_steps=version)
            except WeightSyncError as err:
                out["rejected"][version] = (str(err), dict(err.failures), err.version)
            return
        if tag.startswith("pub"):  # first completion point: training continues while the rollouts load
            handle = await ce.publish(iter(model.state_dict().items()), global_steps=version)
            out["digests"][version] = _digest(model.state_dict().items())
            with torch.no_grad():
                model.norm.weight.mul_(2.0)
            await ce.wait_loaded(handle)
            out["changed_after_snapshot"] = _digest(model.state_dict().items()) != out["digests"][version]
            out["latency"].append((handle.snapshot_s, handle.load_s, handle.num_bytes))
            return
        out["digests"][version] = _digest(model.state_dict().items())
        m = await ce.send_weights(iter(model.state_dict().items()), global_steps=version)
        out["latency"].append((m["weight_sync/snapshot_s"], m["weight_sync/load_s"], m["weight_sync/bytes"]))

    for plan in cycles:
        kw = _join(ce, rank, num_rollouts)
        out["modes"].append((kw["rank"], kw["mode"]))
        if drop_default_group:
            dist.destroy_process_group()
        ce.init_process_group(**kw)
        for tag in plan:
            asyncio.run(step(tag))
        ce.finalize()
    out["snapshots"] = snapshots
    return out


def _rollout(rank, cycles, num_rollouts, drop_default_group, validate):
    from megatron_fp4.verl import MegatronFP4CheckpointEngine, MegatronFP4Rollout
    from megatron_fp4.rollout import RolloutEngine, SamplingParams, WeightSyncError

    engine = RolloutEngine(_model(2), mode="fp4_resq", name=f"engine-rank{rank}")
    rollout = MegatronFP4Rollout(engine=engine)
    ce = MegatronFP4CheckpointEngine(bucket_size=16 << 10, timeout_s=60,
                                     validator=engine.check_weights if validate else None)
    out = {"loaded": [], "failed": [], "digests": {}, "modes": []}
    kws = []
    joined = [threading.Event() for _ in cycles]
    finalized = [threading.Event() for _ in cycles]

    def sync():
        async def main():
            for i, plan in enumerate(cycles):
                joined[i].wait(120)
                ce.init_process_group(**kws[i])
                for _ in plan:
                    stream = ce.receive_weights()
                    try:
                        await rollout.update_weights(stream)
                        out["loaded"].append(engine.version)
                        out["digests"][engine.version] = _digest(engine.model.state_dict().items())
                    except (ValueError, WeightSyncError) as err:
                        out["failed"].append((stream.version, type(err).__name__, str(err), engine.version))
                ce.finalize()
                finalized[i].set()
        try:
            asyncio.run(main())
        except BaseException as err:  # noqa: BLE001 - surfaced by the main thread
            out["error"] = err
            for e in finalized:
                e.set()

    # The controller's part (default group) stays on the main thread and, as in verl, prepares the
    # next cycle only after the previous one is finalized; generation runs in between.
    thread = threading.Thread(target=sync, daemon=True)
    for i, _ in enumerate(cycles):
        kws.append(_join(ce, rank, num_rollouts))
        out["modes"].append((kws[-1]["rank"], kws[-1]["mode"]))
        if drop_default_group:
            dist.destroy_process_group()
        joined[i].set()
        if i == 0:
            thread.start()
        while not finalized[i].is_set():
            out.setdefault("seen", []).append(  # generation continues while the versions arrive
                engine.generate([[1, 4, 5, 15]], SamplingParams(max_new_tokens=2, temperature=0)).version)
    thread.join(120)
    if "error" in out:
        raise out.pop("error")
    return out


def _worker(rank, world_size, cycles, drop_default_group=False, validate=False):
    if rank == 0:
        return _actor(rank, cycles, world_size - 1, drop_default_group)
    return _rollout(rank, cycles, world_size - 1, drop_default_group, validate)


def test_two_processes_versions_mismatch_and_rebuilt_group():
    cycles = [["v1", "pub2"], ["bad3", "v4"]]
    actor, rollout = run_distributed(_worker, world_size=2, args=(cycles,), timeout_s=300)
    assert actor["modes"] == [(0, "dist")] * 2 and rollout["modes"] == [(1, "dist")] * 2
    assert rollout["loaded"] == [1, 2, 4]
    for v in (1, 2, 4):  # bit-exact, and v2 is the snapshot, not the weights changed after point 1
        assert rollout["digests"][v] == actor["digests"][v]
    assert actor["changed_after_snapshot"] and actor["snapshots"] == [1, 2, 3, 4]
    (version, kind, msg, kept), = rollout["failed"]
    assert version == 3 and kind == "ValueError" and "rejects the weights" in msg and kept == 2
    text, failures, err_version = actor["rejected"][3]
    assert err_version == 3 and "version 3" in text and "norm.weight" in failures["rollout0"]
    seen = rollout.get("seen", [])
    assert seen and seen == sorted(seen) and set(seen) <= {0, 1, 2, 4}
    for snapshot_s, load_s, num_bytes in actor["latency"]:
        assert snapshot_s > 0 and load_s > 0 and num_bytes > 0
    print("megatron_fp4 CE, 1 actor -> 1 rollout (snapshot_s, load_s, bytes):", actor["latency"])


def test_three_processes_one_actor_two_rollouts_without_default_group():
    cycles = [["v1", "pub2", "bad3"]]
    actor, *rollouts = run_distributed(_worker, world_size=3, args=(cycles, True, True), timeout_s=300)
    for r, out in enumerate(rollouts):
        assert out["modes"] == [(r + 1, "dist")]
        assert out["loaded"] == [1, 2] and out["digests"] == {v: actor["digests"][v] for v in (1, 2)}
        (version, kind, _, kept), = out["failed"]  # rejected from the manifest: no bucket was sent
        assert version == 3 and kind == "WeightSyncError" and kept == 2
    text, failures, err_version = actor["rejected"][3]
    assert err_version == 3 and set(failures) == {"rollout0", "rollout1"}
    assert all("norm.weight" in why for why in failures.values())
    print("megatron_fp4 CE, 1 actor -> 2 rollouts (snapshot_s, load_s, bytes):", actor["latency"])


def test_build_topology_single_sender_and_mode():
    from megatron_fp4.verl import MegatronFP4CheckpointEngine as CE
    meta = [{"process": f"h:{i}", "channel": "c", "addr": "a", "port": 1} for i in range(5)]
    actor, rollout = CE.build_topology(2, 3, meta)
    assert actor["rank"] == [0, -1] and rollout["rank"] == [1, 2, 3]
    assert set(actor["world_size"] + rollout["world_size"]) == {4}
    assert set(actor["mode"] + rollout["mode"]) == {"dist"} and rollout["master_metadata"][2] is meta[0]
    same = [dict(m, process="h:1") for m in meta[:2]]
    assert CE.build_topology(1, 1, same)[0]["mode"] == ["inprocess"]
    with pytest.raises(ValueError, match="prepare"):
        CE.build_topology(1, 2, meta[:2])
    ce = CE()
    ce.init_process_group(rank=-1, world_size=4, master_metadata=meta[0], mode="dist")
    assert asyncio.run(ce.send_weights(iter([("w", torch.ones(2))]), global_steps=1)) == {}  # drains, sends nothing
