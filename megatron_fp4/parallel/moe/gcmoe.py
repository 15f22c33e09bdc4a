"""GC-MoE: expert-parallel dispatch with token transfer and expert compute overlapped.

One dispatcher call (a *round*) on ep rank r:

1. Counts are exchanged (`DispatchPlan.exchange`, one small all-to-all on the ep group).
2. A transfer worker (`TransferChannel.run_round`, its own Python thread and its own process
   group) exchanges rows with each peer in chunks of ``chunk_tokens`` rows, in *steps* that both
   ends derive from the plan (`exchange_step`, tag 0 throughout: NCCL ignores tags and matches a
   pair's messages in issue order, see gcmoe_transfer.py): dispatch step k sends my chunk k to
   every peer and receives every peer's chunk k, read straight from the layer's own send-order
   rows. Incoming chunks land in a bounded **receive ring** (`RecvRing`): ``ring_slots`` slots of
   ``chunk_tokens`` rows each (at least one per peer: a step receives from every peer). Flow
   control is credit-based and lives on the receiver: a slot is written only by a receive the
   worker posted into it, and a step is issued only when the ring has a free slot for each of its
   receives, reposting into a slot only after the compute side releases it. A sender's chunk with
   no receive posted yet simply waits on the sender's side (send/recv is a rendezvous on gloo and
   NCCL), so no sender can overwrite a slot the receiver has not consumed. The worker waits on
   receives in posting order (tests permute the peers within a step).
   When a receive completes the worker marks the chunk ready: it bumps
   ``counters[round % 2][src]`` and queues ``(src, chunk, slot)`` on the ready list.
3. The compute side (the caller's thread) takes ready chunks in arrival order, copies each chunk's
   rows from its slot into the staging batch (grouped order: local expert, then source; the
   experts' input, also kept for backward) and releases the slot at once, then runs the local
   experts while later chunks are in flight. Granularity (``compute=``):
   - ``"expert"`` (default, bit-exact by construction): an expert runs as soon as *all* its rows
     (from every source) are staged, on exactly the batch `AllToAllDispatcher` gives it. Rows are
     sent sorted by local expert, so expert 0 runs while the rows of experts 1.. are arriving.
     An expert's rows may span far more than the ring: the ring only carries them to staging.
   - ``"chunk"``: each chunk's rows run at once, split at local-expert boundaries (finest overlap).
     Bitwise only where the GEMM library is row-invariant for the segment sizes; MKL on CPU takes
     other kernels for tiny M (1–2 rows, up to ~10 for some shapes), giving ~1e-6 relative
     differences (measured; see tests/distributed/test_expert_parallel_gcmoe.py).
   Finished output chunks go back to the worker, which runs combine step k (my outputs for every
   peer's chunk k out, every peer's outputs for my chunk k in) once all dispatch steps are issued
   and its outputs for chunk k are finished.
4. When the worker has received every output chunk (straight into the caller's send-order result)
   and every slot is released, the rows are un-permuted and combined with
   `combine_expert_outputs` (ascending expert index, never arrival order).

Memory bound of the receive ring: ``ring_slots × chunk_tokens × hidden`` elements **per rank in
total**, shared by all peers (sources compete for the same slots) and by all MoE layers of the rank
(one ring per `TransferChannel`, reused round after round), and independent of the number of
tokens received. What is not bounded by it is what the baseline holds too: the staging batch
(the experts' input, saved for backward), the experts' outputs and the layer's result, each
[rows, hidden].

Receive counters (the per-chunk ready signals, one per source) are double-buffered: round i uses
set ``i % 2`` and leaves set ``(i+1) % 2``, the previous round's, untouched and readable while
round i runs; at the end of a round the worker's counts are checked against the plan. In the
GC-MoE paper the counters live in the receiver's memory and are *written by the senders*
(one-sided signals), so reusing a counter would need a cross-rank wait (no fast peer's next-round
signal may land before the reset); double buffering saves that wait, because a peer can only
signal set s again in round i+2 after round i+1, which this rank only enters after finishing round
i. On this transport (two-sided send/recv on gloo and NCCL) a counter is written only by its own
rank's worker when a matched receive completes, so that hazard cannot arise and there is no
cross-rank wait to save: resetting the set at the start of its round is race-free with or without
the second set. The second set is kept for its local use (the finished round's counts stay
readable) and so that a one-sided transport (NVSHMEM-style puts) could drop in without the wait.
Messages of consecutive rounds cannot be confused either: a pair issues round i+1's operations
after round i's on both ends, and matching is by position.

Numerics: with ``compute="expert"`` every expert GEMM gets the same rows in the same order as the
baseline, so the output is bit-identical to `AllToAllDispatcher` and the single-process layer
whatever the arrival order (tested with injected delays, shuffled arrival orders and a ring far
smaller than the traffic). With ``compute="chunk"`` FP4 activation quantization is still per-row
(batch invariant with the default ``scale='row'``; stochastic rounding of forward activations
draws per call and is not). Backward does NOT run per chunk: wgrad sums over tokens (and FP4
wgrad quantizes along the token dim), so per-chunk partial sums would change the bits. The staged
rows are kept in grouped order and backward recomputes the experts' forward on the whole batch and
differentiates it (expert-level activation recompute), with the gradient exchange on the baseline
variable-split all-to-all of the ep group, and FP4 wgrad quantized per source run
(`DispatchPlan.expert_segments`) as there. Gradients are therefore bitwise those of
`AllToAllDispatcher`, which equal the single process's (see ep_alltoall.py).

Decode (a few tokens per rank per step) has its own path without the count exchange or the
thread: `gcmoe_decode.GCMoEDecodeDispatcher` (dispatcher "gcmoe_decode", inference only).

Device mechanism: on CPU (the tested reference) the worker is a thread doing gloo isend/irecv on a
dedicated group (gloo is unsafe with two threads on one group). On CUDA (guarded, untested here) the
worker issues each step as one `batch_isend_irecv` (an NCCL group) under a transfer stream;
readiness crosses threads as CUDA events (compute stream waits on the event recorded after the
receive; the transfer stream, which ProcessGroupNCCL's internal stream waits on at issue, waits on
the event recorded after a slot's rows were copied out before reposting into it), and when
`torch.cuda.green_contexts` is supported the compute stream comes from one green context with
``num_sms - transfer_sms`` SMs (why not two: gcmoe_transfer.py).
"""
from __future__ import annotations

