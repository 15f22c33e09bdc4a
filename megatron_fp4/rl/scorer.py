"""The trainer side's log-probs of an RL batch, on any layout: the current policy's ("old") and a
frozen reference policy's (for the KL penalty).

Without a pipeline every rank scores the whole batch in one forward (`rollout.scoring.
compute_log_probs`, the single process's call; with expert parallelism the ep ranks run it in
lockstep). With one, each dp replica scores its contiguous share of the rows through the pipeline
schedule in forward-only mode; the last stage's log-probs are summed over the whole mesh, where
every row is written by exactly one rank (one last stage per dp replica) and zero elsewhere, so
the sum is exact and every rank gets the same bits. The routing (for the expert-agreement metric)
is gathered the same way: each stage's routers report their picks, summed over the mesh.

The reference policy is a copy of this rank's parameters taken when the scorer is built (only
its own shard: a pipeline chunk, its local experts); scoring it swaps those values in and the
policy's back, bitwise, so the same code scores both.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from megatron_fp4.fp4 import numerics_of
from megatron_fp4.model.layers import wide_dtype
from megatron_fp4.rollout.engine import positions_from_mask
from megatron_fp4.rollout.logprobs import log_probs_from_logits, to_token_positions
from megatron_fp4.rollout.scoring import compute_log_probs
from megatron_fp4.training.step_loss import StepLoss


class _CaptureLogProbs(StepLoss):
    """A forward-only 'loss' for the pipeline: keeps each micro-batch's log-probs at its rows."""

    def __init__(self, out: torch.Tensor, numerics=None):
        self.out, self.numerics = out, numerics

    def model_inputs(self, mb: dict) -> dict:
        am = mb["attention_mask"]
        return {"tokens": mb["input_ids"], "positions": positions_from_mask(am), "attention_mask": am,
                "routing_in": mb.get("replay_routing")}

    def loss(self, logits: torch.Tensor, mb: dict):
        lp, _ = log_probs_from_logits(logits, mb["input_ids"], mb["response_mask"], self.numerics)
        start = int(mb["row_start"])
        self.out[start:start + lp.shape[0]] = lp
        return lp.new_zeros(()), {}


class _RoutingCapture:
    """The experts each local MoE router picks, per micro-batch, at their global MoE-layer index:
    `out` [B, T, num_moe_layers, k] holds this rank's (row, layer) entries and zeros elsewhere (one
    stage owns a layer, one dp replica a row: summed over the mesh, every entry is written once)."""

    def __init__(self, model, shape, row_starts: list, rows_per_micro_batch: int, device: torch.device):
        moe_ids = [i for i in range(len(model.layers)) if i not in model.cfg.dense_layers]
        self.out = torch.zeros(*shape, len(moe_ids), model.cfg.top_k, dtype=torch.int64, device=device)
        self.row_starts, self.rows = row_starts, rows_per_micro_batch
        self.seen, self.hooks = {}, []
        for i, layer in enumerate(model.layers):
            if getattr(layer, "is_moe", False):  # layers of other stages are absent here
                self.seen[i] = 0
                self.hooks.append(layer.mlp.router.register_forward_hook(self._hook(i, moe_ids.index(i))))

    def _hook(self, layer: int, slot: int):
        def hook(_module, _args, output):
            # A stage runs its micro-batches' forwards in order (no shape-inference runs: the
            # pipeline's shapes are static), so the n-th call is micro-batch n.
            n = self.seen[layer]
            assert n < len(self.row_starts), (layer, n)
            start = self.row_starts[n]
            self.out[start:start + self.rows, :, slot] = output[2].view(self.rows, self.out.shape[1], -1)
            self.seen[layer] = n + 1
        return hook

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()

    def shifted(self) -> torch.Tensor:
        """compute_log_probs' alignment: row t holds the routing of position t-1 (which predicts token t)."""
        assert all(n == len(self.row_starts) for n in self.seen.values()), self.seen
        return to_token_positions(self.out)


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
    pipeline micro-batch (each dp replica's share of the rows must be a multiple of it).
    `invariance`: the numerics level it scores at (None: the config's `numerics.invariance`, the level
    the rollout engine decodes at), with or without a pipeline."""

    def __init__(self, trainer, micro_batch_size: int, keep_reference: bool, invariance: Optional[str] = None):
        if trainer.mesh.tp > 1:  # its forward would read this rank's vocabulary slice as the whole
            raise ValueError(f"RL scoring (old/reference log-probs) with parallel.tp={trainer.mesh.tp} is not "
                             "implemented yet: the logits are split along the vocabulary; use parallel.tp=1 for RL")
        self.trainer, self.micro_batch_size = trainer, int(micro_batch_size)
        self.invariance = trainer.cfg.numerics.invariance if invariance is None else invariance
        self.reference = ({n: p.detach().clone() for n, p in trainer.model.named_parameters()}
                          if keep_reference else None)

    def score(self, batch: dict, replay: Optional[torch.Tensor] = None) -> dict:
        """`replay` [B, T, num_moe_layers, k]: routes the old-log-prob and the reference passes replay
        (R3, `rl/replay.py`); None: both route live (and the routing returned is the old pass's own)."""
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
        ids, am, rm = (batch[k].to(t.device) for k in ("input_ids", "attention_mask", "response_mask"))
        replay = None if replay is None else replay.to(t.device)
        if t.pipeline is None:
            res = compute_log_probs(t.model, ids, am, rm, return_routing=routing, invariance=self.invariance,
                                    routing_in=replay)
            return res.log_probs.cpu(), None if res.routing is None else res.routing.cpu()
        share, mbs = self._split(ids.shape[0])
        dp_rank = t.mesh.coord("dp")
        dtype = wide_dtype(next(t.model.parameters()).dtype)
        full = torch.zeros(ids.shape, dtype=dtype, device=t.device)
        micro = [{"input_ids": ids[s:s + mbs], "attention_mask": am[s:s + mbs], "response_mask": rm[s:s + mbs],
                  "row_start": s, "replay_routing": None if replay is None else replay[s:s + mbs]}
                 for s in range(dp_rank * share, (dp_rank + 1) * share, mbs)]
        routes = _RoutingCapture(t.model, ids.shape, [mb["row_start"] for mb in micro], mbs, t.device) \
            if routing else None
        try:
            numerics = numerics_of(t.model)
            with numerics.invariant(self.invariance):  # as compute_log_probs
                t.pipeline.run(micro, _CaptureLogProbs(full, numerics), forward_only=True)
        finally:
            if routes is not None:
                routes.remove()
        dist.all_reduce(full, group=t.mesh.group("world"))
        if routes is None:
            return full.cpu(), None
        dist.all_reduce(routes.out, group=t.mesh.group("world"))
        return full.cpu(), routes.shifted().cpu()

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
