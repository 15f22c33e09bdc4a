"""Weight sync in one process: bucket format, two completion points, no overlap, whole versions,
faults (rollout raises / is gone, mismatched manifest) leave the rollout on its previous version."""
import json
import threading
import time
import types

import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.model import build_model
from megatron_fp4.rollout import (InProcessTransport, RolloutEngine, SamplingParams, WeightPublisher, WeightReceiver,
                                  WeightSyncError)
from megatron_fp4.rollout.weight_sync.buckets import pack_buckets, unpack_buckets


def models():
    cfg = Config()
    cfg.model.vocab_size = 18
    return build_model(cfg, seed=1), build_model(cfg, seed=2)


def bump(model, delta=0.01):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(delta)


def same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("bucket_bytes", [1, 100, 4096, 1 << 30])
def test_buckets_roundtrip_and_respect_size(bucket_bytes):
    named = [("a", torch.randn(7, 5)), ("b", torch.arange(3, dtype=torch.int64)), ("e", torch.empty(0)),
             ("h", torch.randn(4, 3).to(torch.bfloat16))]
    buckets = pack_buckets(named, bucket_bytes)
    assert all(b.buffer.numel() <= bucket_bytes for b in buckets)
    out = unpack_buckets(buckets)
    for n, t in named:
        assert out[n].dtype == t.dtype and torch.equal(out[n], t)
    with pytest.raises(ValueError, match="bucket_bytes"):
        pack_buckets(named, 0)


