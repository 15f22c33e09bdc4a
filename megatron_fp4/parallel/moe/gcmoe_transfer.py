"""GC-MoE transfer side: the bounded receive ring and the transfer worker (thread + own group).

Split from `gcmoe.py` (the dispatcher and its autograd Function), which documents the protocol.

Tag-free by design. NCCL ignores p2p tags (pytorch#94819) and matches a pair's sends and receives
in issue order; its p2p kernels run serially on one stream per pair (single ops) or per process
group (`batch_isend_irecv`, or any op once the group is bound to a device). The transfer therefore
uses tag 0 for everything and issues a round as a fixed sequence of *steps* that both ends of every
pair derive from the plan alone (`exchange_step`):

- dispatch steps k = 0, 1, ...: with every peer p, send my chunk k to p and receive p's chunk k
  (into a ring slot); then
- combine steps k = 0, 1, ...: send back my outputs for p's chunk k and receive p's outputs for my
  chunk k (straight into the caller's result).

Within a step and pair the lower rank sends first and the higher rank receives first, so the two
ends issue a pair's operations in the same order; every message matches its partner by position,
and a step's operations only wait on the same step of the peers, so no serial execution order can
deadlock (induction over (phase, step)). A step is issued as one `batch_isend_irecv` on CUDA (an
NCCL group) and as the same ops in the same order on gloo. The tests force tag 0 on gloo and check
the mirrored order pair by pair.

SM split (CUDA only, untested here): torch's `GreenContext.create(num_sms=n)` splits the *whole*
device and keeps the first group of n SMs (`cuDevSmResourceSplitByCount` with one group; the
remainder is dropped), so two independent creations overlap instead of partitioning. And NCCL's
kernels run on ProcessGroupNCCL's internal streams in the primary context, so a green context on
the transfer stream would not confine them anyway (only event waits run on that stream). What
this module does instead: one green context for the *compute* stream with ``num_sms -
transfer_sms`` SMs; the transfer stream is a plain stream, and the NCCL kernels it orders keep at
least ``transfer_sms`` SMs that GC-MoE's expert GEMMs never occupy. NCCL itself is capped to those
SMs by the group's NCCL config (``ProcessGroupNCCL.Options().config.max_ctas``, one CTA per SM),
set when `transfer_group` creates the transfer group on CUDA (`nccl_transfer_options`).
"""
from __future__ import annotations

import collections
import contextlib
import queue
import threading
from typing import Callable

import torch
import torch.distributed as dist

from megatron_fp4.parallel.moe.gcmoe_round import RecvRing, Round  # noqa: F401 (re-exported)

COMPUTE_GRANULARITIES = ("expert", "chunk")


