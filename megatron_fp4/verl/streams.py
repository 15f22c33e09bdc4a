"""What the verl checkpoint engine's `receive_weights` returns: one whole version as a stream of
(name, tensor) with an explicit acknowledgement (`checkpoint_engine.py` documents the protocol).

`PendingStream` takes the version from an in-process channel; `DistStream` bridges the
weight-sync protocol (`rollout.weight_sync.distributed.DistributedReceiver`, serving on a background
thread) to the consumer, whose ack becomes the rollout's load verdict.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import Optional

from megatron_fp4.rollout.weight_sync.buckets import unpack_buckets
from megatron_fp4.rollout.weight_sync.publisher import WeightSyncError
from megatron_fp4.rollout.weight_sync.distributed import DistributedReceiver

_CHANNELS: dict = {}
_CHANNELS_LOCK = threading.Lock()


class Channel:
    """An in-process channel between the actor and the rollout workers of one process: updates out, acks back."""

    def __init__(self):
        self.updates: queue.Queue = queue.Queue()
        self.acks: queue.Queue = queue.Queue()


def channel_named(name: str) -> Channel:
    with _CHANNELS_LOCK:
        return _CHANNELS.setdefault(name, Channel())


class WeightStream:
    """What `receive_weights` returns: an (async) iterable of (name, tensor) with an explicit ack."""

    def __init__(self, channel: Channel, version: int, manifest: dict, buckets: list):
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


class PendingStream(WeightStream):
    """In-process `receive_weights`: returned at once, since verl calls `receive_weights` without
    awaiting and hands the result to the rollout's async `update_weights`; the next version is
    awaited off the event loop when the stream is iterated (blocking only a plain `for`)."""

    def __init__(self, channel: Channel, channel_name: str, timeout_s: float):
        super().__init__(channel, None, None, None)
        self._channel_name, self._timeout_s = channel_name, timeout_s

    def _arrive(self) -> None:
        if self.buckets is not None:
            return
        try:
            self.version, self.manifest, self.buckets = self.channel.updates.get(timeout=self._timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no weights published on channel {self._channel_name!r} within "
                               f"{self._timeout_s}s; call send_weights on the actor side first") from None

    def ack(self, error: Optional[str] = None) -> None:
        if self.buckets is not None:  # nothing arrived: no actor waits for this verdict
            super().ack(error)

    def __iter__(self):
        self._arrive()
        yield from super().__iter__()

    async def _agen(self):
        await asyncio.to_thread(self._arrive)
        for item in self:
            yield item


class RolloutLoadError(RuntimeError):
    """The rollout's consumer acknowledged a version with an error (reported to the actor)."""


class DistStream(WeightStream):
    """`WeightStream` of the "dist" mode. Serving one update of the weight-sync protocol runs on a
    background thread from `receive_weights` on; this object is the bridge: `DistributedReceiver`
    calls `validate` (header arrived) and `load` (buckets arrived; blocks until the consumer acks,
    so the load verdict the actor gathers is the consumer's)."""

    def __init__(self, engine, name: str):  # engine: the rollout rank's MegatronFP4CheckpointEngine
        self.name, self._validator, self._timeout_s = name, engine.validator, engine.timeout_s
        self.manifest = self.buckets = None
        self._version: Optional[int] = None
        self._manual = self._acked = False
        self._header, self._arrived = threading.Event(), threading.Event()
        self._acks: queue.Queue = queue.Queue()
        self._failure: Optional[BaseException] = None
        self._server = DistributedReceiver(self, engine._group, src=0, device=engine.device)
        self._thread = threading.Thread(target=self._serve, name=f"ce-recv-{name}", daemon=True)
        self._thread.start()

    # -- protocol side (background thread) ------------------------------------------------------
    def _serve(self) -> None:
        try:
            if not self._server.serve_one():
                self._failure = RuntimeError("the actor closed the weight-sync group")
            elif not self._server.versions and not self._arrived.is_set():  # no-go from the manifest
                version, why = self._server.errors[-1]
                self._failure = WeightSyncError({self.name: why}, version)
        except BaseException as err:  # noqa: BLE001 - the group broke (actor gone): tell the consumer
            self._failure = err
        finally:
            self._header.set()
            self._arrived.set()

    def validate(self, manifest: dict) -> None:
        self.manifest = manifest
        self._version = self._server.current_version
        self._header.set()
        if self._validator is not None:
            self._validator(manifest)

    def load(self, version: int, manifest: dict, buckets: list) -> None:
        self._version, self.buckets = version, buckets
        self._arrived.set()
        try:
            _, error = self._acks.get(timeout=self._timeout_s)
        except queue.Empty:
            raise RolloutLoadError(f"the rollout did not acknowledge within {self._timeout_s}s") from None
        if error is not None:
            raise RolloutLoadError(error)

    # -- consumer side ---------------------------------------------------------------------------
    @property
    def version(self) -> Optional[int]:
        """The version being delivered (waits for the header, which follows the actor's snapshot)."""
        self._header.wait(self._timeout_s)
        return self._version

    def ack(self, error: Optional[str] = None) -> None:
        if not self._acked:
            self._acked = True
            self._acks.put((self._version, error))

    def wait(self) -> None:
        """Block until the serving thread is done (after the ack)."""
        self._thread.join(self._timeout_s)

    def _take(self) -> list:
        if not self._arrived.wait(self._timeout_s):
            raise TimeoutError(f"no weights arrived within {self._timeout_s}s; is the actor's send_weights running?")
        if self._failure is not None:
            raise self._failure
        return self.buckets

    def __iter__(self):
        yield from unpack_buckets(self._take()).items()
        if not self._manual:
            self.ack()

    async def _agen(self):
        buckets = await asyncio.to_thread(self._take)
        for item in unpack_buckets(buckets).items():
            yield item
        if not self._manual:
            self.ack()