def test_two_completion_points_and_snapshot_is_immutable(monkeypatch):
    """... and the handle's timings are the publisher's clock at its two completion points: a fake
    clock that the snapshot advances by 0.25 s and the held load by 2 s gives exactly those."""
    from megatron_fp4.rollout.weight_sync import publisher as weight_sync
    clock = [100.0]
    monkeypatch.setattr(weight_sync, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    trainer, rollout = models()
    engine = RolloutEngine(rollout, mode="bf16")
    receiver = WeightReceiver(engine)
    gate = threading.Event()
    real_stage = receiver.stage

    def held_stage(buckets):  # hold the load; it "takes" 2 s of the publisher's clock
        gate.wait(10)
        clock[0] += 2.0
        return real_stage(buckets)
    receiver.stage = held_stage
    pub = WeightPublisher(trainer, [InProcessTransport(receiver)], bucket_bytes=8192)
    real_snapshot = pub._snapshot
    pub._snapshot = lambda: (clock.__setitem__(0, clock[0] + 0.25), real_snapshot())[1]
    expected = {k: v.clone() for k, v in trainer.state_dict().items()}
    h = pub.publish(1)
    assert h.snapshot_ready.is_set() and not h.loaded.is_set()  # first completion point only
    bump(trainer)  # training continues at once: must not leak into version 1
    assert engine.version == 0
    gate.set()
    h.wait_loaded(10)
    assert engine.version == 1 and h.ok and h.num_buckets > 1
    assert all(torch.equal(rollout.state_dict()[k], v) for k, v in expected.items())
    assert (h.snapshot_s, h.load_s, h.per_rollout_s) == (0.25, 2.0, {receiver.name: 2.0})


def test_publish_waits_for_previous_load_and_generation_sees_whole_versions():
    trainer, rollout = models()
    engine = RolloutEngine(rollout, mode="bf16")
    receiver = WeightReceiver(engine)
    order = []
    real_load = engine.load_weights

    def slow_load(tensors, version):
        order.append(("start", version))
        time.sleep(0.05)
        real_load(tensors, version)
        order.append(("end", version))
    engine.load_weights = slow_load
    pub = WeightPublisher(trainer, [InProcessTransport(receiver)])
    seen, stop = [], threading.Event()

    def generate_loop():  # concurrent requests: each sees one version whose weights match it
        while not stop.is_set():
            with engine.lock.read():
                seen.append((engine.version, float(rollout.embed_tokens.weight[0, 0].detach())))
    th = threading.Thread(target=generate_loop)
    th.start()
    marks = {}
    for v in range(1, 4):
        with torch.no_grad():
            trainer.embed_tokens.weight[0, 0] = float(v)
        marks[v] = float(v)
        pub.publish(v)
    pub.wait(10)
    stop.set()
    th.join()
    assert order == [("start", 1), ("end", 1), ("start", 2), ("end", 2), ("start", 3), ("end", 3)]
    assert engine.version == 3
    for version, value in seen:  # version and weights always agree (never half-loaded)
        assert version == 0 or value == marks[version]
    engine.generate([[1, 4, 5]], SamplingParams(max_new_tokens=2, temperature=0))


def test_rollout_that_raises_keeps_previous_version_and_publisher_gets_error():
    trainer, rollout = models()
    engine = RolloutEngine(rollout, mode="bf16", name="r-bad")
    ok_engine = RolloutEngine(models()[1], mode="bf16", name="r-ok")
    bad = WeightReceiver(engine)
    bad.stage = lambda buckets: (_ for _ in ()).throw(RuntimeError("injected loader crash"))
    pub = WeightPublisher(trainer, [InProcessTransport(bad), InProcessTransport(WeightReceiver(ok_engine))])
    before = {k: v.clone() for k, v in rollout.state_dict().items()}
    h = pub.publish(5)
    with pytest.raises(WeightSyncError, match=r"version 5.*'r-bad'.*injected loader crash") as err:
        h.wait_loaded(10)
    assert set(err.value.failures) == {"r-bad"} and err.value.version == 5
    assert engine.version == 0 and all(torch.equal(rollout.state_dict()[k], v) for k, v in before.items())
    assert ok_engine.version == 5 and same_weights(ok_engine.model, trainer)
    engine.generate([[1, 4]], SamplingParams(max_new_tokens=2, temperature=0))  # still serving v0


def test_dead_rollout_is_reported():
    trainer, rollout = models()
    engine = RolloutEngine(rollout, mode="bf16", name="r-dead")
    receiver = WeightReceiver(engine)
    receiver.close()
    h = WeightPublisher(trainer, [InProcessTransport(receiver)]).publish(2)
    with pytest.raises(WeightSyncError, match="r-dead.*shut down"):
        h.wait_loaded(10)
    assert engine.version == 0


def test_mismatch_rejected_before_any_tensor_is_overwritten():
    trainer, rollout = models()
    engine = RolloutEngine(rollout, mode="bf16", name="r0")
    receiver = WeightReceiver(engine)
    staged = []
    real_stage = receiver.stage
    receiver.stage = lambda b: staged.append(1) or real_stage(b)
    before = {k: v.clone() for k, v in rollout.state_dict().items()}
    sd = dict(trainer.state_dict())
    sd["layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)  # wrong shape
    sd["norm.weight"] = sd["norm.weight"].double()  # wrong dtype
    sd["extra.weight"] = torch.zeros(1)  # unknown name
    h = WeightPublisher(lambda: sd.items(), [InProcessTransport(receiver)]).publish(1)
    with pytest.raises(WeightSyncError, match="'r0'.*rejects the weights") as err:
        h.wait_loaded(10)
    for needle in ["unknown tensor 'extra.weight'", "q_proj.weight': got shape (3, 3)", "torch.float64"]:
        assert needle in str(err.value)
    assert not staged and engine.version == 0
    assert all(torch.equal(rollout.state_dict()[k], v) for k, v in before.items())


def test_publisher_validates_arguments():
    trainer, rollout = models()
    with pytest.raises(ValueError, match="at least one transport"):
        WeightPublisher(trainer, [])
    r = WeightReceiver(RolloutEngine(rollout))
    with pytest.raises(ValueError, match="unique"):
        WeightPublisher(trainer, [InProcessTransport(r), InProcessTransport(r)])


def _damaged_buckets(kind):
    """Buckets of one 64-byte tensor in 16-byte pieces, damaged the way `kind` says."""
    from megatron_fp4.rollout.weight_sync.buckets import Bucket, TensorMeta
    buckets = pack_buckets([("w", torch.arange(16, dtype=torch.float32))], 16)
    if kind == "out_of_order":
        return [buckets[1], buckets[0]] + buckets[2:]
    if kind == "incomplete":
        return buckets[:-1]
    m = buckets[0].metas[0]  # "overflow": a chunk that claims more bytes than its bucket holds
    return [Bucket([TensorMeta(m.name, m.shape, m.dtype, 0, 32, 0)], buckets[0].buffer)]


@pytest.mark.parametrize("kind,needle", [("out_of_order", "out of order"), ("incomplete", "incomplete"),
                                         ("overflow", "bucket")])
def test_damaged_buckets_raise_clear_errors(kind, needle):
    from megatron_fp4.rollout.weight_sync.buckets import BucketError
    with pytest.raises(BucketError, match=needle):
        unpack_buckets(_damaged_buckets(kind))


def test_bucket_checks_survive_python_O():
    """`python -O` strips asserts: the integrity checks must be real ones."""
    import os
    import subprocess
    import sys
    code = ("from tests.unit.test_weight_sync import _damaged_buckets\n"
            "from megatron_fp4.rollout.weight_sync.buckets import unpack_buckets\n"
            "assert False, 'asserts must be stripped in this run'\n"
            "for kind in ('out_of_order', 'incomplete', 'overflow'):\n"
            "    try:\n"
            "        unpack_buckets(_damaged_buckets(kind))\n"
            "        print(kind, 'ACCEPTED')\n"
            "    except ValueError as err:\n"
            "        print(kind, 'REFUSED', type(err).__name__)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, env=env, cwd=root,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == [f"{k} REFUSED BucketError" for k in ("out_of_order", "incomplete",
                                                                                "overflow")], out.stdout


def test_json_header_roundtrip_and_refusals():
    from megatron_fp4.rollout.weight_sync.buckets import (BucketError, bucket_layout, layout_from_json, layout_to_json,
                                                          manifest_from_json, manifest_of, manifest_to_json)
    named = [("a", torch.randn(7, 5)), ("h", torch.randn(4, 3).to(torch.bfloat16)), ("e", torch.empty(0))]
    buckets = pack_buckets(named, 50)
    layout = bucket_layout(buckets)
    assert layout_from_json(json.loads(json.dumps(layout_to_json(layout)))) == layout
    manifest = manifest_of(named)
    assert manifest_from_json(json.loads(json.dumps(manifest_to_json(manifest)))) == manifest
    for bad in ([["a", [2], "os.system"]], [["a", [-1], "float32"]], [["a", [True], "float32"]], {"a": 1}):
        with pytest.raises(BucketError):
            manifest_from_json(bad)
    with pytest.raises(BucketError, match="ends at byte"):
        layout_from_json([[[["a", [2], "float32", 0, 8, 4]], 8]])


def test_a_request_that_never_returns_fails_the_update_instead_of_hanging_it():
    """A reader holds the engine lock forever: the update fails with an error naming the lock and
    its setting, publish(2) returns, and requests are still served (before: all hung forever)."""
    trainer, rollout = models()
    engine = RolloutEngine(rollout, mode="bf16", name="r-stuck", lock_timeout_s=0.3)
    held, release = threading.Event(), threading.Event()

    def stuck_request():
        with engine.lock.read():
            held.set()
            release.wait()
    threading.Thread(target=stuck_request, daemon=True).start()
    assert held.wait(30)
    pub = WeightPublisher(trainer, [InProcessTransport(WeightReceiver(engine))], timeout_s=60)
    results = []

    def two_updates():
        for v in (1, 2):
            try:
                pub.publish(v).wait_loaded(60)
                results.append((v, None))
            except (WeightSyncError, TimeoutError) as err:
                results.append((v, err))
    th = threading.Thread(target=two_updates, daemon=True)
    th.start()
    th.join(120)
    assert [v for v, _ in results] == [1, 2], results  # publish(2) returned
    for _, err in results:
        assert isinstance(err, WeightSyncError) and "'r-stuck'" in str(err) and "LockTimeout" in str(err)
        assert "RolloutEngine(lock_timeout_s=...)" in str(err) and "held the read lock" in str(err)
    out = engine.generate([[1, 4]], SamplingParams(max_new_tokens=1, temperature=0))
    assert out.version == 0  # still serving the previous version
    release.set()


def test_publish_times_out_when_the_previous_version_never_finishes():
    trainer, _ = models()

    class StuckTransport:
        name = "r-hung"

        def __init__(self):
            self.release = threading.Event()

        def send(self, version, manifest, buckets):
            self.release.wait()
    transport = StuckTransport()
    pub = WeightPublisher(trainer, [transport], timeout_s=0.3)
    pub.publish(1)
    box = []
    th = threading.Thread(target=lambda: box.append(_raises(lambda: pub.publish(2))), daemon=True)
    th.start()
    th.join(60)
    assert box and isinstance(box[0], TimeoutError), box
    for needle in ("publish(2)", "version 1", "WeightPublisher(timeout_s=...)", "'r-hung'", "Nothing was published"):
        assert needle in str(box[0])
    assert [h.version for h in pub.history] == [1]
    transport.release.set()
    pub.wait(30)
    pub.publish(3).wait_loaded(30)  # recovers once the rollout does
    with pytest.raises(ValueError, match="timeout_s"):
        WeightPublisher(trainer, [transport], timeout_s=0)


def _raises(fn):
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - returned for the test to inspect
        return err