def chunk_bounds(num_rows: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """Pure: [start, end) row ranges of the chunks a block of `num_rows` rows is sent in."""
    return [(a, min(a + chunk_tokens, num_rows)) for a in range(0, num_rows, chunk_tokens)]


def exchange_step(me: int, peers: list[int], num_send: list[int], num_recv: list[int],
                  k: int) -> list[tuple[str, int]]:
    """Pure: the operations of step `k` on rank `me`, in issue order, as ("send" | "recv", peer).

    ``num_send[p]`` / ``num_recv[p]`` are the chunks this rank sends to / receives from p in the
    phase; the chunk of step k is chunk k. With every peer the lower rank sends first, so rank a's
    list for peer b is rank b's list for peer a with send and recv swapped (same order)."""
    ops = []
    for p in peers:
        pair = [("send", p)] if k < num_send[p] else []
        recv = [("recv", p)] if k < num_recv[p] else []
        ops += pair + recv if me < p else recv + pair
    return ops


def issue_step(ops: list[tuple[str, int, torch.Tensor]], group, ep_ranks: list[int], device: torch.device) -> list:
    """Issue one step: ("send" | "recv", ep peer, tensor) in order, tag 0 (what NCCL honours).
    Returns the works to wait on. On CUDA the step is one NCCL group (its ops run concurrently)."""
    if device.type == "cuda" and ops:
        return dist.batch_isend_irecv([dist.P2POp(dist.isend if kind == "send" else dist.irecv, t,
                                                  ep_ranks[peer], group) for kind, peer, t in ops])
    fns = {"send": dist.isend, "recv": dist.irecv}  # looked up per call: tests wrap them (tag 0)
    return [fns[kind](t, ep_ranks[peer], group=group) for kind, peer, t in ops]


def compute_sms_split(total_sms: int, transfer_sms: int) -> int | None:
    """Pure: SMs of the compute green context leaving `transfer_sms` free, or None (no split)."""
    if transfer_sms <= 0 or transfer_sms >= total_sms:
        return None
    return total_sms - transfer_sms


def nccl_transfer_options(transfer_sms: int):
    """ProcessGroupNCCL options capping the transfer group's kernels at `transfer_sms` CTAs (one SM
    each), for whoever creates that group on CUDA; None where torch or NCCL lacks the knob."""
    try:
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.max_ctas = max(1, transfer_sms)
        return opts
    except (AttributeError, RuntimeError):
        return None


def transfer_group(mesh, transfer_sms: int):
    """This rank's transfer group: the mesh's second group over its ep ranks (gloo is not safe with
    two threads on one group). Collective the first time: every rank creates every ep group.

    On CUDA the group is created with `nccl_transfer_options` (NCCL's CTA cap, one SM per CTA), so
    the transfer kernels stay within ``transfer_sms`` SMs while the compute green context holds
    the rest; on CPU (and where the cap is unavailable) it is a plain group."""
    opts = nccl_transfer_options(transfer_sms) if mesh.device.type == "cuda" else None
    return mesh.second_group("ep", pg_options=opts)


def _green_streams(device: torch.device, transfer_sms: int):
    """(transfer_stream, compute_stream, keep-alive) or None where unsupported. GPU-only.

    One green context (compute) only: see the module docstring for why two creations overlap."""
    try:
        from torch.cuda import green_contexts
        if not green_contexts.SUPPORTED:
            return None
        total = torch.cuda.get_device_properties(device).multi_processor_count
        compute_sms = compute_sms_split(total, transfer_sms)
        if compute_sms is None:
            return None
        compute = green_contexts.GreenContext.create(num_sms=compute_sms, device_id=device.index)
        return torch.cuda.Stream(device), compute.Stream(), compute
    except (ImportError, RuntimeError, AttributeError):
        return None


class _Aborted(Exception):
    """The compute side failed; the transfer worker stops posting and returns."""


class TransferChannel:
    """The transfer worker's process group, (on CUDA) streams and the rank's receive ring storage;
    shared by all MoE layers of a rank (their rounds run one after another).

    Public API: `ring` (the round's receive ring), `exchange` (run one round: the worker thread
    moving the chunks while the caller's compute consumes them), `record_event` / `wait_event`
    (readiness across the two sides; no-ops on CPU), `ring_shape` and `ep_rank`."""

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
            # Create the NCCL communicator now, with every rank: a batched p2p op must not be a
            # group's first call unless every rank of the group takes part.
            dist.all_reduce(torch.zeros(1, device=device), group=group)

    def ring(self, num_slots: int, chunk_tokens: int, hidden: int, like: torch.Tensor) -> RecvRing:
        """The ring for one round: storage [num_slots, chunk_tokens, hidden], allocated once and
        reused (reallocated only if the shape/dtype/device changes)."""
        shape = (num_slots, chunk_tokens, hidden)
        st = self._ring_storage
        if st is None or tuple(st.shape) != shape or st.dtype != like.dtype or st.device != like.device:
            self._ring_storage = like.new_empty(shape)
        return RecvRing(self._ring_storage)

    @property
    def ring_shape(self) -> tuple[int, ...] | None:
        """Shape of the ring storage ([slots, chunk_tokens, hidden]); None before the first round."""
        return None if self._ring_storage is None else tuple(self._ring_storage.shape)

    def exchange(self, rnd: Round, compute: Callable[[], None], name: str = "gcmoe-transfer") -> None:
        """One round: `run_round` on its own thread while `compute()` (the caller's thread, on the
        compute stream) consumes the ready chunks. Returns once both are done and the worker's
        last transfer is visible to the compute stream; raises what the worker raised."""
        if self._busy:
            raise RuntimeError("GC-MoE rounds of one rank must not overlap (one ring per rank)")
        worker = threading.Thread(target=self.run_round, args=(rnd,), daemon=True, name=name)
        self._busy = True
        worker.start()
        try:
            with self._stream_ctx(self.compute_stream):
                compute()
        except BaseException:
            rnd.abort()
            raise
        finally:
            worker.join(timeout=rnd.timeout_s)
            self._busy = worker.is_alive()
        if rnd.error is not None:
            raise RuntimeError("GC-MoE transfer worker failed") from rnd.error
        if worker.is_alive():
            raise RuntimeError(f"GC-MoE transfer worker did not finish within {rnd.timeout_s}s")
        self.wait_event(rnd.done_event)

    # -- CUDA readiness helpers (no-ops on CPU) -------------------------------------------------
    def record_event(self):
        """An event after the current stream's work so far (None on CPU)."""
        return self._event()

    def wait_event(self, ev) -> None:
        """Make the current stream wait for `ev` (None: nothing to wait for)."""
        self._wait(ev)

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
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def run_round(self, rnd: Round) -> None:
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

    def _issue(self, ops: list[tuple[str, int, torch.Tensor]]) -> list:
        return issue_step(ops, self.group, self.ep_ranks, self.device)

    def _transfer(self, rnd: Round) -> None:
        """Dispatch steps as ring credits allow, then combine steps as outputs finish (module doc).
        Receives are awaited in posting order; each completion marks its chunk ready."""
        me, hook, ring = self.ep_rank, rnd.hook, rnd.ring
        peers = [p for p in range(len(self.ep_ranks)) if p != me]
        n_send = [len(b) for b in rnd.send_bounds]  # my chunks to p (and p's outputs back)
        n_recv = [len(b) for b in rnd.recv_bounds]  # p's chunks to me (and my outputs for them)
        n_recv[me] = n_send[me] = 0
        num_steps = max(n_send + n_recv)  # both phases: the same pairs' chunk counts, swapped
        assert max(n_recv) == 0 or len(peers) <= ring.num_slots, "a step needs one slot per peer"
        posted, send_works, back_works = collections.deque(), [], []
        k_in = k_out = 0
        finished = set()  # (src, chunk) output chunks the compute side finished

        def order(ops):  # tests may permute a step's pairs (independent under NCCL semantics)
            return list(hook.order(ops)) if hook is not None and hasattr(hook, "order") else ops

        while True:
            while k_in < num_steps and len(ring.free) >= sum(k_in < n_recv[p] for p in peers):
                ops, slots = [], []
                for kind, p in exchange_step(me, order(peers), n_send, n_recv, k_in):
                    if kind == "send":
                        _delay(hook, "send", p, k_in)
                        ops.append(("send", p, rnd.send_chunk(p, k_in)))
                        slots.append(None)
                    else:
                        slots.append(ring.acquire())
                        a, b = rnd.recv_bounds[p][k_in]
                        ops.append(("recv", p, ring.view(slots[-1], b - a)))
                for (kind, p, _), slot, work in zip(ops, slots, self._issue(ops)):
                    if kind == "send":
                        send_works.append(work)
                    else:
                        posted.append((p, k_in, slot, work))
                k_in += 1
            while (k_in == num_steps and k_out < num_steps
                   and all((p, k_out) in finished for p in peers if k_out < n_recv[p])):
                ops = []
                for kind, p in exchange_step(me, order(peers), n_recv, n_send, k_out):
                    if kind == "send":
                        _delay(hook, "send_back", p, k_out)
                        ops.append(("send", p, rnd.out_chunk(p, k_out)))
                    else:
                        ops.append(("recv", p, rnd.back_chunk(p, k_out)))
                back_works += self._issue(ops)
                k_out += 1
            if k_in == num_steps and k_out == num_steps and not posted and ring.in_use == 0:
                break
            if posted:
                src, c, slot, work = posted.popleft()
                work.wait()
                _delay(hook, "recv", src, c)
                rnd.mark_ready(src, c, slot, self._event())
            # Nothing posted: every used slot waits for the compute side, which will release it
            # (or finish an output chunk): block for that.
            finished |= self._drain(rnd, block=not posted)
        for w in back_works + send_works:
            w.wait()
        rnd.done_event = self._event()

    def _drain(self, rnd: Round, block: bool) -> set:
        """Handle the compute side's messages: slot releases and finished output chunks."""
        done = set()
        while True:
            try:
                msg = rnd.outbound.get(block=block, timeout=rnd.timeout_s if block else None)
            except queue.Empty:
                if block:
                    raise RuntimeError(f"GC-MoE: compute side idle for {rnd.timeout_s}s") from None
                return done
            block = False
            if msg[0] == "abort":
                raise _Aborted
            self._wait(msg[-1])  # the copy out of the slot / the output chunk is done
            if msg[0] == "free":
                rnd.ring.release(msg[1])
            else:
                done.add((msg[1], msg[2]))


def _delay(hook, event: str, peer: int, chunk: int) -> None:
    if hook is not None and hasattr(hook, "delay"):
        hook.delay(event, peer, chunk)
