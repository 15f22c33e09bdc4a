"""Trainer -> rollout weight updates with two completion points (verl's protocol).

    publisher = WeightPublisher(trainer_model, [InProcessTransport(WeightReceiver(engine))])
    handle = publisher.publish(version=step)    # returns once the snapshot exists: keep training
    ...
    handle.wait_loaded()                         # the rollouts now serve `step` (or WeightSyncError)

1. *snapshot ready*: `publish` copies the weights into byte buckets (`buckets.pack_buckets`) and
   returns; the trainer may change its weights at once.
2. *loaded*: in a background thread every transport delivers the buckets and waits until its
   rollout has validated, staged and swapped them in. The rollout side loads on its own thread
   (`WeightReceiver`) while generation continues; the swap takes the engine's write lock, so a
   request sees version n or n+1, whole.

`publish(n+1)` first waits until version n has finished loading: updates never overlap (the wait
is bounded by `WeightPublisher(timeout_s=...)`, and the engine's lock waits by
`RolloutEngine(lock_timeout_s=...)`, so a stuck request fails an update instead of hanging it). A rollout
that fails keeps serving its previous version; the failure surfaces as `WeightSyncError` naming the
rollout and the version (`handle.wait_loaded()`, `handle.error`). Name/shape/dtype mismatches are
rejected from the manifest, before any byte is staged or any weight overwritten.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from megatron_fp4.rollout.weight_sync.buckets import bucket_layout, manifest_of, pack_buckets, unpack_buckets


class WeightSyncError(RuntimeError):
    """A weight update failed on one or more rollouts; they keep serving their previous version."""

    def __init__(self, failures: dict, version: int):
        self.failures, self.version = dict(failures), version
        detail = "; ".join(f"rollout {name!r}: {msg}" for name, msg in self.failures.items())
        super().__init__(f"weight update to version {version} failed ({detail}); the failed rollouts keep "
                         "serving their previous version — fix the cause and publish again")


class WeightReceiver:
    """Rollout side: validates a manifest, stages the buckets into fresh tensors and swaps them
    into the engine, on its own loader thread (so the engine keeps generating meanwhile)."""

    def __init__(self, engine):
        self.engine = engine
        self.name = engine.name
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"weight-load-{engine.name}")
        self._alive = True

    def validate(self, manifest: dict) -> None:
        self.engine.check_weights(manifest)

    def load(self, version: int, manifest: dict, buckets) -> None:
        """Blocking: validate, stage, swap. Raises on any problem with the engine untouched."""
        self.validate(manifest)
        staged = self.stage(buckets)
        if manifest_of(staged.items()) != manifest:
            raise ValueError("the buckets do not match their manifest (a transport bug); nothing was loaded")
        self.engine.load_weights(staged, version)

    def stage(self, buckets) -> dict:
        """Reassemble the buckets into tensors the engine does not use yet (the staging copy)."""
        return unpack_buckets(buckets)

    def submit(self, version: int, manifest: dict, buckets):
        """Load in the background; returns a concurrent.futures.Future."""
        if not self._alive:
            raise RuntimeError("the rollout's weight loader is shut down (the rollout is gone)")
        return self._pool.submit(self.load, version, manifest, buckets)

    def close(self) -> None:
        """Stop the loader (a dead rollout): later updates fail with WeightSyncError."""
        self._alive = False
        self._pool.shutdown(wait=True)


class InProcessTransport:
    """Hands the snapshot's buckets (shared tensors, no copy) to a `WeightReceiver` in this process."""

    def __init__(self, receiver: WeightReceiver, timeout_s: Optional[float] = None):
        self.receiver, self.timeout_s = receiver, timeout_s
        self.name = receiver.name

    def send(self, version: int, manifest: dict, buckets: list) -> None:
        self.receiver.submit(version, manifest, buckets).result(timeout=self.timeout_s)


