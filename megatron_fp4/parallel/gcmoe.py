"""GC-MoE: expert-parallel dispatch with token transfer and expert compute overlapped.

One dispatcher call (a *round*) on ep rank r:

1. Counts are exchanged (`DispatchPlan.exchange`, one small all-to-all on the ep group).
2. A transfer worker (`TransferChannel.run_round`, its own Python thread and its own process
   group) posts every receive, then sends this rank's rows to each destination in chunks of
   ``chunk_tokens`` rows (tag = counter set, direction, chunk index). Each chunk lands in the
   round's receive buffer, a chunk-slotted buffer laid out src-major; when its receive completes
   (`work.wait()`) the worker marks it ready: it bumps ``counters[round % 2][src]`` and queues
   ``src`` on the ready list.
3. The compute side (the caller's thread) takes ready chunks in arrival order and runs the local
   experts while later chunks are in flight. Granularity (``compute=``):
   - ``"expert"`` (default, bit-exact by construction): an expert runs as soon as *all* its rows
     (from every source) are in, on exactly the batch `AllToAllDispatcher` gives it. Rows are sent
     sorted by local expert, so expert 0 runs while the rows of experts 1.. are still arriving.
   - ``"chunk"``: each chunk's rows run at once, split at local-expert boundaries (finest overlap).
     Bitwise only where the GEMM library is row-invariant for the segment sizes; MKL on CPU takes
     other kernels for tiny M (1–2 rows, up to ~10 for some shapes), giving ~1e-6 relative
     differences (measured; see tests/distributed/test_expert_parallel_gcmoe.py).
   Finished output chunks go back to the worker, which sends them to their source at once.
4. When the worker has received every output chunk, the rows are un-permuted and combined with
   `combine_expert_outputs` (ascending expert index, never arrival order).

Receive counters are double-buffered: round i resets and uses set ``i % 2``, leaving set
``(i+1) % 2`` (the previous round's, possibly still read by a slow peer on a GPU) untouched, so a
round never waits on other ranks just to reset a counter. Tags carry the set, so the messages of
consecutive rounds cannot be confused either.

Numerics: with ``compute="expert"`` every expert GEMM gets the same rows in the same order as the
baseline, so the output is bit-identical to `AllToAllDispatcher` and the single-process layer
whatever the arrival order (tested with injected delays and shuffled arrival orders). With
``compute="chunk"`` FP4 activation quantization is still per-row (batch invariant with the default
``scale='row'``; stochastic rounding of forward activations draws per call and is not).
Backward does NOT run per chunk: wgrad sums over tokens (and FP4 wgrad quantizes along the token
dim), so per-chunk partial sums would change the bits. The received rows are kept in grouped order
and backward recomputes the experts' forward on the whole batch and differentiates it (expert-level
activation recompute), with the gradient exchange on the baseline variable-split all-to-all of the
ep group. Gradients are therefore bitwise those of `AllToAllDispatcher`.

Device mechanism: on CPU (the tested reference) the worker is a thread doing gloo isend/irecv on a
dedicated group (gloo is unsafe with two threads on one group). On CUDA (guarded, untested here) the
worker issues the same ops under a transfer stream; readiness crosses threads as CUDA events
(compute stream waits on the event recorded after the receive), and when
`torch.cuda.green_contexts` is supported the transfer and compute streams come from green contexts
with ``transfer_sms`` and ``num_sms - transfer_sms`` SMs.
"""
from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_fp4.model.moe import GroupedExperts
from megatron_fp4.parallel.ep_alltoall import DispatchPlan, all_to_all_rows, finish_combine, scatter_rows

_IN, _OUT = 0, 1
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


