"""The trainer side's log-probs of an RL batch, on any layout: the current policy's ("old") and a
frozen reference policy's (for the KL penalty).

Without a pipeline every rank scores the whole batch in one forward (`rollout.scoring.
compute_log_probs`, the single process's call; with expert parallelism the ep ranks run it in
lockstep). With one, each dp replica scores its contiguous share of the rows through the pipeline
schedule in forward-only mode; the last stage's log-probs are summed over the whole mesh, where
every row is written by exactly one rank (one last stage per dp replica) and zero elsewhere, so
the sum is exact and every rank gets the same bits. Routing comes back only without a pipeline
(with one, no rank sees every layer's experts).

The reference policy is a copy of this rank's parameters taken when the scorer is built (only
its own shard: a pipeline chunk, its local experts); scoring it swaps those values in and the
policy's back, bitwise, so the same code scores both.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from megatron_fp4.fp4 import invariant
from megatron_fp4.model.layers import wide_dtype
from megatron_fp4.rollout.engine import positions_from_mask
from megatron_fp4.rollout.scoring import compute_log_probs, log_probs_from_logits
from megatron_fp4.training.step_loss import StepLoss


class _CaptureLogProbs(StepLoss):
    """A forward-only 'loss' for the pipeline: keeps each micro-batch's log-probs at its rows."""

    def __init__(self, out: torch.Tensor):
        self.out = out

    def model_inputs(self, mb: dict) -> dict:
        am = mb["attention_mask"]
        return {"tokens": mb["input_ids"], "positions": positions_from_mask(am), "attention_mask": am}

    def loss(self, logits: torch.Tensor, mb: dict):
        lp, _ = log_probs_from_logits(logits, mb["input_ids"], mb["response_mask"])
        start = int(mb["row_start"])
        self.out[start:start + lp.shape[0]] = lp
        return lp.new_zeros(()), {}


@contextlib.contextmanager
def swapped_parameters(model, values: dict):
    """`model`'s parameters hold `values` inside the block and their own values again after it."""
    params = dict(model.named_parameters())
    own = {n: params[n].detach().clone() for n in values}
    with torch.no_grad():
        for n, v in values.items():
            params[n].copy_(v)
    try:
        yield model
    finally:
        with torch.no_grad():
            for n, v in own.items():
                params[n].copy_(v)


class PolicyScorer:
    """`score(batch)` -> old log-probs (+ routing without a pipeline, + the reference policy's
    when `keep_reference`), each [B, T], the same on every rank. `micro_batch_size`: rows per
    pipeline micro-batch (each dp replica's share of the rows must be a multiple of it)."""

    def __init__(self, trainer, micro_batch_size: int, keep_reference: bool):
        self.trainer, self.micro_batch_size = trainer, int(micro_batch_size)
        self.reference = ({n: p.detach().clone() for n, p in trainer.model.named_parameters()}
                          if keep_reference else None)

    def score(self, batch: dict) -> dict:
        out = {}
        with torch.no_grad():
            out["old_log_probs"], out["train_routing"] = self._log_probs(batch, routing=True)
            if self.reference is not None:
                with swapped_parameters(self.trainer.model, self.reference):
                    out["ref_log_probs"], _ = self._log_probs(batch, routing=False)
        return out

    def _log_probs(self, batch: dict, routing: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        t = self.trainer
        ids, am, rm = (batch[k].to(t.device) for k in ("input_ids", "attention_mask", "response_mask"))
        if t.pipeline is None:
            res = compute_log_probs(t.model, ids, am, rm, return_routing=routing)
            return res.log_probs.cpu(), None if res.routing is None else res.routing.cpu()
        share, mbs = self._split(ids.shape[0])
        dp_rank = t.mesh.coord("dp")
        dtype = wide_dtype(next(t.model.parameters()).dtype)
        full = torch.zeros(ids.shape, dtype=dtype, device=t.device)
        micro = [{"input_ids": ids[s:s + mbs], "attention_mask": am[s:s + mbs], "response_mask": rm[s:s + mbs],
                  "row_start": s} for s in range(dp_rank * share, (dp_rank + 1) * share, mbs)]
        with invariant.batch_invariant(True):  # as compute_log_probs without autograd
            t.pipeline.run(micro, _CaptureLogProbs(full), forward_only=True)
        dist.all_reduce(full, group=t.mesh.group("world"))
        return full.cpu(), None

    def _split(self, num_rows: int) -> tuple[int, int]:
        """(rows per dp replica, rows per micro-batch): at most `micro_batch_size`, dividing the share,
        and at least pp micro-batches (the schedules need them). Scoring's micro-batches may be cut
        freely: a row's log-probs do not depend on its batch (batch-invariant mode)."""
        dp, pp = self.trainer.mesh.dp, self.trainer.mesh.pp
        share = num_rows // dp
        if num_rows % dp or share < pp:
            raise ValueError(f"an RL batch of {num_rows} rows does not split into {dp} equal data-parallel shares of "
                             f"at least pp={pp} rows (one per pipeline micro-batch); make num_prompts × group_size "
                             f"a multiple of dp × pp = {dp * pp}")
        bound = min(self.micro_batch_size, share // pp)
        return share, max(d for d in range(1, bound + 1) if share % d == 0)