@dataclass
class PublishHandle:
    """The two completion points of one update. `loaded` is set when delivery has *finished*
    (successfully or not); `wait_loaded()` raises `WeightSyncError` if any rollout failed."""

    version: int
    snapshot_ready: threading.Event = field(default_factory=threading.Event)
    loaded: threading.Event = field(default_factory=threading.Event)
    error: Optional[WeightSyncError] = None
    snapshot_s: float = float("nan")  # publish() call -> snapshot ready
    load_s: float = float("nan")  # snapshot ready -> every rollout loaded
    num_bytes: int = 0
    num_buckets: int = 0
    per_rollout_s: dict = field(default_factory=dict)

    def wait_snapshot(self, timeout: Optional[float] = None) -> "PublishHandle":
        if not self.snapshot_ready.wait(timeout):
            raise TimeoutError(f"snapshot of version {self.version} not ready after {timeout}s")
        return self

    def wait_loaded(self, timeout: Optional[float] = None) -> "PublishHandle":
        if not self.loaded.wait(timeout):
            raise TimeoutError(f"version {self.version} not loaded by every rollout after {timeout}s")
        if self.error is not None:
            raise self.error
        return self

    @property
    def ok(self) -> bool:
        return self.loaded.is_set() and self.error is None


class WeightPublisher:
    """Trainer side. `source` is a module (its state_dict is published) or a callable returning
    `(name, tensor)` pairs; `transports` reach one rollout each (in-process or distributed)."""

    def __init__(self, source, transports: Sequence, bucket_bytes: int = 4 << 20, timeout_s: Optional[float] = 600.0):
        if timeout_s is not None and not (0 < timeout_s < float("inf")):
            raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds (or None to wait "
                             "forever): how long publish() waits for the previous version to finish loading")
        if not transports:
            raise ValueError("WeightPublisher needs at least one transport (one per rollout engine)")
        names = [t.name for t in transports]
        if len(set(names)) != len(names):
            raise ValueError(f"rollout names must be unique, got {names}; give each engine its own name=")
        self._named: Callable = source if callable(source) and not hasattr(source, "state_dict") \
            else (lambda: source.state_dict().items())
        self.transports = list(transports)
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self._lock = threading.Lock()
        self._inflight: Optional[PublishHandle] = None
        self.history: list = []

    def publish(self, version: int) -> PublishHandle:
        """Snapshot the weights and start delivering them; returns at the first completion point.
        Raises TimeoutError (nothing published) if the previous version is still loading after
        `timeout_s`."""
        with self._lock:
            previous = self._inflight
            if previous is not None and not previous.loaded.wait(self.timeout_s):  # n loads before n+1
                stuck = [t.name for t in self.transports if t.name not in previous.per_rollout_s]
                raise TimeoutError(f"publish({version}): version {previous.version} is still being delivered after "
                                   f"{self.timeout_s}s (WeightPublisher(timeout_s=...)); not finished: rollout(s) "
                                   f"{stuck} (e.g. a request holding the engine's lock; see RolloutEngine("
                                   "lock_timeout_s=...)). Nothing was published; publish again once they recover")
            handle = PublishHandle(int(version))
            t0 = time.perf_counter()
            manifest, buckets = self._snapshot()
            handle.num_buckets = len(buckets)
            handle.num_bytes = sum(nbytes for _, nbytes in bucket_layout(buckets))
            handle.snapshot_s = time.perf_counter() - t0
            handle.snapshot_ready.set()
            self._inflight = handle
            self.history.append(handle)
            threading.Thread(target=self._deliver, args=(handle, manifest, buckets, time.perf_counter()),
                             name=f"weight-publish-v{version}", daemon=True).start()
            return handle

    def _snapshot(self) -> tuple[dict, list]:
        """(manifest, buckets) of the weights now: a copy the trainer may overwrite at once."""
        named = list(self._named())
        return manifest_of(named), pack_buckets(named, self.bucket_bytes)

    def _deliver(self, handle: PublishHandle, manifest: dict, buckets: list, t_ready: float) -> None:
        failures: dict = {}

        def one(transport):
            t0 = time.perf_counter()
            try:
                transport.send(handle.version, manifest, buckets)
            except WeightSyncError as err:  # a transport serving several rollouts names each
                failures.update(err.failures)
            except BaseException as err:  # noqa: BLE001 - every failure must reach the publisher
                failures[transport.name] = f"{type(err).__name__}: {err}"
            handle.per_rollout_s[transport.name] = time.perf_counter() - t0

        threads = [threading.Thread(target=one, args=(t,), daemon=True) for t in self.transports]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        handle.load_s = time.perf_counter() - t_ready
        if failures:
            handle.error = WeightSyncError(failures, handle.version)
        handle.loaded.set()

    def wait(self, timeout: Optional[float] = None) -> Optional[PublishHandle]:
        """Wait for the in-flight update (if any) to finish loading; raises its WeightSyncError."""
        handle = self._inflight
        return handle.wait_loaded(timeout) if handle is not None else None
