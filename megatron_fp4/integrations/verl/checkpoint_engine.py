"""verl checkpoint-engine backend "megatron_fp4": our bucket format and two completion points.

The actor side (`send_weights`) snapshots the weights into (name, shape, dtype, bytes) buckets
(`rollout.buckets`) and returns at the first completion point from `publish`; `send_weights`
also waits for the second (rollout loaded). The rollout side (`receive_weights`) yields the
reassembled (name, tensor) pairs as a `WeightStream`; `MegatronFP4Rollout` acknowledges after it
has swapped them in (or with the error), any other consumer acknowledges by draining the stream.
Version n+1 is not published before version n is acknowledged.

Transport: an in-process channel (actor and rollout engines colocated in one process, as in the
tests and the CPU example); `rollout.weight_sync_dist` carries the same buckets across processes.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, Optional

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from megatron_fp4.rollout.buckets import manifest_of, pack_buckets, unpack_buckets
from megatron_fp4.rollout.weight_sync import PublishHandle, WeightSyncError

_CHANNELS: dict = {}
_CHANNELS_LOCK = threading.Lock()


class _Channel:
    def __init__(self):
        self.updates: queue.Queue = queue.Queue()
        self.acks: queue.Queue = queue.Queue()


def _channel(name: str) -> _Channel:
    with _CHANNELS_LOCK:
        return _CHANNELS.setdefault(name, _Channel())


class WeightStream:
    """What `receive_weights` returns: an (async) iterable of (name, tensor) with an explicit ack."""

    def __init__(self, channel: _Channel, version: int, manifest: dict, buckets: list):
        self.channel, self.version, self.manifest, self.buckets = channel, version, manifest, buckets
        self._manual = False
        self._acked = False

    def claim_ack(self) -> None:
        """The consumer will call `ack` itself once the weights are really in use."""
        self._manual = True

    def ack(self, error: Optional[str] = None) -> None:
        if not self._acked:
            self._acked = True
            self.channel.acks.put((self.version, error))

    def __iter__(self):
        yield from unpack_buckets(self.buckets).items()
        if not self._manual:
            self.ack()

    async def _agen(self):
        for item in self:
            yield item

    def __aiter__(self):
        return self._agen()


@CheckpointEngineRegistry.register("megatron_fp4")
class MegatronFP4CheckpointEngine(CheckpointEngine):
    def __init__(self, bucket_size: int = 4 << 20, is_master: bool = False, channel: str = "default",
                 timeout_s: float = 600.0, rollout_name: str = "rollout0"):
        self.bucket_size, self.is_master = int(bucket_size), is_master
        self.channel_name, self.timeout_s, self.rollout_name = channel, timeout_s, rollout_name
        self._channel: Optional[_Channel] = None
        self._inflight: Optional[PublishHandle] = None
        self.rank = 0

    # -- topology (a single in-process rendezvous: every worker joins the same channel) ------------
    def prepare(self) -> dict[str, Any]:
        return {"channel": self.channel_name, "bucket_size": self.bucket_size}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list):
        channel = metadata[0]["channel"]
        actor = {"rank": list(range(actor_wg_world_size)), "channel": [channel] * actor_wg_world_size}
        rollout = {"rank": [actor_wg_world_size + i for i in range(rollout_world_size)],
                   "channel": [channel] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int = 0, channel: Optional[str] = None, **kwargs):
        self.rank = rank
        self.channel_name = channel or self.channel_name
        self._channel = _channel(self.channel_name)

    def finalize(self):
        self._channel = None

    def _chan(self) -> _Channel:
        if self._channel is None:
            self.init_process_group(self.rank)
        return self._channel

    # -- actor side ------------------------------------------------------------------------------
    async def publish(self, weights, global_steps: Optional[int] = None) -> PublishHandle:
        """First completion point: returns once the immutable snapshot is in the channel."""
        if self._inflight is not None:
            await self.wait_loaded(self._inflight)  # never overlap updates
        t0 = time.perf_counter()
        if hasattr(weights, "__aiter__"):
            named = [(n, t) async for n, t in weights]
        else:
            named = list(weights)
        handle = PublishHandle(int(global_steps or 0))
        buckets = pack_buckets(named, self.bucket_size)
        handle.num_buckets, handle.num_bytes = len(buckets), sum(int(b.buffer.numel()) for b in buckets)
        self._chan().updates.put((handle.version, manifest_of(named), buckets))
        handle.snapshot_s = time.perf_counter() - t0
        handle._t_ready = time.perf_counter()
        handle.snapshot_ready.set()
        self._inflight = handle
        return handle

    async def wait_loaded(self, handle: PublishHandle) -> PublishHandle:
        """Second completion point: the rollout acknowledged (raises WeightSyncError on failure)."""
        if not handle.loaded.is_set():
            try:
                version, error = await asyncio.to_thread(self._chan().acks.get, True, self.timeout_s)
            except queue.Empty:
                version, error = handle.version, f"no acknowledgement within {self.timeout_s}s (rollout gone?)"
            assert version == handle.version, (version, handle.version)
            handle.load_s = time.perf_counter() - handle._t_ready
            if error is not None:
                handle.error = WeightSyncError({self.rollout_name: error}, handle.version)
            handle.loaded.set()
        if handle.error is not None:
            raise handle.error
        return handle

    async def send_weights(self, weights, global_steps: Optional[int] = None):
        handle = await self.publish(weights, global_steps)
        await self.wait_loaded(handle)
        return {"weight_sync/snapshot_s": handle.snapshot_s, "weight_sync/load_s": handle.load_s}

    # -- rollout side ----------------------------------------------------------------------------
    def receive_weights(self, global_steps: Optional[int] = None) -> WeightStream:
        try:
            version, manifest, buckets = self._chan().updates.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no weights published on channel {self.channel_name!r} within "
                               f"{self.timeout_s}s; call send_weights on the actor side first") from None
        return WeightStream(self._chan(), version, manifest, buckets)