class TransferChannel:
    """The transfer worker's process group and (on CUDA) streams; shared by all MoE layers of a rank."""

    def __init__(self, group, ep_ranks: list[int], device: torch.device, transfer_sms: int = 20):
        self.group, self.ep_ranks, self.device = group, list(ep_ranks), device
        self.ep_rank = self.ep_ranks.index(dist.get_rank())
        self.transfer_stream = self.compute_stream = None
        self._green = None
        if device.type == "cuda":  # GPU-only path, guarded: plain side streams if no green contexts
            split = _green_streams(device, transfer_sms)
            if split is not None:
                self.transfer_stream, self.compute_stream, self._green = split
            else:
                self.transfer_stream = torch.cuda.Stream(device)

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
        except BaseException as exc:  # surfaced by the compute side
            with rnd.cond:
                rnd.error = exc
                rnd.cond.notify_all()

    def _transfer(self, rnd: "_Round") -> None:
        me, g, hook = self.ep_rank, self.group, rnd.hook
        peers = [p for p in range(len(self.ep_ranks)) if p != me]
        recv_works = {src: [dist.irecv(rnd.recv_chunk(src, c), self.ep_ranks[src], group=g,
                                       tag=chunk_tag(rnd.counter_set, _IN, c))
                            for c in range(len(rnd.recv_bounds[src]))] for src in peers}
        back_works = [dist.irecv(rnd.back_chunk(dst, c), self.ep_ranks[dst], group=g,
                                 tag=chunk_tag(rnd.counter_set, _OUT, c))
                      for dst in peers for c in range(len(rnd.send_bounds[dst]))]
        send_works = []
        num_send = max([len(rnd.send_bounds[d]) for d in peers] + [0])
        for c in range(num_send):  # chunk-major over destinations so every peer starts early
            for dst in peers:
                if c < len(rnd.send_bounds[dst]):
                    _delay(hook, "send", dst, c)
                    send_works.append(dist.isend(rnd.send_chunk(dst, c), self.ep_ranks[dst], group=g,
                                                 tag=chunk_tag(rnd.counter_set, _IN, c)))
        arrivals = [src for c in range(max([len(w) for w in recv_works.values()] + [0]))
                    for src in peers if c < len(recv_works[src])]
        if hook is not None and hasattr(hook, "order"):
            arrivals = list(hook.order(arrivals))
        num_out = sum(len(w) for w in recv_works.values())
        sent_out, next_chunk = 0, collections.Counter()
        for src in arrivals:
            c = next_chunk[src]
            next_chunk[src] += 1
            recv_works[src][c].wait()
            _delay(hook, "recv", src, c)
            rnd.mark_ready(src, self._event())
            sent_out += self._send_outputs(rnd, send_works, block=False)
        while sent_out < num_out:
            sent_out += self._send_outputs(rnd, send_works, block=True)
        for w in back_works + send_works:
            w.wait()
        rnd.done_event = self._event()

    def _send_outputs(self, rnd: "_Round", send_works: list, block: bool) -> int:
        sent = 0
        while True:
            try:
                src, c, ev = rnd.outbound.get(block=block and sent == 0)
            except queue.Empty:
                return sent
            self._wait(ev)
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


@dataclass
class _Round:
    """Buffers and signals of one dispatcher call. Blocks are src-major (recv) / dst-major (send)."""

    counter_set: int
    counters: torch.Tensor       # [ep] chunks marked ready per source (this round's set)
    x_send: torch.Tensor         # [N_send, H] send order
    x_recv: torch.Tensor         # [N_recv, H] receive buffer, chunk-slotted, src-major
    y_recv: torch.Tensor         # [N_recv, H] expert outputs in receive order
    y_send: torch.Tensor         # [N_send, H] outputs back, send order
    send_off: list[int]
    recv_off: list[int]
    send_bounds: list[list[tuple[int, int]]]
    recv_bounds: list[list[tuple[int, int]]]
    hook: object = None
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

    def recv_chunk(self, src, c):
        a, b = self.recv_bounds[src][c]
        return self.x_recv[self.recv_off[src] + a:self.recv_off[src] + b]

    def out_chunk(self, src, c):
        a, b = self.recv_bounds[src][c]
        return self.y_recv[self.recv_off[src] + a:self.recv_off[src] + b]

    def mark_ready(self, src: int, event) -> None:
        with self.cond:
            self.counters[src] += 1
            self.ready.append((src, event))
            self.cond.notify_all()

    def next_ready(self, timeout_s: float):
        with self.cond:
            while not self.ready:
                if self.error is not None:
                    raise RuntimeError("GC-MoE transfer worker failed") from self.error
                if not self.cond.wait(timeout=timeout_s):
                    raise RuntimeError(f"GC-MoE: no chunk arrived within {timeout_s}s (peer hung?)")
            return self.ready.popleft()