import collections

import torch

from megatron_fp4.config.choices import check_choice
from megatron_fp4.model.experts import GroupedExperts
from megatron_fp4.parallel.dims import check_gcmoe
from megatron_fp4.parallel.moe.alltoall import (AllToAllDispatcher, DispatchPlan, all_to_all_rows, finish_combine,
                                                scatter_rows)
from megatron_fp4.parallel.moe.gcmoe_transfer import (COMPUTE_GRANULARITIES, RecvRing,  # noqa: F401
                                                      Round, TransferChannel, chunk_bounds, exchange_step)



def _offsets(splits: list[int]) -> list[int]:
    out = [0]
    for s in splits[:-1]:
        out.append(out[-1] + s)
    return out


class GCMoEDispatcher(AllToAllDispatcher):
    """Expert-parallel dispatcher overlapping chunked token transfer with expert compute.

    A `model.dispatch.Dispatcher`: `run` (what the MoE layer calls) is the overlapped round, with
    the bits of `AllToAllDispatcher`, whose `dispatch`/`combine` (no overlap) it inherits; it uses
    only the experts' public compute API (``experts(tokens, counts, segments)``,
    ``experts.expert(e, tokens)``, ``experts.parameters()``) and `TransferChannel`'s public API.
    ``round`` counts calls; ``counters`` are the two receive-counter sets (round i uses
    ``counters[i % 2]``). ``chunk_tokens`` and
    ``ring_slots`` must be the same on every ep rank (config values, checked by
    `apply_expert_parallel`): both ends derive the chunk boundaries from them. After each round
    ``last_ring_stats`` holds the ring's ``slots``, ``high_water`` and ``acquired`` (receives
    posted); ``ring_high_water`` is the maximum over all rounds. ``test_hook`` (tests only) may
    define ``delay(event, peer, chunk)`` (called on the transfer thread) and ``order(list)``
    (permutes the ``(src, chunk)`` order in which receives are posted, awaited and marked ready).
    """

    timeout_s = 300.0

    def __init__(self, group, ep: int, num_experts: int, channel: TransferChannel, chunk_tokens: int = 64,
                 compute: str = "expert", ring_slots: int = 8):
        check_gcmoe(ep, chunk_tokens, ring_slots)
        check_choice("GCMoEDispatcher compute", compute, COMPUTE_GRANULARITIES)
        super().__init__(group, ep, num_experts)
        self.channel, self.chunk_tokens, self.compute = channel, chunk_tokens, compute
        self.ring_slots = ring_slots
        self.round = 0
        self.counters = [torch.zeros(ep, dtype=torch.int64), torch.zeros(ep, dtype=torch.int64)]
        self.last_counter_set = None
        self.last_ring_stats = None
        self.ring_high_water = 0
        self.test_hook = None

    def run(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
            experts: GroupedExperts) -> torch.Tensor:
        self.check_experts(experts)
        plan = DispatchPlan.exchange(topk_idx, self.num_experts, self.ep, self.group)
        y_send = _GCMoEFunction.apply(x[plan.token_of_row], self, experts, plan, *experts.parameters())
        return finish_combine(y_send, plan, topk_idx, topk_w)

    def overlapped_forward(self, x_send: torch.Tensor, experts: GroupedExperts, plan: DispatchPlan):
        """Forward of one round without autograd: returns (y_send, x_grouped)."""
        s = self.round % 2
        self.round += 1
        self.last_counter_set = s
        counters = self.counters[s]
        counters.zero_()  # last used two rounds ago: every peer is past it
        me, C, channel = self.channel.ep_rank, self.chunk_tokens, self.channel
        in_splits, out_splits = plan.in_splits, plan.out_splits
        H = x_send.shape[-1]
        rnd = Round(s, counters, channel.ring(self.ring_slots, C, H, x_send), x_send.contiguous(),
                     x_send.new_empty(sum(out_splits), H), x_send.new_empty(sum(out_splits), H),
                     x_send.new_empty(sum(in_splits), H), _offsets(in_splits), _offsets(out_splits),
                     [chunk_bounds(n, C) for n in in_splits], [chunk_bounds(n, C) for n in out_splits],
                     hook=self.test_hook, timeout_s=self.timeout_s)
        # Rows for my own experts need no transfer (nor a slot): ready at once, read from x_send.
        for c in range(len(rnd.recv_bounds[me])):
            rnd.mark_ready(me, c, None, None)
        channel.exchange(rnd, lambda: self._compute(rnd, experts, plan), name=f"gcmoe-transfer-r{self.round - 1}")
        assert rnd.ring.in_use == 0, "GC-MoE round ended with receive slots still held"
        want = [len(b) for b in rnd.recv_bounds]
        assert counters.tolist() == want, f"ready signals {counters.tolist()} != chunks per source {want}"
        self.last_ring_stats = rnd.ring.stats()
        self.ring_high_water = max(self.ring_high_water, rnd.ring.high_water)
        own = slice(rnd.send_off[me], rnd.send_off[me] + in_splits[me])
        rnd.y_send[own] = rnd.y_recv[rnd.recv_off[me]:rnd.recv_off[me] + out_splits[me]]
        return rnd.y_send, rnd.x_grouped

    def _compute(self, rnd: Round, experts: GroupedExperts, plan: DispatchPlan) -> None:
        """Consume ready chunks in arrival order: stage the rows, free the slot, run experts, and
        hand finished output chunks to the worker."""
        me, num_local, channel = self.channel.ep_rank, experts.num_local_experts, self.channel
        counts = plan.recv_counts.tolist()  # [src][local expert]
        starts = [_offsets(counts[src]) + [sum(counts[src])] for src in range(self.ep)]
        group_start = _offsets(plan.local_counts)
        # grouped position of the first row src sends for local expert le
        base = [[group_start[le] + sum(counts[s][le] for s in range(src)) for le in range(num_local)]
                for src in range(self.ep)]

        def segments(src, c):  # (local expert, lo, hi) row ranges of chunk c inside src's block
            a, b = rnd.recv_bounds[src][c]
            return [(le, max(a, starts[src][le]), min(b, starts[src][le + 1])) for le in range(num_local)
                    if max(a, starts[src][le]) < min(b, starts[src][le + 1])]

        # "expert" granularity: an expert runs once all its rows are staged, on its whole batch.
        missing = list(plan.local_counts)
        chunks_of_expert = collections.defaultdict(list)
        waiting = {}
        for src in range(self.ep):
            for c in range(len(rnd.recv_bounds[src])):
                segs = segments(src, c)
                waiting[(src, c)] = len(segs)
                for le, _, _ in segs:
                    chunks_of_expert[le].append((src, c))
        for _ in range(len(waiting)):
            src, c, slot, event = rnd.next_ready()
            channel.wait_event(event)
            a, b = rnd.recv_bounds[src][c]
            if slot is None:  # own rows
                rows = rnd.x_send[rnd.send_off[me] + a:rnd.send_off[me] + b]
            else:
                rows = rnd.ring.view(slot, b - a)
            segs = segments(src, c)
            with torch.no_grad():
                for le, lo, hi in segs:
                    g0 = base[src][le] + lo - starts[src][le]
                    rnd.x_grouped[g0:g0 + hi - lo] = rows[lo - a:hi - a]
            if slot is not None:  # the slot's rows are staged: give the credit back at once
                rnd.release(slot, channel.record_event())
            finished = []
            with torch.no_grad():
                for le, lo, hi in segs:
                    if self.compute == "chunk":
                        g0 = base[src][le] + lo - starts[src][le]
                        out = slice(rnd.recv_off[src] + lo, rnd.recv_off[src] + hi)
                        rnd.y_recv[out] = experts.expert(le, rnd.x_grouped[g0:g0 + hi - lo])
                        finished.append((src, c))
                        continue
                    missing[le] -= hi - lo
                    if missing[le] == 0:
                        g = slice(group_start[le], group_start[le] + plan.local_counts[le])
                        rnd.y_recv[plan.perm[g]] = experts.expert(le, rnd.x_grouped[g])
                        finished.extend(chunks_of_expert[le])
            for key in finished:
                waiting[key] -= 1
                if waiting[key] == 0 and key[0] != me:
                    rnd.output_done(key[0], key[1], channel.record_event())


class _GCMoEFunction(torch.autograd.Function):
    """Overlapped forward; backward = baseline all-to-all of gradients + whole-batch expert recompute."""

    @staticmethod
    def forward(ctx, x_send, dispatcher: GCMoEDispatcher, experts: GroupedExperts, plan: DispatchPlan, *params):
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
            y = experts(xg, plan.local_counts, plan.expert_segments)
            params = list(experts.parameters())
            grads = torch.autograd.grad(y, [xg, *params], grad_recv[plan.perm], allow_unused=True)
        dx, *dparams = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, [xg, *params])]
        dx_recv = scatter_rows(dx, plan.perm, dx.shape[0])
        dx_send = all_to_all_rows(dx_recv, plan.in_splits, plan.out_splits, group)
        return (dx_send, None, None, None, *dparams)
