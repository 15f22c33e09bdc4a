"""Forward-only passes of the Trainer on any layout: per-row outputs (token log-probs) of a batch,
and the routes the MoE routers picked, the same on every rank.

`Trainer.forward_rows(batch, row_loss, micro_batch_size)` cuts the batch's rows into one contiguous
share per dp replica and each share into micro-batches (`split_rows`), runs them through
`Trainer.forward_backward(..., forward_only=True)` (the pipeline schedule in forward-only mode with
pp > 1; under tp the loss sees the logits gathered over the vocabulary, `TensorParallelLoss`), and
sums the rows over the whole mesh: every row is written by exactly one rank (tp rank 0 of the last
stage of its dp replica) and is zero elsewhere, so the sum is exact and every rank gets the same
bits. The routes are gathered the same way: each stage's routers report their picks (`RoutingCapture`).

A `RowLoss` says what a row's output is (`rows(logits, mb)` -> [rows, T], e.g. the token log-probs
of `rollout.scoring.TokenLogProbs`); it is a `StepLoss` whose loss is zero.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_fp4.model.layers import wide_dtype
from megatron_fp4.training.packing import balanced_bins, pack_rows, real_lengths, unpack_rows
from megatron_fp4.training.step_loss import StepLoss


class RowLoss(StepLoss):
    """A forward-only `StepLoss` that keeps one output row per batch row: `rows(logits, mb)` [b, T]
    is written at the micro-batch's ``row_start`` into `out` (set by `Trainer.forward_rows`)."""

    out: Optional[torch.Tensor] = None

    def rows(self, logits: torch.Tensor, micro_batch: dict) -> torch.Tensor:
        raise NotImplementedError

    def loss(self, logits, micro_batch):
        r = self.rows(logits, micro_batch)
        if self.out is not None:
            if "token_slots" in micro_batch:  # a packed micro-batch (`training/packing.py`): per token
                unpack_rows(r, micro_batch["token_slots"], self.out)
            else:
                start = int(micro_batch["row_start"])
                self.out[start:start + r.shape[0]] = r
        return r.new_zeros(()), {}


class RoutingCapture:
    """The experts each local MoE router picks, per micro-batch, at their global MoE-layer index:
    `out` [B, T, num_moe_layers, k] (position-aligned: row t holds position t's route) holds this
    rank's (row, layer) entries and zeros elsewhere (one stage owns a layer, one dp replica a row:
    summed over the mesh with `keep` False on the tp ranks but the first, every entry is written once)."""

    def __init__(self, model, shape, row_starts: list, rows_per_micro_batch: int, device: torch.device,
                 keep: bool = True, token_slots: Optional[list] = None):
        """`token_slots`: packed micro-batches (`training/packing.py`), each's slots in the batch
        (then `row_starts` only counts them)."""
        moe_ids = [i for i in range(len(model.layers)) if i not in model.cfg.dense_layers]
        self.out = torch.zeros(*shape, len(moe_ids), model.cfg.top_k, dtype=torch.int64, device=device)
        self.row_starts, self.rows, self.keep = row_starts, rows_per_micro_batch, keep
        self.token_slots = token_slots
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
            picks = output[2]
            slots = None if self.token_slots is None else self.token_slots[n]
            tokens = self.rows * self.out.shape[1] if slots is None else slots.numel()
            if picks.numel() != tokens * self.out.shape[-1]:
                raise ValueError("routing capture: the router saw a chunk of the sequence (parallel.moe_tp_tokens="
                                 "local under tensor parallelism); capture the routes with moe_tp_tokens=whole")
            if self.keep and slots is not None:
                dest = slots.reshape(-1)
                real = (dest >= 0).nonzero().squeeze(1)
                self.out.view(-1, *self.out.shape[2:])[dest[real], slot] = picks.reshape(tokens, -1)[real]
            elif self.keep:
                start = self.row_starts[n]
                self.out[start:start + self.rows, :, slot] = picks.view(self.rows, self.out.shape[1], -1)
            self.seen[layer] = n + 1
        return hook

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()

    def complete(self) -> torch.Tensor:
        assert all(n == len(self.row_starts) for n in self.seen.values()), self.seen
        return self.out

    def micro_batch(self, n: int) -> torch.Tensor:
        """Micro-batch `n`'s routes once its forward has run (a loss reading them, one stage holding
        every layer): [rows, T, num_moe_layers, k], or [1, tokens, ...] of a packed one (no padding slots)."""
        assert len(self.seen) == self.out.shape[2] and all(m > n for m in self.seen.values()), (n, self.seen)
        if self.token_slots is None:
            return self.out[self.row_starts[n]:self.row_starts[n] + self.rows]
        dest = self.token_slots[n].reshape(-1)
        assert bool((dest >= 0).all()), "padding slots hold no route"
        return self.out.view(-1, *self.out.shape[2:])[dest][None]


