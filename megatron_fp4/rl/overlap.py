"""Rollout and training overlapped, with bounded staleness (``rl.max_staleness = k``).

    gens = Generations(rollout, timeout_s)            # one generation at a time, on a thread of its own
    batch = gens.submit(m, prompts, params, version=sample_version(m, k))
    ...                                               # the trainer updates on earlier batches meanwhile
    gen = gens.collect(batch)                         # the trainer waits here (async/wait_s)

Batch m is sampled with policy version ``sample_version(m, k) = max(0, m - k)``: while the trainer
updates on batch n (the proximal policy is version n, the behaviour policy version n - k), the
rollout generates batch n + k with version n. `rl.loop.run_grpo` drives it; the weight sync's two
completion points are what let the two sides run at once (the snapshot is ready: the trainer goes
on; loaded: the next rollout may start).

``rl.staleness_policy``:

- ``wait`` (deterministic): the trainer publishes version n + 1 only once batch n + k has been
  generated with version n, and the next rollout waits for that load, so every batch is generated
  with exactly its version whatever the timing: same command, same bits.
- ``drop`` (not deterministic: which versions sample which batch depends on timing): publishing
  does not wait for the rollout, generations take whatever version the rollout serves when they
  start, and a batch more than k versions older than the trainer is dropped (counted, never trained
  on) and replaced by a fresh one.

The generations run on one thread (`Generations`): the rollout's `generate`, or for a rollout with
`fetch`/`share` (`RemoteRollout`, `VLLMRollout`: a rollout process, also under torchrun) only rank
0's request on the thread and the broadcast to the trainer ranks on the caller's thread, so no
collective of the trainer's mesh runs beside the trainer's own. Every generation goes through it
(the greedy evals too), so a rollout's channel is never used by two threads at once. While the
trainer waits it polls the rollout process: if it died, one RuntimeError names it at once.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Optional, Sequence

POLL_S = 0.2  # how often a waiting trainer checks that the rollout process is alive


def sample_version(batch: int, max_staleness: int) -> int:
    """The policy version that samples batch `batch` (the synchronous loop: k = 0, version = batch)."""
    if batch < 0 or max_staleness < 0:
        raise ValueError(f"batch={batch} and max_staleness={max_staleness} must be >= 0")
    return max(0, batch - max_staleness)


def staleness(trained_at: int, version: int) -> int:
    """How many versions the trainer (at version `trained_at`) is ahead of the batch's sampler."""
    return trained_at - version


@dataclass
class InFlight:
    """One batch handed to the rollout: its index, requests and (``wait``) the version it must have."""
    index: int
    items: list
    prompts: list
    params: list
    version: Optional[int]  # None: whatever the rollout serves (``drop``)
    return_routing: bool = True
    future: Optional[Future] = None
    submitted: float = field(default_factory=time.perf_counter)


