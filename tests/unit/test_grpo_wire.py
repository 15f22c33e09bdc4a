"""The rollout process's boundary (megatron_fp4/rl): generations travel as JSON + tensors and come
back exactly; malformed messages are refused as data errors; weights under HF names are checked
in full before anything is loaded; a pickle sent on the path is refused, never unpickled."""
import collections

import pytest
import torch

from megatron_fp4.rollout import RolloutEngine, SamplingParams
from megatron_fp4.parallel.wire import ProtocolError


class Loopback:
    """Both ends of a 2-rank peer group in one process: the sender's broadcasts are queued, the
    receiver's take them in order (`parallel.wire` accepts any object with this API)."""

    def __init__(self, rank: int, queue: collections.deque):
        self._rank, self.queue = rank, queue

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return 2

    def broadcast(self, tensor, src):
        if src == self._rank:
            self.queue.append(tensor.clone())
        else:
            tensor.copy_(self.queue.popleft())


def pair():
    q = collections.deque()
    return Loopback(0, q), Loopback(1, q)


@pytest.fixture(scope="module")
def engine():
    from megatron_fp4.config import Config
    from megatron_fp4.rl.rollouts.worker import build_engine

    cfg = Config()
    cfg.model.num_layers, cfg.model.vocab_size = 2, 32
    return build_engine(cfg, pad_id=0, name="r0")


