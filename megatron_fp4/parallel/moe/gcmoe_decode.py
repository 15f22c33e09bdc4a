"""GC-MoE decode path: expert-parallel dispatch/combine for a few tokens per rank per step.

In decode every rank holds a handful of tokens (one per active sequence), so what costs is not
bandwidth but the number of synchronising round trips, the host work and, on a GPU, kernel
launches. The training dispatchers pay a blocking count all-to-all before the tokens move
(`DispatchPlan.exchange`) and GC-MoE also starts a transfer thread per call. This path pays
neither:

- **Fixed-capacity slots per (source, destination) pair.** A round carries at most
  ``max_tokens`` tokens per rank; a token picks ``top_k`` distinct experts, at most
  ``min(top_k, El)`` of them on one rank, so a pair's message holds ``cap = max_tokens ·
  min(top_k, El)`` rows: a static upper bound that needs no count exchange.
- **Counts travel with the data** (as in flash-comm / DeepEP's low-latency mode): each message
  is one byte buffer ``[header | cap rows]``; the int32 header carries the round's sequence
  number (the ready/valid signal), the rows used, a "more rounds follow" flag and the rows per
  destination-local expert. One send and one receive per pair and direction, nothing else.
- **Persistent, double-buffered buffers** (`DecodeBuffers`, one per rank, shared by all MoE
  layers): round i packs into and receives into set ``i % 2``, so with one-sided transports or
  asynchronous streams a fast peer's round i+1 can never overwrite a buffer this rank is still
  reading for round i: the same argument as GC-MoE's double-buffered counters, which are exactly
  these headers' sequence numbers. The sequence number lives in a device tensor bumped in place,
  so a CUDA-Graph replay writes fresh numbers.
- **Tag-free transport**, one exchange per direction (``transport=``):
  ``"alltoall"`` (default): one `all_to_all_single` with equal, fixed splits over the ``[ep,
  bytes]`` message buffers: a collective, so no tags at all; on NCCL it is one group of a send and
  a receive per peer, and static-shaped. ``"p2p"``: GC-MoE's pair protocol, one `exchange_step`
  (gcmoe_transfer.py: with every peer the lower rank sends first, so both ends issue a pair's
  operations in the same order, what NCCL needs as it ignores tags; one `batch_isend_irecv` NCCL
  group on CUDA). Both move the same bytes; on gloo the p2p transport makes a decode step about
  twice as slow (isend/irecv latency; benchmarks/bench_gcmoe_decode.py).

Expert compute (``static=``):

- ``False`` (default, *exact*): the received rows are gathered in grouped order (local
  expert, then source rank, then the source's send order), exactly the batch
  `AllToAllDispatcher` gives `GroupedExperts`, and run through it: **bitwise equal to the
  all-to-all dispatcher by construction** for up to ``max_tokens`` tokens per rank. The counts are
  read on the host (a sync on CUDA), and any number of tokens works (rounds, below).
- ``True`` (*capturable*, opt-in: set it on every rank for the decode step captured in a CUDA
  Graph, where every rank holds at most ``max_tokens`` tokens): no host read at all. Every local
  expert runs on a fixed ``[ep · max_tokens, H]`` batch (a token reaches an expert at most once
  per source), rows gathered with device-side indices from the headers and zero padding; outputs
  are scattered back through a trash row. On CPU that padded work costs (every local expert runs,
  with or without rows); it is meant for GPUs, where a graph replay saves the launches. The GEMMs
  see extra zero rows, so results equal the exact path where the GEMM is row-invariant (FP4
  activation scales are per row; the batch-invariant mode, fp4/invariant.py, makes every GEMM
  so: bitwise, tested) and otherwise differ only by BLAS blocking (fp64: within FP64_REL, tested).

What a CUDA Graph of one decode step would capture (static mode, one round, T ≤ max_tokens,
buffers allocated by a warm-up call before capture): the packing (argsort, scatter_add, cumsum,
index_put into the send set), the header writes and the in-place sequence bump, the dispatch
exchange, the padded gather, the El expert forwards, the scatter into the return set, the combine
exchange, the gather and the weighted sum. Outside the graph: allocation and the host's parity
choice (fixed per layer position, the same on every rank at capture and replay). Nothing in the
static step reads device memory on the host (tested on CPU by running it on the meta device,
where any such read raises); FP4 experts need their non-finite operand checks deferred
(``Numerics.training_step(..., defer_nonfinite=True)``, the default on accelerators inside a
step), else each quantization syncs. The header checks run on CPU only. Not run on a GPU here.

Larger batches (prefill through the same model): eager mode loops rounds of ``max_tokens`` tokens
while any rank's header says more follow, so every rank runs the same number of rounds without an
extra exchange. Expert batches are then per round, so results equal the all-to-all within
floating-point reordering (bitwise under the batch-invariant mode). Forward only: this path is for
inference (under ``torch.no_grad()``), training uses "alltoall" or "gcmoe".
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_fp4.config.choices import check_choice
from megatron_fp4.model.dispatch import Dispatched, Dispatcher, combine_expert_outputs
from megatron_fp4.parallel.dims import check_expert_split
from megatron_fp4.parallel.moe.alltoall import check_share, scatter_rows
from megatron_fp4.parallel.moe.gcmoe_transfer import exchange_step, issue_step

# header (int32): sequence number, rows used, more rounds follow, reserved, then rows per local expert
SEQ, ROWS, MORE, FIXED_INTS = 0, 1, 2, 4


def pair_capacity(max_tokens: int, top_k: int, num_local: int) -> int:
    """Pure: rows one source can send one destination in a round (a token's k experts are
    distinct, at most ``min(k, El)`` of them on one rank)."""
    return max_tokens * min(top_k, num_local)


def header_ints(num_local: int) -> int:
    """Pure: int32 header length, padded to 16 bytes so the rows after it stay 16-byte aligned."""
    return -(-(FIXED_INTS + num_local) // 4) * 4


class DecodeBuffers:
    """A rank's persistent message buffers: two sets (round parity) of send, receive, return-send
    and return-receive byte buffers ``[ep, header + cap · H · itemsize]``, and the sequence
    counter. Shared by all MoE layers of the rank (their rounds run one after another);
    reallocated only when the shape, dtype or device changes."""

    def __init__(self, max_tokens: int):
        if max_tokens < 1:
            raise ValueError(f"decode_tokens={max_tokens} must be >= 1")
        self.max_tokens = max_tokens
        self.round = 0            # host: rounds run (parity = round % 2)
        self.seq = None           # device int32 [1]: the sequence number the next round writes
        self.sets, self._key = None, None
        self.allocations = 0

    def get(self, ep: int, cap: int, num_local: int, hidden: int, dtype: torch.dtype, device) -> list[dict]:
        key = (ep, cap, num_local, hidden, dtype, torch.device(device))
        if key != self._key:
            hdr = header_ints(num_local)
            nbytes = hdr * 4 + cap * hidden * torch.empty((), dtype=dtype).element_size()
            nbytes = -(-nbytes // 16) * 16
            with torch.inference_mode(False):  # normal tensors: writable in and outside inference mode
                self.sets = [{name: torch.zeros(ep, nbytes, dtype=torch.uint8, device=device)
                              for name in ("send", "recv", "back_send", "back_recv")} for _ in range(2)]
                self.seq = torch.ones(1, dtype=torch.int32, device=device)
            self._key, self._hdr, self._cap, self._dtype, self._hidden = key, hdr, cap, dtype, hidden
            self.allocations += 1
        return self.sets

    def header(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[:, :self._hdr * 4].view(torch.int32)

    def rows(self, buf: torch.Tensor) -> torch.Tensor:
        """[ep, cap, H] view of the rows part of a message buffer."""
        end = self._hdr * 4 + self._cap * self._hidden * torch.empty((), dtype=self._dtype).element_size()
        return buf[:, self._hdr * 4:end].view(self._dtype).view(-1, self._cap, self._hidden)


class GCMoEDecodeDispatcher(Dispatcher):
    """Decode-time expert-parallel dispatcher (module docstring), forward only. A
    `model.dispatch.Dispatcher`: `dispatch`/`combine` carry one round (at most ``decode_tokens``
    tokens on this rank, exact path); `run`, what the MoE layer calls, loops rounds (eager) or runs
    the capturable static round. ``buffers`` is the rank's shared `DecodeBuffers`; ``static``
    selects the capturable path (the same on every ep rank). ``test_hook`` (tests only) may define
    ``delay(event, peer, round)`` and ``order(peers)``."""

    TRANSPORTS = ("alltoall", "p2p")

    def __init__(self, group, ep: int, num_experts: int, ep_rank: int, ep_ranks: list[int],
                 buffers: DecodeBuffers, static: bool = False, transport: str = "alltoall"):
        check_expert_split(num_experts, ep)
        check_choice("GC-MoE decode transport", transport, self.TRANSPORTS)
        self.transport = transport
        self.group, self.ep, self.num_experts = group, ep, num_experts
        self.ep_rank, self.ep_ranks, self.buffers, self.static = ep_rank, list(ep_ranks), buffers, static
        self.test_hook = None
        self.last_rounds = 0

    def check_experts(self, experts) -> None:
        check_share(self, experts)

    def run(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, experts) -> torch.Tensor:
        self.check_experts(experts)
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in experts.parameters())):
            raise ValueError("parallel.expert_dispatcher='gcmoe_decode' is forward-only (inference): call the "
                             "model under torch.no_grad() (the rollout engine does), or use 'alltoall'/'gcmoe' "
                             "for training")
        static = self.static
        T, m = x.shape[0], self.buffers.max_tokens
        if static and T > m:
            raise ValueError(f"{T} tokens on this rank exceed decode_tokens={m}, the static "
                             f"capacity of the capturable decode path; raise it or run this batch eagerly "
                             f"(static=False loops rounds)")
        outs, r = [], 0
        while True:  # eager: rounds until no rank has more; static: exactly one
            lo, hi = r * m, min((r + 1) * m, T)
            h = self._send(x[lo:hi], topk_idx[lo:hi], topk_w[lo:hi], hi < T, static)
            if static:
                self._experts_static(h, experts)
            else:
                d = self._grouped(h)
                self._put_back(experts(d.tokens, d.counts), d.handle)
            y, more = self._finish(h)
            outs.append(y)
            r += 1
            if static or not more:
                break
        self.last_rounds = r
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> Dispatched:
        """One eager round: the received rows in grouped order (as `AllToAllDispatcher` gives them)."""
        if x.shape[0] > self.buffers.max_tokens:
            raise ValueError(f"GCMoEDecodeDispatcher.dispatch carries one round of at most decode_tokens="
                             f"{self.buffers.max_tokens} tokens, got {x.shape[0]}; use run (rounds)")
        return self._grouped(self._send(x, topk_idx, topk_w, False, False))

    def combine(self, expert_out: torch.Tensor, handle) -> torch.Tensor:
        self._put_back(expert_out, handle)
        y, more = self._finish(handle[0])
        if more:
            raise RuntimeError("GC-MoE decode: a peer runs more rounds than this rank's one-round dispatch/combine")
        return y

    # -- one round ------------------------------------------------------------------------------
    def _send(self, x, topk_idx, topk_w, more: bool, static: bool) -> dict:
        """Pack this rank's rows (sorted by global expert = by destination, then its local expert)
        with their headers into the round's send set and run the dispatch exchange."""
        ep, El, H = self.ep, self.num_experts // self.ep, x.shape[-1]
        T, k = topk_idx.shape
        B = self.buffers
        cap = pair_capacity(B.max_tokens, k, El)
        bufs = B.get(ep, cap, El, H, x.dtype, x.device)[B.round % 2]
        B.round += 1
        flat = topk_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts = counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)).view(ep, El)
        dst_rows = counts.sum(1)
        dst = flat[order] // El
        slot = torch.arange(T * k, device=x.device) - (torch.cumsum(dst_rows, 0) - dst_rows)[dst]
        send_rows = B.rows(bufs["send"])
        send_rows[dst, slot] = x[order // k]
        hdr = B.header(bufs["send"])
        hdr[:, SEQ] = B.seq
        hdr[:, ROWS] = dst_rows
        hdr[:, MORE] = int(more)
        hdr[:, FIXED_INTS:FIXED_INTS + El] = counts
        self._exchange(bufs["send"], bufs["recv"], "dispatch")
        recv_hdr = B.header(bufs["recv"])
        check = x.device.type == "cpu"  # a host read: never on an accelerator
        if check:
            self._check(recv_hdr, cap, El, B.seq, "dispatch", static)
        return {"bufs": bufs, "cap": cap, "El": El, "H": H, "T": T, "k": k, "order": order, "dst": dst,
                "slot": slot, "more": more, "static": static, "check": check, "topk_idx": topk_idx,
                "topk_w": topk_w, "recv_hdr": recv_hdr,
                "recv_counts": recv_hdr[:, FIXED_INTS:FIXED_INTS + El]}  # [src, local expert]

    def _finish(self, h: dict):
        """Return exchange of the expert outputs (in `back_send`), then the combine: send-order outputs
        -> (token, slot) -> ascending-expert weighted sum. Returns (y [T, H], any rank has more)."""
        B, bufs = self.buffers, h["bufs"]
        B.header(bufs["back_send"])[:, SEQ] = B.seq
        self._exchange(bufs["back_send"], bufs["back_recv"], "combine")
        if h["check"]:
            self._check(B.header(bufs["back_recv"]), h["cap"], h["El"], B.seq, "combine", h["static"])
        any_more = h["more"] if h["static"] else bool(h["recv_hdr"][:, MORE].any())  # eager only: a host read
        B.seq += 1
        y_send = B.rows(bufs["back_recv"])[h["dst"], h["slot"]]
        T, k = h["T"], h["k"]
        y_slots = scatter_rows(y_send, h["order"], T * k)
        return combine_expert_outputs(y_slots.view(T, k, h["H"]), h["topk_idx"], h["topk_w"]), any_more

    def _grouped_slots(self, recv_counts: torch.Tensor, device):
        """(src, slot, valid), each [El, ep, max_tokens]: entry (le, s, j) is the j-th row source s
        sent for local expert le (a token reaches an expert at most once per source, so j <
        max_tokens). Flattened, this is the grouped order: local expert, then source, then the
        source's send order, the order `AllToAllDispatcher` feeds `GroupedExperts`."""
        ep, m = recv_counts.shape[0], self.buffers.max_tokens
        counts = recv_counts.to(torch.int64).t()                      # [le, src]
        start = torch.cumsum(recv_counts.to(torch.int64), 1).t() - counts  # first slot of (le, src)
        j = torch.arange(m, device=device)
        valid = j < counts[..., None]
        slot = torch.where(valid, start[..., None] + j, 0)
        return torch.arange(ep, device=device)[None, :, None].expand_as(slot), slot, valid

    def _grouped(self, h: dict) -> Dispatched:
        """The received rows in the all-to-all's grouped order (bitwise by construction)."""
        recv_rows = self.buffers.rows(h["bufs"]["recv"])
        src, slot, valid = self._grouped_slots(h["recv_counts"], recv_rows.device)
        src, slot = src[valid], slot[valid]  # a host sync (nonzero): the exact path is not capturable
        return Dispatched(recv_rows[src, slot], h["recv_counts"].sum(0).tolist(), None, (h, src, slot))

    def _put_back(self, expert_out: torch.Tensor, handle) -> None:
        h, src, slot = handle
        self.buffers.rows(h["bufs"]["back_send"])[src, slot] = expert_out

    def _experts_static(self, h: dict, experts) -> None:
        """Every local expert on a fixed [ep · max_tokens, H] batch; no host read."""
        recv_rows, back_rows = self.buffers.rows(h["bufs"]["recv"]), self.buffers.rows(h["bufs"]["back_send"])
        ep, cap, H = recv_rows.shape
        El, m = h["El"], self.buffers.max_tokens
        src, slot, valid = self._grouped_slots(h["recv_counts"], recv_rows.device)
        xb = torch.where(valid[..., None], recv_rows[src, slot], 0).reshape(El, ep * m, H)
        yb = torch.stack([experts.expert(le, xb[le]) for le in range(El)])
        flat = torch.where(valid, src * cap + slot, ep * cap).reshape(-1)  # invalid -> trash row
        scratch = recv_rows.new_zeros(ep * cap + 1, H)
        scratch.index_copy_(0, flat, yb.view(-1, H).to(scratch.dtype))
        back_rows.copy_(scratch[:ep * cap].view(ep, cap, H))

    # -- transport ------------------------------------------------------------------------------
    def _exchange(self, send: torch.Tensor, recv: torch.Tensor, phase: str) -> None:
        me, hook = self.ep_rank, self.test_hook
        peers = [p for p in range(self.ep) if p != me]
        if hook is not None and hasattr(hook, "order"):
            peers = list(hook.order(peers))
        ops = [(kind, p, send[p] if kind == "send" else recv[p])
               for kind, p in exchange_step(me, peers, [1] * self.ep, [1] * self.ep, 0)]
        if hook is not None and hasattr(hook, "delay"):
            for p in peers:
                hook.delay(phase, p, self.buffers.round)
        if self.transport == "alltoall":  # equal fixed splits: my block p goes to p, p's block lands at p
            dist.all_to_all_single(recv, send, group=self.group)
            return
        works = issue_step(ops, self.group, self.ep_ranks, send.device)
        recv[me].copy_(send[me])  # own rows: no transfer
        for w in works:
            w.wait()

    def _check(self, hdr: torch.Tensor, cap: int, El: int, seq: torch.Tensor, phase: str, static: bool) -> None:
        """CPU only (a host read): the headers belong to this round and fit the slots."""
        h = hdr.cpu()
        want = int(seq)
        if (h[:, SEQ] != want).any():
            raise RuntimeError(f"GC-MoE decode {phase}: sequence numbers {h[:, SEQ].tolist()} from ranks "
                               f"{self.ep_ranks}, expected {want} (ranks ran different numbers of MoE rounds)")
        if phase == "dispatch" and static and h[:, MORE].any():
            raise RuntimeError(f"GC-MoE decode: ranks {self.ep_ranks} sent more-rounds flags "
                               f"{h[:, MORE].tolist()} while this rank runs the static (one-round) path: "
                               f"set static the same on every rank")
        if phase == "dispatch":
            rows = h[:, FIXED_INTS:FIXED_INTS + El].sum(1)
            assert torch.equal(rows, h[:, ROWS].to(rows.dtype)) and int(rows.max()) <= cap, h.tolist()
