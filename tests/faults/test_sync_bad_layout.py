"""A weight-sync header whose bucket layout does not match its manifest, and a receiver that cannot
allocate an update: both reach the publisher as a `WeightSyncError` naming the rollout, and the
rollout keeps serving (the next valid update loads). Before the fix the rollout answered "ok" to a
layout declaring an extra 32 TiB bucket, its receiver thread died allocating it, and the publisher
learned only by the group's timeout.

Both sides are threads of this process on a `PeerGroup` over 127.0.0.1 (no spawning)."""
import threading

import pytest
import torch

from megatron_fp4.rollout import WeightPublisher, WeightSyncError
from megatron_fp4.rollout.weight_sync.buckets import BucketError, TensorMeta, check_layout, pack_buckets, plan_buckets
from megatron_fp4.rollout.weight_sync.peer_group import PeerGroup, reserve_port
from megatron_fp4.rollout.weight_sync.distributed import DistributedReceiver, DistributedTransport

pytestmark = pytest.mark.faults
ADDR = "127.0.0.1"
TOKEN = "d" * 64
HUGE = 1 << 45  # 32 TiB
WEIGHTS = [("w", torch.arange(6, dtype=torch.float32))]


class _Declared:
    """A bucket the header declares and the publisher never sends (no-go comes first)."""

    def __init__(self, metas, nbytes):
        self.metas, self.nbytes, self.buffer = metas, nbytes, torch.empty(0, dtype=torch.uint8)


class _Receiver:
    name = "rollout-x"

    def __init__(self):
        self.loaded = []

    def validate(self, manifest):  # accepts any manifest: only the layout/allocation checks stand
        pass

    def load(self, version, manifest, buckets):
        self.loaded.append(version)


def _groups():
    listen = reserve_port(ADDR)
    port, out = listen.getsockname()[1], {}

    def join(rank):
        out[rank] = PeerGroup(ADDR, port, rank, 2, torch.device("cpu"), timeout_s=15,
                              listen_socket=listen if rank == 0 else None, token=TOKEN)
    threads = [threading.Thread(target=join, args=(r,), daemon=True) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    return out[0], out[1]


def _bad_update(publisher_group, manifest, buckets):
    try:
        DistributedTransport(publisher_group, src=0, name="pub").send(1, manifest, buckets)
    except WeightSyncError as err:
        return err
    return None


@pytest.mark.parametrize("case", ["extra_bucket", "bucket_bigger_than_its_chunks", "huge_tensor"])
def test_a_bad_layout_or_allocation_reaches_the_publisher_and_the_rollout_keeps_serving(case):
    pub_group, roll_group = _groups()
    receiver = _Receiver()
    server = DistributedReceiver(receiver, roll_group, src=0).start()
    real = pack_buckets(WEIGHTS, 16)
    manifest = {"w": ((6,), torch.float32)}
    if case == "extra_bucket":  # a valid manifest, and one more 32 TiB bucket of nothing
        buckets, expected = real + [_Declared([], HUGE)], f"bucket 2 declares {HUGE} bytes but its chunks hold 0"
    elif case == "bucket_bigger_than_its_chunks":
        buckets = [_Declared(real[0].metas, HUGE)] + real[1:]
        expected = f"bucket 0 declares {HUGE} bytes but its chunks hold 16"
    else:  # the layout matches a manifest this receiver accepts, but the memory is not there
        manifest = {"big": ((HUGE // 4,), torch.float32)}
        buckets = [_Declared(metas, n) for metas, n in plan_buckets(manifest, HUGE)]
        expected = f"rollout 'rollout-x' cannot allocate the {HUGE} bytes"
    err = _bad_update(pub_group, manifest, buckets)
    assert isinstance(err, WeightSyncError) and err.version == 1, err
    (name, why), = err.failures.items()
    assert name == "rollout-x" and expected in why, why
    publisher = WeightPublisher(lambda: WEIGHTS, [DistributedTransport(pub_group, src=0, name="pub")], bucket_bytes=16)
    publisher.publish(2).wait_loaded(60)  # the rollout still takes updates
    assert receiver.loaded == [2] and server.versions == [2]
    publisher.transports[0].close()
    server.join(60)
    assert server.failure is None
    pub_group.close()
    roll_group.close()


def test_check_layout_accepts_every_plan_and_refuses_what_a_plan_never_is():
    manifest = {"a": ((3, 5), torch.float32), "empty": ((0,), torch.float32), "b": ((7,), torch.bfloat16)}
    total = 3 * 5 * 4 + 7 * 2
    for bucket_bytes in (1, 7, 16, 60, 1 << 20):
        assert check_layout(manifest, plan_buckets(manifest, bucket_bytes)) == total
    plan = plan_buckets(manifest, 16)
    with pytest.raises(BucketError, match="carries 4 of the 14 bytes of 'b'"):
        check_layout(manifest, plan[:-1])  # the last bucket missing
    with pytest.raises(BucketError, match="does not list"):
        check_layout(manifest, [([TensorMeta("c", (1,), torch.float32, 0, 4, 0)], 4)] + plan)
    with pytest.raises(BucketError, match="does not follow"):
        check_layout(manifest, [plan[1], plan[0]] + plan[2:])