def test_generation_round_trip_is_exact(engine):
    from megatron_fp4.rl.rollouts.wire import broadcast_generation

    params = [SamplingParams(max_new_tokens=4, seed=i, stop_token_ids=(3,)) for i in range(3)]
    gen = engine.generate([[1, 5, 7], [2], [4, 4, 4, 4]], params, return_routing=True)
    src, dst = pair()
    sent = broadcast_generation(gen, 0, src)  # the source gets the same generation back as the others
    got = broadcast_generation(None, 0, dst)
    assert not src.queue  # every message consumed
    for out in (sent, got):
        assert (out.prompt_ids, out.response_ids, out.finish_reasons, out.version) == \
            (gen.prompt_ids, gen.response_ids, gen.finish_reasons, gen.version)
        for a, b in zip(out.log_probs + out.sampled_log_probs + out.routing + out.token_versions,
                        gen.log_probs + gen.sampled_log_probs + gen.routing + gen.token_versions, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_token_versions_travel_and_are_checked(engine):
    """Versions per token come back exactly; a version below the generation's, or one that goes
    back along a response, is refused (by every rank); a generation without them reads as constant."""
    from megatron_fp4.rl.rollouts.wire import broadcast_generation

    params = [SamplingParams(max_new_tokens=4, seed=i) for i in range(2)]  # no stop ids: 4 tokens each
    gen = engine.generate([[1, 5], [2]], params)
    # whole-request versions: the engine's (the module's engine may have loaded weights in another test)
    assert [v.tolist() for v in gen.token_versions] == [[gen.version] * 4, [gen.version] * 4]
    gen.version, gen.token_versions = 3, [torch.tensor([3, 3, 4, 5]), torch.tensor([3, 4, 4, 4])]
    src, dst = pair()
    broadcast_generation(gen, 0, src)
    got = broadcast_generation(None, 0, dst)
    assert [v.tolist() for v in got.token_versions] == [[3, 3, 4, 5], [3, 4, 4, 4]]
    assert got.version_range() == (3, 5)
    for bad in ([2, 3, 3, 3], [3, 5, 4, 5]):
        gen.token_versions = [torch.tensor(bad), torch.tensor([3] * 4)]
        for end in (src, dst):
            with pytest.raises(ProtocolError, match="token versions"):
                broadcast_generation(gen if end is src else None, 0, end)
    gen.token_versions = None
    broadcast_generation(gen, 0, src)
    plain = broadcast_generation(None, 0, dst)
    assert plain.token_versions is None and plain.versions_of(0).tolist() == [3] * 4
    assert plain.version_range() == (3, 3)


@pytest.mark.parametrize("header, words", [
    ({"version": 0, "prompt_ids": [[1]], "response_ids": [["x"]], "finish_reasons": ["stop"], "routing": None},
     "list of lists of token ids"),
    ({"version": 0, "prompt_ids": [[1], [2]], "response_ids": [[1]], "finish_reasons": ["stop"], "routing": None},
     "one entry per request"),
    ({"version": "0", "prompt_ids": [], "response_ids": [], "finish_reasons": [], "routing": None}, "header must be"),
    ({"version": 0, "prompt_ids": [[1]], "response_ids": [[1]], "finish_reasons": ["stop"], "routing": [2]},
     "routing must be"),
])
def test_malformed_generation_is_refused(header, words):
    from megatron_fp4.rl.rollouts.wire import broadcast_generation
    from megatron_fp4.parallel.wire import broadcast_message

    src, dst = pair()
    broadcast_message(header, [], 0, src)  # a well-formed message whose generation header is not
    with pytest.raises(ProtocolError, match=words):
        broadcast_generation(None, 0, dst)


def test_sampling_params_round_trip_and_refusal():
    from megatron_fp4.rl.rollouts.wire import params_from_json, params_to_json

    p = SamplingParams(max_new_tokens=7, temperature=0.5, top_k=3, top_p=0.9, stop_token_ids=(2, 5), seed=11)
    assert params_from_json(params_to_json(p)) == p
    with pytest.raises(ProtocolError, match="sampling parameters"):
        params_from_json({"max_new_tokens": 2, "__class__": "os.system"})


def test_hf_receiver_checks_everything_before_loading(engine):
    from megatron_fp4.integrations.hf import to_hf_state_dict
    from megatron_fp4.rl.rollouts.worker import HFWeightReceiver, weight_digests
    from megatron_fp4.rollout.weight_sync.buckets import manifest_of, pack_buckets

    receiver = HFWeightReceiver(engine)
    before = {n: t.clone() for n, t in engine.model.state_dict().items()}
    new = {n: t + 1 for n, t in to_hf_state_dict(engine.model).items()}
    bad = dict(new)
    bad.pop(next(n for n in bad if ".experts." in n))  # one expert's tensor missing
    with pytest.raises(ValueError, match="rejects the weights.*missing keys"):
        receiver.validate(manifest_of(bad.items()))
    assert all(torch.equal(t, before[n]) for n, t in engine.model.state_dict().items())
    receiver.load(5, manifest_of(new.items()), pack_buckets(list(new.items()), 1 << 16))
    assert engine.version == 5
    digests = weight_digests(engine.model)
    assert set(digests) == set(new)
    for name, t in to_hf_state_dict(engine.model).items():
        assert torch.equal(t, new[name]), name


def test_worker_requests(engine):
    from megatron_fp4.rl.rollouts.worker import handle, parse_spec

    with pytest.raises(ProtocolError, match="unknown op"):
        handle(engine, {"op": "exec"})
    with pytest.raises(RuntimeError, match="wait for the load"):
        handle(engine, {"op": "generate", "prompts": [[1]], "params": [{"max_new_tokens": 1}],
                        "min_version": engine.version + 1})
    status, gen = handle(engine, {"op": "generate", "prompts": [[1, 2]], "params": [{"max_new_tokens": 2, "seed": 1}]})
    assert status == {"error": None, "version": engine.version} and len(gen.response_ids[0]) == 2
    with pytest.raises(ValueError, match="JSON object with keys"):
        parse_spec('{"config": {}}')


UNPICKLED = []


def _ran_on_unpickle():
    UNPICKLED.append(True)


class _Payload:
    """Unpickling it calls `_ran_on_unpickle`: what a hostile peer's pickle would do."""

    def __reduce__(self):
        return _ran_on_unpickle, ()


@pytest.mark.parametrize("receive", ["generation", "control request"])
def test_a_pickled_message_is_refused_and_never_unpickled(receive):
    """A peer sends a pickle where the rollout boundary expects a message (a generation, or a
    request on the rollout worker's control channel): it is refused as not JSON, and nothing in it
    runs. (The payload does run when unpickled: checked first, so the test can fail.)"""
    import pickle

    from megatron_fp4.parallel.wire import broadcast_json
    from megatron_fp4.rl.rollouts.wire import broadcast_generation

    blob = pickle.dumps(_Payload())
    pickle.loads(blob)
    assert UNPICKLED == [True]
    UNPICKLED.clear()
    src, dst = pair()
    src.queue.extend([torch.tensor([len(blob)], dtype=torch.int64),  # the length frame, then the bytes
                      torch.frombuffer(bytearray(blob), dtype=torch.uint8)])
    with pytest.raises(ProtocolError, match="not JSON.*never pickle"):
        broadcast_generation(None, 0, dst) if receive == "generation" else broadcast_json(None, 0, dst)
    assert not UNPICKLED and not src.queue


def test_trainer_fails_fast_when_the_rollout_process_dies(monkeypatch):
    import subprocess
    import sys
    import time

    from megatron_fp4.rl.rollouts.client import RemoteRollout
    from megatron_fp4.rl.rollouts.worker_main import main

    client = RemoteRollout.__new__(RemoteRollout)
    client.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code 3 before joining"):
        client._join(lambda: time.sleep(60))  # a join that would wait for the group's timeout
    assert time.monotonic() - start < 30
    monkeypatch.delenv("MEGATRON_FP4_SYNC_TOKEN", raising=False)
    with pytest.raises(SystemExit, match="MEGATRON_FP4_SYNC_TOKEN"):
        main(["{}"])


def _launched_module(monkeypatch) -> tuple:
    """(python, module) that `RemoteRollout` starts its rollout process with (its launch, not run)."""
    from megatron_fp4.rl.rollouts.client import RemoteRollout

    seen = {}
    monkeypatch.setattr(RemoteRollout, "_start", lambda self, *a: seen.setdefault("launch", a[-1]))
    trainer = type("T", (), {"cfg": type("C", (), {"to_dict": lambda self: {}})()})()
    RemoteRollout(trainer, pad_id=0)
    python, module, _, _ = seen["launch"]()
    return python, module


@pytest.mark.parametrize("which", ["engine", "vllm"])
def test_rollout_process_entry_runs_without_runtime_warning(monkeypatch, which):
    """`python -m` of the rollout process's entry module prints no RuntimeWarning ('found in
    sys.modules after import of package ... prior to execution': the package imported the module it
    runs). The processes get a bad spec and stop at its check, after every import."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    python, module = _launched_module(monkeypatch) if which == "engine" else \
        (sys.executable, "megatron_fp4.rl.rollouts.vllm_server")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "MEGATRON_FP4_SYNC_TOKEN": "0123456789abcdef" * 2, "PYTHONPATH": root,
           "PYTHONWARNINGS": "default"}
    run = subprocess.run([python, "-m", module, "[]"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0  # the bad spec is refused ...
    assert "spec must be a JSON object" in run.stderr, run.stderr[-2000:]  # ... by the module's own check
    assert "RuntimeWarning" not in run.stderr, run.stderr[-2000:]