class Generations:
    """The rollout's generations on one thread of their own, in submission order (module doc)."""

    def __init__(self, rollout, timeout_s: float):
        self.rollout, self.timeout_s = rollout, float(timeout_s)
        self.sharded = hasattr(rollout, "fetch") and hasattr(rollout, "share")
        mesh = getattr(rollout, "mesh", None)
        if not self.sharded and mesh is not None and mesh.is_distributed:  # its generate is a collective
            raise ValueError(f"rl.max_staleness > 0 under torchrun needs a rollout with fetch/share (RemoteRollout, "
                             f"VLLMRollout); {type(rollout).__name__} generates collectively: set rl.max_staleness=0")
        self.source = getattr(rollout, "is_source", True)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-generate")
        self._lock = threading.Lock()
        self.busy_s = 0.0  # the rollout side's time generating (its idle time: the rest of the run)

    def _run(self, batch: InFlight):
        t0 = time.perf_counter()
        try:
            min_version = batch.version or 0
            if self.sharded:
                return self.rollout.fetch(batch.prompts, batch.params, batch.return_routing, min_version) \
                    if self.source else None
            return self.rollout.generate(batch.prompts, batch.params, return_routing=batch.return_routing,
                                         min_version=min_version)
        finally:
            with self._lock:
                self.busy_s += time.perf_counter() - t0

    def submit(self, index: int, items: list, prompts: list, params: list, version: Optional[int],
               return_routing: bool = True) -> InFlight:
        batch = InFlight(index, items, list(prompts), list(params), version, return_routing)
        batch.future = self._pool.submit(self._run, batch)
        return batch

    def restore(self, index: int, items: list, prompts: list, params: list, version: Optional[int],
                gen) -> InFlight:
        """A batch generated before a resume (`rl.resume`), as if it had come back from the rollout
        (rank 0 holds the generation, the other ranks get it from `collect`, as always)."""
        batch = InFlight(index, items, list(prompts), list(params), version)
        batch.future = Future()
        batch.future.set_result(gen if self.source else None)
        return batch

    def done(self, batch: InFlight) -> bool:
        return batch.future.done()

    def wait(self, batch: InFlight):
        """Wait for the batch's generation (rank 0's part of it under torchrun). Raises one
        RuntimeError if the rollout process died, or if the wait passes the sync timeout."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return batch.future.result(timeout=POLL_S)
            except FutureTimeout:
                self._check_alive(batch)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"batch {batch.index}: no generation from the rollout after {self.timeout_s:.0f}"
                                       " s (parallel.timeout_s); is the rollout stuck?") from None
            except Exception as err:
                self._check_alive(batch)
                raise RuntimeError(f"batch {batch.index}: the rollout failed: {type(err).__name__}: {err}") from err

    def collect(self, batch: InFlight):
        """The batch's generation on every rank (a sharded trainer: every rank calls this in the same order)."""
        gen = self.wait(batch)
        if self.sharded:
            gen = self.rollout.share(gen, batch.prompts, batch.params, batch.return_routing)
        assert batch.version is None or gen.version == batch.version, \
            f"batch {batch.index} was generated with version {gen.version}, expected {batch.version}"
        return gen

    def _check_alive(self, batch: InFlight) -> None:
        exit_code = getattr(self.rollout, "exit_code", None)
        code = exit_code() if exit_code is not None else None
        if code is not None:
            raise RuntimeError(f"the rollout process exited with code {code} while batch {batch.index} was in "
                               "flight (its error is printed above); the trainer stops here")

    def generate(self, prompts: Sequence, params: Sequence, return_routing: bool = False, min_version: int = 0):
        """The rollout's `generate` through this queue (the greedy evals): waits for it."""
        return self.collect(self.submit(-1, [], list(prompts), list(params), None, return_routing))

    def close(self) -> None:
        """Stop taking generations; one in progress is not waited for (the rollout's close ends it)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class StalenessCounter:
    """Per step: the batch's staleness, the trainer's wait, dropped batches; over the run: a histogram."""

    def __init__(self, max_staleness: int, policy: str):
        self.max_staleness, self.policy = max_staleness, policy
        self.histogram: dict = {}
        self.token_histogram: dict = {}  # {versions behind: tokens trained on}, versions per token
        self.dropped = 0

    def count_tokens(self, histogram: dict) -> None:
        """Add one trained batch's per-token staleness histogram; a token beyond the bound is a bug."""
        assert max(histogram, default=0) <= self.max_staleness, \
            f"tokens {histogram} trained beyond max_staleness={self.max_staleness}"
        for lag, n in histogram.items():
            self.token_histogram[lag] = self.token_histogram.get(lag, 0) + n

    def accept(self, trained_at: int, version: int) -> bool:
        """Whether a batch of `version` may be trained on at `trained_at`: within the bound, or
        (``drop``) counted as dropped. ``wait`` never gets a stale batch (an invariant)."""
        lag = staleness(trained_at, version)
        if lag > self.max_staleness:
            assert self.policy == "drop", f"a batch of version {version} reached step {trained_at} under 'wait'"
            self.dropped += 1
            return False
        self.histogram[lag] = self.histogram.get(lag, 0) + 1
        return True
