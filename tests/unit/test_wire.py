"""The one wire module (`parallel/wire.py`): JSON headers and uint8 tensor payloads between processes.

Bounds are checked before anything is allocated: a peer announcing a TiB (a header, a verdict, a
payload) is refused from the announcement alone, which `torch.empty` of that size on this machine
could not be (it raises a RuntimeError, not the protocol's error). A payload's dtypes and shapes
are checked against what the receiver expects; a truncated payload or JSON is refused."""
import collections

import pytest
import torch

from megatron_fp4.parallel import wire
from megatron_fp4.parallel.wire import MalformedMessage, ProtocolError
from tests.unit.test_grpo_wire import Loopback, pair

TIB = 1 << 40


class Gather(Loopback):
    """A 1-rank group also able to all-gather (what `all_gather_json` needs)."""

    def __init__(self, inject=None):
        super().__init__(0, collections.deque())
        self.inject = inject or []  # tensors another rank would contribute, in call order

    def size(self):
        return 1 + bool(self.inject)

    def all_gather(self, tensor):
        return [tensor.clone()] + ([self.inject.pop(0)] if self.inject else [])


def test_json_round_trip():
    src, dst = pair()
    obj = {"a": [1, 2.5, None, "ü"], "b": True}
    assert wire.broadcast_json(obj, 0, src) == obj
    assert wire.broadcast_json(None, 0, dst) == obj and not src.queue


def test_an_oversized_json_announcement_is_refused_before_allocating():
    src, dst = pair()
    src.broadcast(torch.tensor([TIB], dtype=torch.int64), 0)  # a length, and no bytes behind it
    with pytest.raises(ProtocolError, match=f"rank 0 announced a {TIB}-byte message"):
        wire.broadcast_json(None, 0, dst)
    src.broadcast(torch.tensor([9], dtype=torch.int64), 0)
    with pytest.raises(ProtocolError, match="9-byte message .allowed: 1..8"):
        wire.broadcast_json(None, 0, dst, max_bytes=8)


def test_not_json_and_truncated_json_are_malformed():
    for data in (b"\x80\x04K\x01.", b'{"a": [1, 2'):  # a pickle; JSON cut short
        with pytest.raises(MalformedMessage, match="peer sent a message that is not JSON.*never pickle"):
            wire.decode_json(torch.frombuffer(bytearray(data), dtype=torch.uint8), "peer")


def test_all_gather_json_bounds_each_rank():
    assert wire.all_gather_json({"x": 1}, Gather()) == [{"x": 1}]
    liar = Gather([torch.tensor([TIB], dtype=torch.int64), torch.zeros(7, dtype=torch.uint8)])
    with pytest.raises(ProtocolError, match=f"group rank 1 announced a {TIB}-byte verdict"):
        wire.all_gather_json({"x": 1}, liar, what="verdict")
    liar = Gather([torch.tensor([TIB], dtype=torch.int64), torch.zeros(7, dtype=torch.uint8)])
    mine, theirs = wire.all_gather_json({"x": 1}, liar, strict=False)
    assert mine == {"x": 1} and isinstance(theirs, ProtocolError)


def test_message_round_trip_is_exact_and_uint8_on_the_wire():
    src, dst = pair()
    tensors = [torch.randn(3, 4, dtype=torch.float64), torch.randn(5).to(torch.bfloat16),
               torch.tensor([True, False]), torch.arange(6, dtype=torch.int64).reshape(2, 3), torch.empty(0, 2)]
    header, sent = wire.broadcast_message({"step": 3}, tensors, 0, src)
    assert header == {"step": 3} and sent is not tensors and all(a is b for a, b in zip(sent, tensors))
    assert [t.dtype for t in src.queue] == [torch.int64, torch.uint8, torch.uint8]  # length, envelope, payload
    header, got = wire.broadcast_message(None, None, 0, dst)
    assert header == {"step": 3} and not src.queue
    for a, b in zip(got, tensors, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _envelope(tensors, header=None):
    src, dst = pair()
    wire.broadcast_json({"header": header, "tensors": tensors}, 0, src)
    return dst


@pytest.mark.parametrize("tensors, words", [
    ([["float32", [TIB]]], f"announced a {4 * TIB}-byte payload"),
    ([["object", [1]]], "dtype 'object' is not one a message carries"),
    ([["float32", [-1]]], "a tensor must be .dtype, shape."),
    ([["float32", [1] * 17]], "at most 16"),
    ("float32", "must be a list"),
])
def test_a_bad_payload_announcement_is_refused_before_allocating(tensors, words):
    with pytest.raises(ProtocolError, match=words):
        wire.broadcast_message(None, None, 0, _envelope(tensors))


@pytest.mark.parametrize("tensors", [[["float64", [3]]], [["float32", [4]]], [["float32", [3]], ["int64", [1]]], []])
def test_a_payload_other_than_expected_is_refused(tensors):
    with pytest.raises(ProtocolError, match="sent tensors .* where .* were expected"):
        wire.broadcast_message(None, None, 0, _envelope(tensors, header=3),
                               expect=lambda n: [((n,), torch.float32)])


def test_envelope_form_is_checked():
    src, dst = pair()
    wire.broadcast_json([1, 2], 0, src)
    with pytest.raises(ProtocolError, match="a message must be"):
        wire.broadcast_message(None, None, 0, dst)


def test_a_truncated_or_padded_payload_is_refused():
    specs = [((2, 2), torch.float32)]
    full = wire.pack_payload([torch.ones(2, 2)])
    assert torch.equal(wire.unpack_payload(full, specs)[0], torch.ones(2, 2))
    for bad in (full[:-1], torch.cat([full, full[:1]]), full.view(torch.int32)):
        with pytest.raises(ProtocolError, match="truncated or malformed"):
            wire.unpack_payload(bad, specs)


def test_pipeline_report_goes_through_the_wire():
    """`PipelineRunner._broadcast_report` sends names and float64 values as one message, bit exact."""
    import types

    from megatron_fp4.parallel.pipeline import PipelineRunner

    src, dst = pair()
    mesh = types.SimpleNamespace(ranks={"pp": [0, 1]}, device=torch.device("cpu"))
    last = types.SimpleNamespace(has_last=True, group=src, mesh=mesh, last_stage_rank=0)
    first = types.SimpleNamespace(has_last=False, group=dst, mesh=mesh, last_stage_rank=0)
    metrics = {"kl": 1 / 3, "clip": 0.1}
    assert PipelineRunner._broadcast_report(last, 0.7, metrics) == (0.7, metrics)
    assert PipelineRunner._broadcast_report(first, float("nan"), {}) == (0.7, metrics)
