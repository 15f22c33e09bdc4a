"""The trainer side's log-probs of an RL batch, on any layout: the current policy's ("old") and a
frozen reference policy's (for the KL penalty).

One path for every layout: `Trainer.forward_rows` (`training/forward_only.py`) cuts the batch into a
contiguous share per dp replica, runs its micro-batches through `Trainer.forward_backward(...,
forward_only=True)` (the pipeline schedule in forward-only mode with pp > 1; under tp the logits
gathered over the vocabulary) and sums each row's log-probs over the mesh, where exactly one rank
wrote it, so every rank gets the same bits. The routing (for the expert-agreement metric and R2) is
gathered the same way: each stage's routers report their picks.

The reference policy is a copy of this rank's parameters taken when the scorer is built (only
its own shard: a pipeline chunk, its local experts, its tp slices); scoring it swaps those values in
and the policy's back, bitwise, so the same code scores both.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from megatron_fp4.fp4 import numerics_of
from megatron_fp4.rollout.engine import check_built_numerics
from megatron_fp4.rollout.logprobs import to_token_positions
from megatron_fp4.rollout.scoring import TokenLogProbs
from megatron_fp4.training.packing import check_budget


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
    """`score(batch)` -> old log-probs [B, T] and routing [B, T, num_moe_layers, k] (+ the reference
    policy's log-probs when `keep_reference`), the same on every rank. `micro_batch_size`: rows per
    pipeline micro-batch (each dp replica's share of the rows must be a multiple of it); `max_tokens`
    (default ``rl.max_tokens_per_micro_batch``) > 0: packed micro-batches of at most that many tokens instead.
    It scores at the level the trainer's model was built with (the config's `numerics.invariance`,
    the level the rollout engine decodes at), with or without a pipeline; `invariance`: None, or that
    level (another is a ValueError: the level is fixed at build)."""

    def __init__(self, trainer, micro_batch_size: int, keep_reference: bool, invariance: Optional[str] = None,
                 max_tokens: Optional[int] = None):
        self.trainer, self.micro_batch_size = trainer, int(micro_batch_size)
        check_built_numerics(trainer.model, invariance=invariance)
        # packed micro-batches of at most this many tokens (None: rl.max_tokens_per_micro_batch; 0: padded)
        self.max_tokens = check_budget(trainer.cfg.rl.max_tokens_per_micro_batch if max_tokens is None else max_tokens)
        self.reference = ({n: p.detach().clone() for n, p in trainer.model.named_parameters()}
                          if keep_reference else None)

    def score(self, batch: dict, replay: Optional[torch.Tensor] = None) -> dict:
        """`replay` [B, T, num_moe_layers, k]: routes the old-log-prob and the reference passes replay
        (R3, `rl/algo/replay.py`); None: both route live (and the routing returned is the old pass's own)."""
        out = {}
        with torch.no_grad():
            out["old_log_probs"], out["train_routing"] = self._log_probs(batch, True, replay)
            if self.reference is not None:
                with swapped_parameters(self.trainer.model, self.reference):
                    out["ref_log_probs"], _ = self._log_probs(batch, False, replay)
        return out

    def _log_probs(self, batch: dict, routing: bool, replay: Optional[torch.Tensor] = None):
        """(log-probs [B, T], routing [B, T, num_moe_layers, k] when `routing`), replaying `replay`."""
        t = self.trainer
        rows = {k: batch[k] for k in ("input_ids", "attention_mask", "response_mask")}
        rows["replay_routing"] = replay
        log_probs, routes = t.forward_rows(rows, TokenLogProbs(numerics_of(t.model)), self.micro_batch_size, routing,
                                           self.max_tokens)
        # compute_log_probs' alignment: row t holds the routing of position t-1 (which predicts token t)
        return log_probs.cpu(), None if routes is None else to_token_positions(routes).cpu()