def _offsets(splits: list[int]) -> list[int]:
    out = [0]
    for s in splits[:-1]:
        out.append(out[-1] + s)
    return out


class GCMoEDispatcher:
    """Expert-parallel dispatcher overlapping chunked token transfer with expert compute.

    Same call signature and bits as `AllToAllDispatcher`. ``round`` counts calls; ``counters`` are
    the two receive-counter sets (round i uses ``counters[i % 2]``). ``chunk_tokens`` must be the same
    on every ep rank (it is a config value): both ends derive the chunk boundaries from it. ``test_hook`` (tests only) may
    define ``delay(event, peer, chunk)`` (called on the transfer thread) and ``order(list)``
    (permutes the order in which chunks from different sources are awaited and marked ready).
    """

    timeout_s = 300.0

    def __init__(self, group, ep: int, num_experts: int, channel: TransferChannel, chunk_tokens: int = 64,
                 compute: str = "expert"):
        if chunk_tokens < 1:
            raise ValueError(f"parallel.gcmoe_chunk_tokens={chunk_tokens} must be >= 1")
        if compute not in COMPUTE_GRANULARITIES:
            raise ValueError(f"GCMoEDispatcher compute={compute!r} must be one of {COMPUTE_GRANULARITIES}")
        self.group, self.ep, self.num_experts = group, ep, num_experts
        self.channel, self.chunk_tokens, self.compute = channel, chunk_tokens, compute
        self.round = 0
        self.counters = [torch.zeros(ep, dtype=torch.int64), torch.zeros(ep, dtype=torch.int64)]
        self.last_counter_set = None
        self.test_hook = None

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor:
        assert experts.num_experts * self.ep == self.num_experts, "experts are not this rank's share"
        plan = DispatchPlan.exchange(topk_idx, self.num_experts, self.ep, self.group)
        y_send = _GCMoEFunction.apply(x[plan.token_of_row], experts.w13, experts.w2, self, experts, plan)
        return finish_combine(y_send, plan, topk_idx, topk_w)

    def overlapped_forward(self, x_send: torch.Tensor, experts: GroupedExperts, plan: DispatchPlan):
        """Forward of one round without autograd: returns (y_send, x_grouped)."""
        s = self.round % 2
        self.round += 1
        self.last_counter_set = s
        counters = self.counters[s]
        counters.zero_()  # last used two rounds ago: every peer is past it
        me, C = self.channel.ep_rank, self.chunk_tokens
        in_splits, out_splits = plan.in_splits, plan.out_splits
        H = x_send.shape[-1]
        rnd = _Round(s, counters, x_send.contiguous(), x_send.new_empty(sum(out_splits), H),
                     x_send.new_empty(sum(out_splits), H), x_send.new_empty(sum(in_splits), H),
                     _offsets(in_splits), _offsets(out_splits),
                     [chunk_bounds(n, C) for n in in_splits], [chunk_bounds(n, C) for n in out_splits],
                     hook=self.test_hook)
        # Rows for my own experts need no transfer: ready at once.
        own = slice(rnd.send_off[me], rnd.send_off[me] + in_splits[me])
        rnd.x_recv[rnd.recv_off[me]:rnd.recv_off[me] + out_splits[me]] = rnd.x_send[own]
        for _ in rnd.recv_bounds[me]:
            rnd.mark_ready(me, None)
        worker = threading.Thread(target=self.channel.run_round, args=(rnd,), daemon=True,
                                  name=f"gcmoe-transfer-r{self.round - 1}")
        worker.start()
        try:
            with self.channel._stream_ctx(self.channel.compute_stream):
                self._compute(rnd, experts, plan)
        finally:
            worker.join(timeout=self.timeout_s)
        if rnd.error is not None:
            raise RuntimeError("GC-MoE transfer worker failed") from rnd.error
        assert not worker.is_alive(), "GC-MoE transfer worker did not finish"
        self.channel._wait(rnd.done_event)
        rnd.y_send[own] = rnd.y_recv[rnd.recv_off[me]:rnd.recv_off[me] + out_splits[me]]
        return rnd.y_send, rnd.x_recv[plan.perm]

    def _compute(self, rnd: _Round, experts: GroupedExperts, plan: DispatchPlan) -> None:
        """Consume ready chunks in arrival order; hand finished output chunks to the worker."""
        me, num_local = self.channel.ep_rank, experts.num_experts
        starts = [_offsets(plan.recv_counts[src].tolist()) + [int(plan.recv_counts[src].sum())]
                  for src in range(self.ep)]

        def segments(src, c):  # (local expert, lo, hi) row ranges of chunk c inside src's block
            a, b = rnd.recv_bounds[src][c]
            return [(le, max(a, starts[src][le]), min(b, starts[src][le + 1])) for le in range(num_local)
                    if max(a, starts[src][le]) < min(b, starts[src][le + 1])]

        # "expert" granularity: an expert runs once all its rows are in, on its whole batch.
        missing = list(plan.local_counts)
        group_start = _offsets(plan.local_counts)
        chunks_of_expert = collections.defaultdict(list)
        waiting = {}
        for src in range(self.ep):
            for c in range(len(rnd.recv_bounds[src])):
                segs = segments(src, c)
                waiting[(src, c)] = len(segs)
                for le, _, _ in segs:
                    chunks_of_expert[le].append((src, c))
        consumed = [0] * self.ep
        for _ in range(len(waiting)):
            src, event = rnd.next_ready(self.timeout_s)
            c = consumed[src]
            consumed[src] += 1
            self.channel._wait(event)
            finished = []
            with torch.no_grad():
                for le, lo, hi in segments(src, c):
                    if self.compute == "chunk":
                        rows = slice(rnd.recv_off[src] + lo, rnd.recv_off[src] + hi)
                        rnd.y_recv[rows] = experts.expert_forward(le, rnd.x_recv[rows])
                        finished.append((src, c))
                        continue
                    missing[le] -= hi - lo
                    if missing[le] == 0:
                        idx = plan.perm[group_start[le]:group_start[le] + plan.local_counts[le]]
                        rnd.y_recv[idx] = experts.expert_forward(le, rnd.x_recv[idx])
                        finished.extend(chunks_of_expert[le])
            for key in finished:
                waiting[key] -= 1
                if waiting[key] == 0 and key[0] != me:
                    rnd.outbound.put((key[0], key[1], self.channel._event()))


