"""Trainer rank 0 reads a generation from the rollout process: every size in its header is bounded
by what the request asked for, before anything is allocated (a routing of [65535, 65535] for one
token used to make rank 0 allocate 34 GB)."""
import collections
import types

import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.rl.rollouts.client import RemoteRollout
from megatron_fp4.rl.rollouts.worker import build_engine
from megatron_fp4.rollout import SamplingParams
from megatron_fp4.parallel.wire import ProtocolError, broadcast_message
from tests.unit.test_grpo_wire import Loopback

PROMPTS = [[1, 5, 7], [2]]
PARAMS = [SamplingParams(max_new_tokens=3, seed=i) for i in range(2)]


def _cfg():
    cfg = Config()
    cfg.model.num_layers, cfg.model.vocab_size, cfg.model.dense_layers = 3, 32, [0]
    return cfg


def _rank0():
    """RemoteRollout's rank 0 with its control channel on a loopback (what the rollout process sends
    goes in `rollout`) and the trainer's world group on another."""
    control, world = collections.deque(), collections.deque()
    rr = RemoteRollout.__new__(RemoteRollout)
    rr.is_source, rr.model_cfg, rr._device = True, _cfg().model, torch.device("cpu")
    rr.control = Loopback(0, control)
    rr.mesh = types.SimpleNamespace(group=lambda axis: Loopback(0, world), device=torch.device("cpu"),
                                    is_distributed=True)
    rr._request = lambda request: {"error": None}
    return rr, Loopback(1, control), world


def _header(**changes):
    h = {"version": 1, "prompt_ids": PROMPTS, "response_ids": [[3, 4, 5], [6]], "finish_reasons": ["length", "stop"],
         "routing": [2, 2]}
    return {**h, **changes}


def test_a_real_generation_passes():
    rr, rollout, world = _rank0()
    gen = build_engine(_cfg(), pad_id=0, name="r").generate(PROMPTS, PARAMS, return_routing=True)
    from megatron_fp4.rl.rollouts.wire import broadcast_generation
    broadcast_generation(gen, 1, rollout)
    got = rr.generate(PROMPTS, PARAMS, return_routing=True)
    assert got.response_ids == gen.response_ids and all(torch.equal(a, b) for a, b in zip(got.routing, gen.routing))
    assert world  # and it went on to the other trainer ranks


@pytest.mark.parametrize("changes, words", [
    ({"routing": [65535, 65535], "prompt_ids": [[1, 5, 7]], "response_ids": [[3]], "finish_reasons": ["stop"]},
     "not the 2 requested"),
    ({"routing": [65535, 65535]}, r"routing \[65535, 65535\] where the request asked for \[2, 2\]"),
    ({"routing": None}, r"routing None where the request asked for \[2, 2\]"),
    ({"response_ids": [[3] * 1000, [6]]}, "response 0 has 1000 tokens; the request allowed 3"),
    ({"response_ids": [[3, 4, 99], [6]]}, r"outside the vocabulary \[0, 32\)"),
    ({"prompt_ids": [[1, 5, 8], [2]]}, "not the 2 requested"),
    ({"finish_reasons": ["x" * 10 ** 6, "stop"]}, "finish_reasons must be short strings"),
])
def test_a_header_beyond_the_request_is_refused_before_allocating(changes, words):
    rr, rollout, world = _rank0()
    broadcast_message(_header(**changes), [], 1, rollout)
    with pytest.raises(ProtocolError, match=words):
        rr.generate(PROMPTS, PARAMS, return_routing=True)
    assert not world  # nothing went on to the other trainer ranks


def test_routing_not_asked_for_is_refused():
    rr, rollout, _ = _rank0()
    broadcast_message(_header(), [], 1, rollout)
    with pytest.raises(ProtocolError, match=r"routing \[2, 2\] where the request asked for None"):
        rr.generate(PROMPTS, PARAMS, return_routing=False)


def test_tensors_of_the_wrong_dtype_or_shape_are_refused():
    from megatron_fp4.rl.rollouts.wire import broadcast_generation

    n = 4  # tokens in _header()'s responses
    for tensors in ([torch.zeros(n, dtype=torch.float64), torch.zeros(n)],  # log-probs as float64
                    [torch.zeros(n), torch.zeros(n), torch.zeros(n, 2, 3, dtype=torch.int64)],  # routing [2, 3]
                    [torch.zeros(n), torch.zeros(n + 1)]):
        q = collections.deque()
        sender, receiver = Loopback(0, q), Loopback(1, q)
        broadcast_message(_header(routing=None), tensors, 0, sender)
        with pytest.raises(ProtocolError, match="sent tensors .* where .* were expected"):
            broadcast_generation(None, 0, receiver)


def test_without_a_request_the_payload_is_still_bounded():
    """A receiver that does not know the request (every trainer rank gets rank 0's copy with it, but
    `broadcast_generation` also serves callers without one) still refuses a routing of
    [65535, 65535] for one token from the header: 34 GB is never allocated."""
    from megatron_fp4.rl.rollouts.wire import broadcast_generation

    from megatron_fp4.parallel.wire import broadcast_json

    q = collections.deque()
    header = _header(prompt_ids=[[1]], response_ids=[[3]], finish_reasons=["stop"], routing=[65535, 65535])
    tensors = [["float32", [1]], ["float32", [1]], ["int64", [1, 65535, 65535]]]  # what that header implies
    broadcast_json({"header": header, "tensors": tensors}, 0, Loopback(0, q))  # and no payload behind it
    with pytest.raises(ProtocolError, match="34358689808-byte payload"):
        broadcast_generation(None, 0, Loopback(1, q))
