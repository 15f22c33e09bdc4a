"""GC-MoE transfer pieces that need no processes: the ring's per-peer requirement and the CUDA SM
split (torch's green-context API faked; the split logic is what runs on a GPU)."""
import types

import pytest
import torch

from megatron_fp4.parallel import gcmoe_transfer
from megatron_fp4.parallel.gcmoe import GCMoEDispatcher
from megatron_fp4.parallel.gcmoe_transfer import compute_sms_split


def test_ring_needs_one_slot_per_peer():
    with pytest.raises(ValueError, match=r"parallel.gcmoe_ring_slots=2 must be >= .* = 3"):
        GCMoEDispatcher(None, 4, 8, channel=None, ring_slots=2)
    assert GCMoEDispatcher(None, 4, 8, channel=None, ring_slots=3).ring_slots == 3
    assert GCMoEDispatcher(None, 2, 4, channel=None, ring_slots=1).ring_slots == 1


def test_compute_sms_split():
    assert compute_sms_split(132, 20) == 112
    assert compute_sms_split(132, 0) is None and compute_sms_split(132, 132) is None


def test_one_green_context_for_compute_transfer_on_plain_stream(monkeypatch):
    """torch's GreenContext.create(num_sms=n) keeps the first n SMs of the whole device, so two
    creations overlap: only the compute side gets a green context, the transfer a plain stream."""
    created = []

    class FakeGreen:
        @staticmethod
        def create(num_sms=None, device_id=None, **kw):
            created.append((num_sms, device_id))
            return types.SimpleNamespace(Stream=lambda: ("green", num_sms))

    fake = types.SimpleNamespace(SUPPORTED=True, GreenContext=FakeGreen)
    monkeypatch.setattr(torch.cuda, "green_contexts", fake, raising=False)
    monkeypatch.setitem(__import__("sys").modules, "torch.cuda.green_contexts", fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "Stream", lambda dev: ("plain", dev))
    transfer, compute, _ = gcmoe_transfer._green_streams(torch.device("cuda", 0), 20)
    assert created == [(112, 0)]
    assert compute == ("green", 112) and transfer[0] == "plain"
    assert gcmoe_transfer._green_streams(torch.device("cuda", 0), 0) is None
