"""GC-MoE's per-round state: the bounded receive ring's view and one dispatcher call's buffers and
signals (`Round`), shared by the transfer worker (`gcmoe_transfer.TransferChannel`) and the
compute side (`gcmoe.GCMoEDispatcher`). Split from gcmoe_transfer.py, which re-exports both."""
from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass, field

import torch


class RecvRing:
    """One round's view of the receive ring: ``num_slots`` slots of ``chunk_tokens`` rows.

    Only the transfer worker acquires (posts a receive into a free slot) and frees slots (when it
    processes the compute side's release message), so no lock is needed. ``in_use`` counts slots
    posted, filled or being consumed; ``high_water`` is its maximum over the round and
    ``acquired`` the number of receives posted (> num_slots: slots were reused)."""

    def __init__(self, storage: torch.Tensor):
        self.storage, self.num_slots = storage, storage.shape[0]
        self.free = collections.deque(range(self.num_slots))
        self.in_use = self.high_water = self.acquired = 0

    def acquire(self) -> int:
        slot = self.free.popleft()
        self.in_use += 1
        self.acquired += 1
        self.high_water = max(self.high_water, self.in_use)
        assert self.in_use <= self.num_slots
        return slot

    def release(self, slot: int) -> None:
        assert slot not in self.free and self.in_use > 0, f"slot {slot} released twice"
        self.free.append(slot)
        self.in_use -= 1

    def view(self, slot: int, rows: int) -> torch.Tensor:
        return self.storage[slot, :rows]

    def stats(self) -> dict:
        return {"slots": self.num_slots, "high_water": self.high_water, "acquired": self.acquired}


@dataclass
class Round:
    """Buffers and signals of one dispatcher call (what `TransferChannel.run_round` moves; the
    dispatcher in gcmoe.py builds it and computes on it). Blocks are src-major (recv) / dst-major (send)."""

    counter_set: int
    counters: torch.Tensor       # [ep] chunks marked ready per source (this round's set)
    ring: RecvRing               # bounded receive slots (transfer buffer)
    x_send: torch.Tensor         # [N_send, H] send order
    x_grouped: torch.Tensor      # [N_recv, H] staging: received rows in grouped order (experts' input)
    y_recv: torch.Tensor         # [N_recv, H] expert outputs in receive order
    y_send: torch.Tensor         # [N_send, H] outputs back, send order
    send_off: list[int]
    recv_off: list[int]
    send_bounds: list[list[tuple[int, int]]]
    recv_bounds: list[list[tuple[int, int]]]
    hook: object = None
    timeout_s: float = 300.0
    cond: threading.Condition = field(default_factory=threading.Condition)
    ready: collections.deque = field(default_factory=collections.deque)
    outbound: queue.Queue = field(default_factory=queue.Queue)
    error: BaseException | None = None
    done_event: object = None

    def send_chunk(self, dst, c):
        a, b = self.send_bounds[dst][c]
        return self.x_send[self.send_off[dst] + a:self.send_off[dst] + b]

    def back_chunk(self, dst, c):
        a, b = self.send_bounds[dst][c]
        return self.y_send[self.send_off[dst] + a:self.send_off[dst] + b]

    def out_chunk(self, src, c):
        a, b = self.recv_bounds[src][c]
        return self.y_recv[self.recv_off[src] + a:self.recv_off[src] + b]

    def mark_ready(self, src: int, c: int, slot, event) -> None:
        with self.cond:
            self.counters[src] += 1
            self.ready.append((src, c, slot, event))
            self.cond.notify_all()

    def release(self, slot: int, event) -> None:
        """Compute side: the rows of ring `slot` are staged (after `event`); the worker may repost it."""
        self.outbound.put(("free", slot, event))

    def output_done(self, src: int, c: int, event) -> None:
        """Compute side: the outputs for chunk `c` of `src` are in `y_recv` (after `event`)."""
        self.outbound.put(("out", src, c, event))

    def abort(self) -> None:
        """Compute side failed: the worker stops posting and returns."""
        self.outbound.put(("abort",))

    def next_ready(self):
        with self.cond:
            while not self.ready:
                if self.error is not None:
                    raise RuntimeError("GC-MoE transfer worker failed") from self.error
                if not self.cond.wait(timeout=self.timeout_s):
                    raise RuntimeError(f"GC-MoE: no chunk arrived within {self.timeout_s}s (peer hung?)")
            return self.ready.popleft()
