"""verl checkpoint-engine backend "megatron_fp4": our bucket format and two completion points.

The actor side (`send_weights`) snapshots the weights into (name, shape, dtype, bytes) buckets
(`rollout.weight_sync.buckets`); `publish` returns at the first completion point (the immutable snapshot
exists: the trainer may change its weights; `on_snapshot` is called and `last_handle` is set
then), `send_weights` also waits for the second (every rollout loaded, else `WeightSyncError`
naming the rollout and the version). Version n+1 is not published before version n is loaded.
The rollout side (`receive_weights`) yields the reassembled (name, tensor) pairs of one whole
version as a `WeightStream` (`streams.py`); `MegatronFP4Rollout.update_weights` swaps them in under the
engine's write lock and acknowledges after the swap (or with the error), any other consumer
acknowledges by draining the stream. A name/shape/dtype mismatch is rejected before any weight is
overwritten: by the rollout engine's `load_weights`, or, with `validator=` (e.g.
`RolloutEngine.check_weights`), from the manifest before a single bucket is sent.

Topology and transport (`topology.py`): actor rank 0 is the only sender, other actor ranks drain
their generator; rollout workers are ranks 1..N. Workers that all live in one process use an
in-process channel; otherwise (verl's deployment) `init_process_group` builds a dedicated
token-authenticated store + ProcessGroupGloo/NCCL group (`PeerGroup`, never the default group; listening only on
the advertised address, joined only with the shared token, see SECURITY.md) and the buckets
travel by `rollout.weight_sync.distributed`'s protocol (header, go/no-go, bucket broadcasts, load
verdicts). verl rebuilds the group for every update (prepare → init_process_group → send/receive
→ finalize), so `finalize` waits for the in-flight version and tears the group down.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, Callable, Optional

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from megatron_fp4.verl.streams import Channel, DistStream, PendingStream, WeightStream, channel_named
from megatron_fp4.verl.topology import (TOKEN_ENV, PeerGroup, assign_ranks, host_address, new_sync_token,
                                        process_id, reserve_port, sync_token_from_env)
from megatron_fp4.parallel.mesh import resolve_device
from megatron_fp4.rollout.weight_sync.peer_group import check_advertised_address
from megatron_fp4.rollout.weight_sync.buckets import manifest_of, pack_buckets
from megatron_fp4.rollout.weight_sync.publisher import PublishHandle, WeightSyncError
from megatron_fp4.rollout.weight_sync.distributed import DistributedTransport

__all__ = ["MegatronFP4CheckpointEngine", "WeightStream"]

@CheckpointEngineRegistry.register("megatron_fp4")
class MegatronFP4CheckpointEngine(CheckpointEngine):
    """Args (verl passes `bucket_size`, `is_master` and `engine_kwargs`):
        bucket_size: bytes per bucket.
        channel: the in-process channel's name (workers of one process that share it talk).
        timeout_s: how long a step may wait for the peer (group timeout, ack wait).
        rollout_name: the rollout's name in `WeightSyncError`s (default `rollout<rank-1>` /
            `rollout0` in-process).
        master_addr: address the rollouts reach actor rank 0 at, and the only one its listener binds
            (default: Ray's node IP, else 127.0.0.1).
        device: "auto" | "cpu" | "cuda": where buckets travel (gloo on CPU, NCCL on CUDA).
        validator: optional manifest check on a rollout rank (raises on mismatch), so a mismatch
            stops the update before any bucket is sent ("dist" mode; in-process the rollout
            engine's `load_weights` rejects it, before any weight is overwritten, either way).
        on_snapshot: optional callback(PublishHandle) at the first completion point.
    """

    def __init__(self, bucket_size: int = 4 << 20, is_master: bool = False, channel: str = "default",
                 timeout_s: float = 600.0, rollout_name: Optional[str] = None, master_addr: Optional[str] = None,
                 device: str = "cpu", validator: Optional[Callable[[dict], None]] = None,
                 on_snapshot: Optional[Callable[[PublishHandle], None]] = None):
        self.bucket_size, self.is_master = int(bucket_size), is_master
        self.channel_name, self.timeout_s, self.rollout_name = channel, timeout_s, rollout_name
        if master_addr is not None:  # a wildcard would bind every interface: refused at construction
            check_advertised_address(master_addr, "master_addr")
        self.master_addr, self.device = master_addr, resolve_device(device)
        self.validator, self.on_snapshot = validator, on_snapshot
        self._channel: Optional[Channel] = None
        self._group: Optional[PeerGroup] = None
        self._transport: Optional[DistributedTransport] = None
        self._listen = None
        self._bind_error: Optional[str] = None
        self._inflight: Optional[PublishHandle] = None
        self.last_handle: Optional[PublishHandle] = None
        self._last_stream: Optional[DistStream] = None
        self.rank, self.world_size, self.mode = 0, 1, "inprocess"
        self._next_version = 1

    # -- topology --------------------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        """Every worker reports its process and a port reserved on the address it advertises; actor
        rank 0's become the master's. Without `MEGATRON_FP4_SYNC_TOKEN` in the environment each
        worker also reports a fresh token: the master's is the group's (verl's controller hands it
        to the rollouts with `master_metadata`, the path the address and port take)."""
        self._close_listen()
        addr = self.master_addr or host_address()
        try:
            self._listen, self._bind_error = reserve_port(addr), None
        except OSError as err:  # only fatal on the worker that turns out to be rank 0 (not known yet)
            self._bind_error = f"cannot listen on master_addr={addr!r} ({err}): give actor rank 0's own address"
        meta = {"process": process_id(), "addr": addr, "port": self._listen.getsockname()[1] if self._listen else None,
                "channel": self.channel_name, "bucket_size": self.bucket_size}
        if sync_token_from_env() is None:
            meta["token"] = new_sync_token()
        return meta

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list):
        return assign_ranks(actor_wg_world_size, rollout_world_size, metadata)

    def init_process_group(self, rank: int = 0, world_size: int = 2, master_metadata: Optional[dict] = None,
                           mode: str = "inprocess", channel: Optional[str] = None, **kwargs):
        if mode not in ("inprocess", "dist"):
            raise ValueError(f"mode={mode!r}: use 'inprocess' or 'dist' (build_topology chooses it)")
        self.rank, self.world_size, self.mode = rank, world_size, mode
        self.channel_name = channel or self.channel_name
        listen, self._listen = self._listen, None
        if mode == "inprocess" or rank < 0:
            if listen is not None:
                listen.close()
            if mode == "inprocess":
                self._channel = channel_named(self.channel_name)
            return
        if master_metadata is None:
            raise ValueError("init_process_group(mode='dist') needs master_metadata (actor rank 0's prepare())")
        if rank != 0 and listen is not None:
            listen.close()
        if rank == 0 and listen is None:
            raise ValueError(self._bind_error or "init_process_group(rank=0) needs this engine's prepare() first")
        token = sync_token_from_env() or master_metadata.get("token")
        if not token:
            raise ValueError(f"{TOKEN_ENV} is not set in this worker's environment but the publisher (actor rank 0) "
                             f"uses it: set the same {TOKEN_ENV} in every actor and rollout worker's environment")
        self._group = PeerGroup(master_metadata["addr"], master_metadata["port"], rank, world_size, self.device,
                                self.timeout_s, listen_socket=listen if rank == 0 else None, token=token)
        if rank == 0:
            self._transport = DistributedTransport(self._group, src=0, device=self.device)

    def finalize(self):
        """Wait for the in-flight version (if any), then drop the group / channel."""
        if self._inflight is not None:
            self._inflight.loaded.wait(self.timeout_s)
        if self._last_stream is not None:
            self._last_stream.wait()
            self._last_stream = None
        if self._group is not None:
            self._group.close()
        self._group = self._transport = self._channel = None
        self._close_listen()

    def _close_listen(self) -> None:
        if self._listen is not None:
            self._listen.close()
            self._listen = None

    def _chan(self) -> Channel:
        if self._channel is None:
            self.init_process_group(self.rank)
        return self._channel

    # -- actor side ------------------------------------------------------------------------------
    async def publish(self, weights, global_steps: Optional[int] = None) -> PublishHandle:
        """First completion point: returns once the immutable snapshot exists (and, in-process, is in
        the channel; across processes, its delivery runs on a background thread)."""
        if self.mode == "dist" and self._transport is None:
            raise RuntimeError(f"send_weights on checkpoint-engine rank {self.rank}: only actor rank 0 sends "
                               "(build_topology/init_process_group first)")
        if self._inflight is not None:  # never overlap updates: n must be done before n+1
            try:
                await self.wait_loaded(self._inflight)
            except WeightSyncError:
                pass  # reported to whoever waited on n (and kept on its handle); n+1 is a new try
        t0 = time.perf_counter()
        if hasattr(weights, "__aiter__"):
            named = [(n, t) async for n, t in weights]
        else:
            named = list(weights)
        version = int(global_steps) if global_steps is not None else self._next_version
        self._next_version = version + 1
        handle = PublishHandle(version)
        manifest = manifest_of(named)
        buckets = pack_buckets(named, self.bucket_size)
        handle.num_buckets, handle.num_bytes = len(buckets), sum(int(b.buffer.numel()) for b in buckets)
        if self.mode == "inprocess":
            self._chan().updates.put((handle.version, manifest, buckets))
        handle.snapshot_s = time.perf_counter() - t0
        handle._t_ready = time.perf_counter()
        handle.snapshot_ready.set()
        self._inflight = self.last_handle = handle
        if self.mode == "dist":
            threading.Thread(target=self._deliver, args=(handle, manifest, buckets), daemon=True,
                             name=f"ce-send-v{version}").start()
        if self.on_snapshot is not None:
            self.on_snapshot(handle)
        return handle

    def _deliver(self, handle: PublishHandle, manifest: dict, buckets: list) -> None:
        try:
            self._transport.send(handle.version, manifest, buckets)
        except WeightSyncError as err:
            handle.error = err
        except BaseException as err:  # noqa: BLE001 - every failure must reach the publisher
            handle.error = WeightSyncError({self._transport.name: f"{type(err).__name__}: {err}"}, handle.version)
        handle.load_s = time.perf_counter() - handle._t_ready
        handle.loaded.set()

    async def wait_loaded(self, handle: PublishHandle) -> PublishHandle:
        """Second completion point: every rollout loaded (raises WeightSyncError on failure)."""
        if self.mode == "dist":
            if not await asyncio.to_thread(handle.loaded.wait, self.timeout_s + 60):
                raise WeightSyncError({self._transport.name: "delivery did not finish"}, handle.version)
        elif not handle.loaded.is_set():
            try:
                version, error = await asyncio.to_thread(self._chan().acks.get, True, self.timeout_s)
            except queue.Empty:
                version, error = handle.version, f"no acknowledgement within {self.timeout_s}s (rollout gone?)"
            assert version == handle.version, (version, handle.version)
            handle.load_s = time.perf_counter() - handle._t_ready
            if error is not None:
                handle.error = WeightSyncError({self.rollout_name or "rollout0": error}, handle.version)
            handle.loaded.set()
        if handle.error is not None:
            raise handle.error
        return handle

    async def send_weights(self, weights, global_steps: Optional[int] = None):
        if self.rank < 0:  # not a sender: producing each weight may be collective over the actor group
            if hasattr(weights, "__aiter__"):
                async for _ in weights:
                    pass
            else:
                for _ in weights:
                    pass
            return {}
        handle = await self.publish(weights, global_steps)
        await self.wait_loaded(handle)
        return {"weight_sync/snapshot_s": handle.snapshot_s, "weight_sync/load_s": handle.load_s,
                "weight_sync/bytes": handle.num_bytes}

    # -- rollout side ----------------------------------------------------------------------------
    def receive_weights(self, global_steps: Optional[int] = None) -> WeightStream:
        """The next whole version as a stream of (name, tensor); acknowledge after the swap."""
        if self.mode == "dist":
            if self._group is None or self.rank < 1:
                raise RuntimeError(f"receive_weights on checkpoint-engine rank {self.rank}: only rollout ranks "
                                   "(1..N) receive (build_topology/init_process_group first)")
            if self._last_stream is not None:
                self._last_stream.wait()  # its load verdict must be on the wire before the next header
            self._last_stream = DistStream(self, self.rollout_name or f"rollout{self.rank - 1}")
            return self._last_stream
        return PendingStream(self._chan(), self.channel_name, self.timeout_s)
