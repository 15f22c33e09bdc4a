"""GC-MoE transfer side: the bounded receive ring and the transfer worker (thread + own group).

Split from `gcmoe.py` (the dispatcher and its autograd Function), which documents the protocol:
chunked sends tagged by (counter set, direction, chunk), a ring of `ring_slots` receive slots with
credit-based reposting, per-chunk ready signals, double-buffered receive counters.
"""
from __future__ import annotations

import collections
import queue
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_fp4.parallel.gcmoe import _Round

_IN, _OUT = 0, 1  # tag directions: tokens in, expert outputs back

COMPUTE_GRANULARITIES = ("expert", "chunk")
_CHUNK_BITS = 20


def chunk_bounds(num_rows: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """Pure: [start, end) row ranges of the chunks a block of `num_rows` rows is sent in."""
    return [(a, min(a + chunk_tokens, num_rows)) for a in range(0, num_rows, chunk_tokens)]


def chunk_tag(counter_set: int, direction: int, chunk: int) -> int:
    assert chunk < (1 << _CHUNK_BITS), "too many chunks in one round; raise gcmoe_chunk_tokens"
    return ((counter_set * 2 + direction) << _CHUNK_BITS) | chunk


def _green_streams(device: torch.device, transfer_sms: int):
    """(transfer_stream, compute_stream) on SM partitions, or None where unsupported. GPU-only."""
    try:
        from torch.cuda import green_contexts
        if not green_contexts.SUPPORTED or transfer_sms <= 0:
            return None
        total = torch.cuda.get_device_properties(device).multi_processor_count
        if transfer_sms >= total:
            return None
        make = green_contexts.GreenContext.create
        transfer = make(num_sms=transfer_sms, device_id=device.index)
        compute = make(num_sms=total - transfer_sms, device_id=device.index)
        return transfer.Stream(), compute.Stream(), (transfer, compute)
    except (ImportError, RuntimeError, AttributeError):
        return None


class _Aborted(Exception):
    """The compute side failed; the transfer worker stops posting and returns."""


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


class TransferChannel:
    """The transfer worker's process group, (on CUDA) streams and the rank's receive ring storage;
    shared by all MoE layers of a rank (their rounds run one after another)."""

    def __init__(self, group, ep_ranks: list[int], device: torch.device, transfer_sms: int = 20):
        self.group, self.ep_ranks, self.device = group, list(ep_ranks), device
        self.ep_rank = self.ep_ranks.index(dist.get_rank())
        self.transfer_stream = self.compute_stream = None
        self._green = None
        self._ring_storage = None
        self._busy = False
        if device.type == "cuda":  # GPU-only path, guarded: plain side streams if no green contexts
            split = _green_streams(device, transfer_sms)
            if split is not None:
                self.transfer_stream, self.compute_stream, self._green = split
            else:
                self.transfer_stream = torch.cuda.Stream(device)

    def ring(self, num_slots: int, chunk_tokens: int, hidden: int, like: torch.Tensor) -> RecvRing:
        """The ring for one round: storage [num_slots, chunk_tokens, hidden], allocated once and
        reused (reallocated only if the shape/dtype/device changes)."""
        shape = (num_slots, chunk_tokens, hidden)
        st = self._ring_storage
        if st is None or tuple(st.shape) != shape or st.dtype != like.dtype or st.device != like.device:
            self._ring_storage = like.new_empty(shape)
        return RecvRing(self._ring_storage)

    # -- CUDA readiness helpers (no-ops on CPU) -------------------------------------------------
    def _event(self):
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    @staticmethod
    def _wait(ev) -> None:
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)

    def _stream_ctx(self, stream):
        return torch.cuda.stream(stream) if stream is not None else _nullctx()

    def run_round(self, rnd: "_Round") -> None:
        """Worker body (own thread). Any exception is stored on `rnd` and wakes the compute side."""
        try:
            with self._stream_ctx(self.transfer_stream):
                self._transfer(rnd)
        except _Aborted:
            pass
        except BaseException as exc:  # surfaced by the compute side
            with rnd.cond:
                rnd.error = exc
                rnd.cond.notify_all()

    def _transfer(self, rnd: "_Round") -> None:
        me, g, hook, ring = self.ep_rank, self.group, rnd.hook, rnd.ring
        peers = [p for p in range(len(self.ep_ranks)) if p != me]
        # Outputs come back straight into the caller's result (send order): no ring needed there.
        back_works = [dist.irecv(rnd.back_chunk(dst, c), self.ep_ranks[dst], group=g,
                                 tag=chunk_tag(rnd.counter_set, _OUT, c))
                      for dst in peers for c in range(len(rnd.send_bounds[dst]))]
        # Receive (posting) order: chunk-major over sources; the test hook may permute it freely.
        pending = [(src, c) for c in range(max([len(rnd.recv_bounds[s]) for s in peers] + [0]))
                   for src in peers if c < len(rnd.recv_bounds[src])]
        if hook is not None and hasattr(hook, "order"):
            pending = list(hook.order(pending))
        num_out = len(pending)
        pending = collections.deque(pending)
        posted = collections.deque()

        def post():  # credits: one receive per free slot
            while ring.free and pending:
                src, c = pending.popleft()
                slot = ring.acquire()
                a, b = rnd.recv_bounds[src][c]
                work = dist.irecv(ring.view(slot, b - a), self.ep_ranks[src], group=g,
                                  tag=chunk_tag(rnd.counter_set, _IN, c))
                posted.append((src, c, slot, work))

        post()
        send_works = []
        num_send = max([len(rnd.send_bounds[d]) for d in peers] + [0])
        for c in range(num_send):  # chunk-major over destinations so every peer starts early
            for dst in peers:
                if c < len(rnd.send_bounds[dst]):
                    _delay(hook, "send", dst, c)
                    send_works.append(dist.isend(rnd.send_chunk(dst, c), self.ep_ranks[dst], group=g,
                                                 tag=chunk_tag(rnd.counter_set, _IN, c)))
        sent_out = 0
        while posted or pending or sent_out < num_out or ring.in_use:
            if posted:
                src, c, slot, work = posted.popleft()
                work.wait()
                _delay(hook, "recv", src, c)
                rnd.mark_ready(src, c, slot, self._event())
            # Nothing posted: every used slot is filled and waits for the compute side, which
            # will release it (or finish an output chunk): block for that.
            sent_out += self._drain(rnd, send_works, block=not posted)
            post()
        for w in back_works + send_works:
            w.wait()
        rnd.done_event = self._event()

    def _drain(self, rnd: "_Round", send_works: list, block: bool) -> int:
        """Handle the compute side's messages: slot releases and finished output chunks."""
        sent = 0
        while True:
            try:
                msg = rnd.outbound.get(block=block, timeout=rnd.timeout_s if block else None)
            except queue.Empty:
                if block:
                    raise RuntimeError(f"GC-MoE: compute side idle for {rnd.timeout_s}s") from None
                return sent
            block = False
            if msg[0] == "abort":
                raise _Aborted
            self._wait(msg[-1])  # the copy out of the slot / the output chunk is done
            if msg[0] == "free":
                rnd.ring.release(msg[1])
                continue
            _, src, c, _ = msg
            _delay(rnd.hook, "send_back", src, c)
            send_works.append(dist.isend(rnd.out_chunk(src, c), self.ep_ranks[src], group=self.group,
                                         tag=chunk_tag(rnd.counter_set, _OUT, c)))
            sent += 1


class _nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _delay(hook, event: str, peer: int, chunk: int) -> None:
    if hook is not None and hasattr(hook, "delay"):
        hook.delay(event, peer, chunk)