def split_rows(num_rows: int, dp: int, pp: int, micro_batch_size: int) -> tuple[int, int]:
    """(rows per dp replica, rows per micro-batch): at most `micro_batch_size`, dividing the share,
    and at least pp micro-batches (the schedules need them). Forward-only micro-batches may be cut
    freely: a row's outputs do not depend on its batch (batch-invariant numerics)."""
    share = num_rows // dp
    if num_rows % dp or share < pp:
        raise ValueError(f"a batch of {num_rows} rows does not split into {dp} equal data-parallel shares of "
                         f"at least pp={pp} rows (one per pipeline micro-batch); make the batch (for RL: "
                         f"num_prompts × group_size) a multiple of dp × pp = {dp * pp}")
    bound = max(1, min(int(micro_batch_size), share // pp))
    return share, max(d for d in range(1, bound + 1) if share % d == 0)


def packed_micro_batches(batch: dict, max_tokens: int, mesh, device) -> list[dict]:
    """This rank's packed micro-batches of a padded `batch`: its dp share's rows in bins of at most
    `max_tokens` tokens, as many on every dp rank (at least pp; `training/packing.balanced_bins`), with
    a pipeline all padded to the longest one (its p2p buffers are static)."""
    per_share = balanced_bins(real_lengths(batch["attention_mask"]), max_tokens, mesh.dp, mesh.pp)
    pad_to = None
    if mesh.pp > 1:
        lengths = real_lengths(batch["attention_mask"])
        pad_to = max(sum(lengths[i] for i in rows) for bins in per_share for rows in bins)
    return [{k: v.to(device) for k, v in pack_rows(batch, rows, pad_to).items()}
            for rows in per_share[mesh.coord("dp")]]


def forward_rows(trainer, batch: dict, row_loss: RowLoss, micro_batch_size: int,
                 capture_routing: bool = False, max_tokens: int = 0) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(rows [B, T] in the model's wide dtype, routes [B, T, num_moe_layers, k] or None) of `batch`
    (a dict of [B, ...] tensors, every key cut by rows; ``input_ids`` gives B and T), the same bits
    on every rank (module docstring). No gradients; the batch may sit on any device. `max_tokens` > 0:
    packed micro-batches of at most that many tokens (`packed_micro_batches`) instead of
    `micro_batch_size` rows; the rows come back in the padded layout all the same."""
    mesh = trainer.mesh
    if getattr(mesh, "cp", 1) > 1:
        raise ValueError(f"forward_rows (RL and verl scoring) splits rows, not sequences: not with parallel.cp="
                         f"{mesh.cp} > 1; score with a trainer built at parallel.cp=1 (context parallel trains the "
                         "LM loss only, docs/parallel.md)")
    ids = batch["input_ids"]
    if max_tokens:  # packed micro-batches of at most max_tokens tokens (`training/packing.py`)
        micro = packed_micro_batches(batch, max_tokens, mesh, trainer.device)
        mbs, slots = 1, [mb["token_slots"] for mb in micro]
        for i, mb in enumerate(micro):
            mb["row_start"] = i
    else:
        share, mbs = split_rows(ids.shape[0], mesh.dp, mesh.pp, micro_batch_size)
        first = mesh.coord("dp") * share
        micro = [{**{k: (None if v is None else v[s:s + mbs].to(trainer.device)) for k, v in batch.items()},
                  "row_start": s} for s in range(first, first + share, mbs)]
        slots = None
    keep = mesh.coord("tp") == 0  # the tp ranks compute the same rows: one of them writes
    dtype = wide_dtype(next(trainer.model.parameters()).dtype)
    full = torch.zeros(ids.shape, dtype=dtype, device=trainer.device)
    row_loss.out = full if keep else None
    routes = RoutingCapture(trainer.model, ids.shape, [mb["row_start"] for mb in micro], mbs, trainer.device,
                            keep, slots) if capture_routing else None
    try:
        trainer.forward_backward(micro, row_loss, forward_only=True)
    finally:
        row_loss.out = None
        if routes is not None:
            routes.remove()
    if mesh.world_size > 1:
        dist.all_reduce(full, group=mesh.group("world"))
    if routes is None:
        return full, None
    out = routes.complete()
    if mesh.world_size > 1:
        dist.all_reduce(out, group=mesh.group("world"))
    return full, out
