"""GC-MoE transfer pieces that need no processes: the ring's per-peer requirement and the CUDA SM
split (torch's green-context API faked; the split logic is what runs on a GPU)."""
import types

import pytest
import torch

from megatron_fp4.parallel.moe import gcmoe_transfer
from megatron_fp4.parallel.moe.gcmoe import GCMoEDispatcher
from megatron_fp4.parallel.moe.gcmoe_transfer import compute_sms_split


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


# -- the transfer group's NCCL options (CUDA branch with torch's NCCL classes faked) ----------------
class _FakeNCCL:
    class Options:
        def __init__(self):
            self.config = types.SimpleNamespace(max_ctas=None)


def _mesh(device):
    """Rank 3 of a dp4 × ep2 mesh (ep groups [0, 1], [2, 3]) that believes it is distributed; the
    groups it creates come from the patched `dist.new_group`."""
    from megatron_fp4.parallel.dims import ParallelDims
    from megatron_fp4.parallel.mesh import ParallelMesh
    return ParallelMesh(ParallelDims(world_size=4, dp=4, ep=2), rank=3, device=torch.device(device),
                        groups={"world": object()}, timeout_s=42.0)


def test_nccl_transfer_options_caps_ctas(monkeypatch):
    monkeypatch.delattr(gcmoe_transfer.dist, "ProcessGroupNCCL", raising=False)
    assert gcmoe_transfer.nccl_transfer_options(20) is None  # a CPU-only torch has no NCCL options
    monkeypatch.setattr(gcmoe_transfer.dist, "ProcessGroupNCCL", _FakeNCCL, raising=False)
    assert gcmoe_transfer.nccl_transfer_options(20).config.max_ctas == 20
    assert gcmoe_transfer.nccl_transfer_options(0).config.max_ctas == 1


def test_transfer_group_passes_nccl_options_on_cuda_only(monkeypatch):
    from datetime import timedelta
    monkeypatch.setattr(gcmoe_transfer.dist, "ProcessGroupNCCL", _FakeNCCL, raising=False)
    created = []

    def new_group(ranks, timeout=None, pg_options=None):
        created.append((ranks, timeout, pg_options and pg_options.config.max_ctas))
        return tuple(ranks)

    monkeypatch.setattr("torch.distributed.new_group", new_group)
    # every ep group is created by every rank, in order, through the mesh; rank 3 keeps [2, 3]
    mesh = _mesh("cuda")
    assert gcmoe_transfer.transfer_group(mesh, 16) == (2, 3)
    assert created == [([0, 1], timedelta(seconds=42), 16), ([2, 3], timedelta(seconds=42), 16)]
    assert gcmoe_transfer.transfer_group(mesh, 16) == (2, 3) and len(created) == 2  # cached by the mesh
    created.clear()
    assert gcmoe_transfer.transfer_group(_mesh("cpu"), 16) == (2, 3)
    assert created == [([0, 1], timedelta(seconds=42), None), ([2, 3], timedelta(seconds=42), None)]  # CPU: no options


# -- GC-MoE decode: the static (CUDA-Graph) path reads nothing back to the host ---------------------
def _meta_decode(mode, static):
    """One ep2 decode round on the meta device (tensors without data: any .item(), .tolist(),
    bool() or copy to the host raises), the peer exchange replaced by a local copy."""
    from megatron_fp4.fp4 import Numerics, Recipe
    from megatron_fp4.model.moe import GroupedExperts
    from megatron_fp4.parallel.moe.gcmoe_decode import DecodeBuffers, GCMoEDecodeDispatcher
    H, E, T = 32, 4, 3
    experts = GroupedExperts(E // 2, H, H, Recipe(mode=mode)).to("meta")
    experts.numerics = Numerics()
    d = GCMoEDecodeDispatcher(None, 2, E, 0, [0, 1], DecodeBuffers(4), static=static)
    d._exchange = lambda send, recv, phase: recv.copy_(send)
    x = torch.empty(T, H, device="meta")
    idx = torch.empty(T, 2, dtype=torch.long, device="meta")
    # FP4 quantizers check operands for NaN/Inf on the host unless the check is deferred (a captured
    # GPU step defers it, as the trainer does on accelerators)
    with torch.no_grad(), experts.numerics.training_step(0, defer_nonfinite=True):
        return d(x, idx, torch.empty(T, 2, device="meta"), experts)


@pytest.mark.parametrize("mode", ["bf16", "fp4_resq"])
def test_decode_static_path_has_no_host_reads(mode):
    y = _meta_decode(mode, static=True)
    assert y.shape == (3, 32) and y.is_meta
    with pytest.raises((RuntimeError, NotImplementedError)):  # the exact path reads the counts
        _meta_decode(mode, static=False)


def test_decode_buffers_header_and_rows_do_not_overlap():
    from megatron_fp4.parallel.moe.gcmoe_decode import DecodeBuffers, header_ints
    B = DecodeBuffers(4)
    with torch.inference_mode():  # first call under inference mode, later ones under no_grad
        sets = B.get(ep=2, cap=8, num_local=5, hidden=3, dtype=torch.float64, device="cpu")
    assert header_ints(5) == 12 and len(sets) == 2 and B.allocations == 1
    buf = sets[0]["send"]
    B.rows(buf).fill_(-1.5)
    assert (B.header(buf) == 0).all()  # rows start after the 48-byte header
    B.header(buf).fill_(7)
    assert (B.rows(buf) == -1.5).all() and B.rows(buf).shape == (2, 8, 3)
    B.seq += 1
    assert B.get(2, 8, 5, 3, torch.float64, "cpu") is sets and B.allocations == 1  # reused
    with pytest.raises(ValueError, match="decode_tokens=0 must be >= 1"):
        DecodeBuffers(0)
