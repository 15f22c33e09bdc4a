"""A hostile peer in the "dist" weight-sync group sends pickles that would write a marker file.

Two processes, two groups (`PeerGroup`, the verl checkpoint engine's group), both peers holding the
token (an insider: the token keeps outsiders out, this checks what an insider's bytes can do):
  * group A: an honest publisher (rank 0); rank 1 joins as a rollout and answers the header with
    a pickled "verdict" -> the publisher raises WeightSyncError naming group rank 1 and "not JSON";
    then announces a 1 TiB verdict -> refused from the length alone.
  * group B: rank 0 is a hostile publisher whose header is a pickle; rank 1 is an honest rollout
    -> it answers with a failing verdict, loads nothing and keeps serving its version.
In both the marker file is never written (before this fix both sides ran `pickle.loads`)."""
import os
import pickle

import pytest
import torch

from tests.distributed.launch import free_port, run_distributed

pytestmark = pytest.mark.distributed
TOKEN = "f" * 64


class _WritesMarker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # unpickling opens (creates) the marker file
        return open, (self.path, "w")


def _group(port, rank):
    from megatron_fp4.rollout.weight_sync.peer_group import PeerGroup  # what verl's checkpoint engine and RemoteRollout use
    return PeerGroup("127.0.0.1", port, rank, 2, torch.device("cpu"), timeout_s=30, token=TOKEN)


def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _recv(group) -> bytes:  # the protocol's framing: int64 length, then the bytes, from rank 0
    n = torch.zeros(1, dtype=torch.int64)
    group.broadcast(n, 0)
    buf = torch.empty(int(n), dtype=torch.uint8)
    group.broadcast(buf, 0)
    return buf.numpy().tobytes()


def _send(group, data: bytes) -> None:
    group.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0)
    group.broadcast(_bytes(data), 0)


def _contribute(group, data: bytes) -> None:  # a verdict: allgather of lengths, then of padded bytes
    lengths = group.all_gather(torch.tensor([len(data)], dtype=torch.int64))
    padded = torch.zeros(int(max(lengths)), dtype=torch.uint8)
    padded[:len(data)] = _bytes(data)
    group.all_gather(padded)


def _announce_oversized(group) -> None:  # claims a 1 TiB verdict, then sends what fits the others
    from megatron_fp4.rollout.weight_sync.distributed import MAX_VERDICT_BYTES
    lengths = [int(n) for n in group.all_gather(torch.tensor([1 << 40], dtype=torch.int64))]
    group.all_gather(torch.zeros(max([1] + [n for n in lengths if 0 < n <= MAX_VERDICT_BYTES]), dtype=torch.uint8))


def _worker(rank, world_size, ports, marker):
    from megatron_fp4.rollout import WeightPublisher, WeightSyncError
    from megatron_fp4.rollout.weight_sync.distributed import DistributedReceiver, DistributedTransport
    payload = pickle.dumps(_WritesMarker(marker))
    out = {}
    group = _group(ports[0], rank)  # A: hostile rollout
    if rank == 0:
        weights = [("w", torch.arange(6, dtype=torch.float32))]
        pub = WeightPublisher(lambda: weights, [DistributedTransport(group, src=0)], bucket_bytes=16)
        for version in (1, 2):
            try:
                pub.publish(version).wait_loaded(60)
            except WeightSyncError as err:
                out[f"publisher_error{version}"] = str(err)
    else:
        _recv(group)  # the header
        _contribute(group, payload)  # the pickled "verdict"
        out["go"] = _recv(group)
        _recv(group)  # the next header
        _announce_oversized(group)
        out["go2"] = _recv(group)
    group.close()
    group = _group(ports[1], rank)  # B: hostile publisher
    if rank == 0:
        _send(group, payload)  # the pickled "header"
        _contribute(group, b"null")  # the publisher's own (ignored) verdict slot
        _send(group, b"false")  # no-go
        _send(group, b"null")  # stop
    else:
        class Receiver:
            name = "rollout-b"

            def validate(self, manifest):
                out["validated"] = True

            def load(self, *args):
                out["loaded"] = True
        server = DistributedReceiver(Receiver(), group, src=0)
        server.serve_forever()
        out["rollout_errors"] = server.errors
    group.close()
    out["marker_written"] = os.path.exists(marker)
    return out


def test_pickles_from_a_peer_never_execute(tmp_path):
    marker = str(tmp_path / "pwned")
    publisher, rollout = run_distributed(_worker, world_size=2, args=([free_port(), free_port()], marker),
                                         timeout_s=120)
    assert not os.path.exists(marker) and not publisher["marker_written"] and not rollout["marker_written"]
    err = publisher["publisher_error1"]  # a clear error naming the sender; no bucket was sent (no-go)
    assert "version 1" in err and "group rank 1" in err and "not JSON" in err and "never pickle" in err, err
    err = publisher["publisher_error2"]  # a length announcement is checked before anything is allocated
    assert "version 2" in err and "group rank 1 announced a 1099511627776-byte verdict" in err, err
    assert rollout["go"] == rollout["go2"] == b"false"
    (version, why), = rollout["rollout_errors"]
    assert version is None and "rank 0 (the publisher)" in why and "not JSON" in why, why
    assert "validated" not in rollout and "loaded" not in rollout