class _GCMoEFunction(torch.autograd.Function):
    """Overlapped forward; backward = baseline all-to-all of gradients + whole-batch expert recompute."""

    @staticmethod
    def forward(ctx, x_send, w13, w2, dispatcher: GCMoEDispatcher, experts: GroupedExperts, plan: DispatchPlan):
        y_send, x_grouped = dispatcher.overlapped_forward(x_send, experts, plan)
        ctx.save_for_backward(x_grouped)
        ctx.dispatcher, ctx.experts, ctx.plan = dispatcher, experts, plan
        return y_send

    @staticmethod
    def backward(ctx, grad_send):
        (x_grouped,) = ctx.saved_tensors
        plan, experts, group = ctx.plan, ctx.experts, ctx.dispatcher.group
        grad_recv = all_to_all_rows(grad_send, plan.out_splits, plan.in_splits, group)
        with torch.enable_grad():
            xg = x_grouped.detach().requires_grad_(True)
            y = experts(xg, plan.local_counts)
            dx, dw13, dw2 = torch.autograd.grad(y, [xg, experts.w13, experts.w2], grad_recv[plan.perm],
                                                allow_unused=True)
        dx = torch.zeros_like(xg) if dx is None else dx
        dw13 = torch.zeros_like(experts.w13) if dw13 is None else dw13
        dw2 = torch.zeros_like(experts.w2) if dw2 is None else dw2
        dx_recv = scatter_rows(dx, plan.perm, dx.shape[0])
        dx_send = all_to_all_rows(dx_recv, plan.in_splits, plan.out_splits, group)
        return dx_send, dw13, dw2, None, None, None
