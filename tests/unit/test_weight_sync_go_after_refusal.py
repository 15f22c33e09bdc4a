"""A publisher holding the token that says "go" after a rollout refused the update (its manifest,
or the header itself) used to end the rollout's receiver thread with a ProtocolError: the rollout
silently stopped taking updates. Now the receiver survives: it loads nothing (the previous version
keeps serving), stays in step with the exchange and loads the next valid update.

A 2-rank `PeerGroup` (gloo) in two threads of this process: rank 0 the publisher, scripted where it
breaks the protocol and `DistributedTransport` otherwise; rank 1 a `DistributedReceiver`."""
import threading

import pytest
import torch

from megatron_fp4.rollout.weight_sync.buckets import manifest_of, pack_buckets
from megatron_fp4.rollout.weight_sync.peer_group import PeerGroup, reserve_port
from megatron_fp4.rollout.weight_sync.publisher import WeightSyncError
from megatron_fp4.rollout.weight_sync.distributed import (DistributedReceiver, DistributedTransport, _broadcast_json,
                                                          _gather_json)
from tests.distributed.launch import free_port

TOKEN = "c" * 64
GOOD = [("w", torch.arange(6, dtype=torch.float32)), ("b", torch.ones(3, dtype=torch.float32))]
BAD = [("unknown", torch.arange(10, dtype=torch.float32))]  # names the rollout does not have


class Engine:
    """What the receiver loads into: refuses other names, keeps the loaded bytes."""
    name = "rollout-under-test"

    def __init__(self):
        self.loaded = {}

    def validate(self, manifest):
        if set(manifest) != {"w", "b"}:
            raise ValueError(f"unexpected names {sorted(manifest)}")

    def load(self, version, manifest, buckets):
        self.loaded[version] = [bytes(b.buffer.numpy()) for b in buckets]


def run_pair(publisher, timeout_s=20):
    port, out = free_port(), {}

    def one(rank):
        try:
            group = PeerGroup("127.0.0.1", port, rank, 2, torch.device("cpu"), timeout_s=timeout_s, token=TOKEN,
                              listen_socket=reserve_port("127.0.0.1", port) if rank == 0 else None)
            if rank == 0:
                out["publisher"] = publisher(group)
            else:
                server = DistributedReceiver(Engine(), group, src=0).start()
                server.join(3 * timeout_s)
                out["receiver"] = server
            group.close()
        except BaseException as err:  # noqa: BLE001 - inspected below
            out[f"error{rank}"] = err
    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * timeout_s)
    return out


def send(transport, version, named):
    try:
        transport.send(version, manifest_of(named), pack_buckets(named, 16))
        return None
    except WeightSyncError as err:
        return str(err)


def test_go_after_a_refused_manifest_drops_the_buckets_and_keeps_serving():
    def publisher(group):
        transport = DistributedTransport(group, src=0)
        real, calls = transport._failures, []

        def deaf():  # the first verdicts (on version 1's manifest) are ignored: go regardless
            calls.append(1)
            failures = real()
            return {} if len(calls) == 1 else failures
        transport._failures = deaf
        errors = [send(transport, 1, BAD), send(transport, 2, GOOD)]
        transport.close()
        return errors

    out = run_pair(publisher)
    assert "error0" not in out and "error1" not in out, out
    (first, second), server = out["publisher"], out["receiver"]
    # the publisher hears the refusal after all (the final verdict), the next update loads
    assert "version 1" in first and "rollout-under-test" in first and "but the publisher sent go" in first, first
    assert second is None and server.failure is None and server.versions == [2]
    assert server.receiver.loaded[2] == [bytes(b.buffer.numpy()) for b in pack_buckets(GOOD, 16)]
    (version, why), = server.errors
    assert version == 1 and "unexpected names ['unknown']" in why and "nothing was loaded" in why


def test_go_after_a_refused_header_is_taken_as_no_go_and_the_next_update_loads():
    def publisher(group):
        _broadcast_json({"version": 1, "manifest": "not one"}, 0, group, torch.device("cpu"))
        _gather_json(None, 0, group, torch.device("cpu"))
        _broadcast_json(True, 0, group, torch.device("cpu"))  # go, after the rollout refused the header
        transport = DistributedTransport(group, src=0)
        errors = [send(transport, 2, GOOD)]
        transport.close()
        return errors

    out = run_pair(publisher)
    assert "error0" not in out and "error1" not in out, out
    server = out["receiver"]
    assert out["publisher"] == [None] and server.failure is None and server.versions == [2]
    (version, why), = server.errors
    assert version is None and "the publisher's header is not" in why and "but the publisher sent go" in why


@pytest.mark.parametrize("go", [[1], "yes"])
def test_a_go_that_is_not_a_bool_still_ends_the_exchange_loudly(go):
    """Whether buckets follow is unknown: the receiver stops and says why (join raises)."""
    def publisher(group):
        _broadcast_json({"version": 1, "manifest": "not one"}, 0, group, torch.device("cpu"))
        _gather_json(None, 0, group, torch.device("cpu"))
        _broadcast_json(go, 0, group, torch.device("cpu"))

    out = run_pair(publisher)
    assert "publisher's go/no-go for version None is" in str(out["error1"])
