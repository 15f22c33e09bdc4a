"""The loss handed to one training step, split the way a pipeline needs it.

Megatron-Core's schedules take a `forward_step_func` that returns the model output and a loss
function for it; here a `StepLoss` says two things about a micro-batch (a dict of tensors):

- `model_inputs(mb)`: what the model reads — ``tokens`` [B, T] and, optionally, ``positions`` and
  ``attention_mask`` (left-padded RL batches);
- `loss(logits, mb)`: the micro-batch's mean loss from the logits, and a dict of float metrics.

Without a pipeline the trainer calls ``loss(model(**model_inputs(mb)).logits, mb)`` (which is also
what calling the object as ``loss_fn(model, mb)`` does); with one, the first stage embeds the tokens,
every stage runs its layers with the micro-batch's positions and mask, and `loss` runs on the last
stage with the whole micro-batch dict (labels, masks, advantages, old log-probs...). The LM loss is
`lm_loss_fn`; the GRPO/PPO policy loss is `megatron_fp4.rl.algo.policy_loss.PolicyLoss`.

A plain callable ``loss_fn(model, mb) -> (loss, metrics)`` still works without a pipeline: it runs
the model itself, which a pipeline stage cannot do.
"""
from __future__ import annotations

from typing import Callable, Union

import torch

from megatron_fp4.model import lm_loss
from megatron_fp4.parallel import context
from megatron_fp4.parallel.tp_comm import gather_whole, reduce_from_tp


class StepLoss:
    def model_inputs(self, micro_batch: dict) -> dict:
        return {"tokens": micro_batch["tokens"]}

    def loss(self, logits: torch.Tensor, micro_batch: dict) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError

    def __call__(self, model, micro_batch: dict) -> tuple[torch.Tensor, dict]:
        return self.loss(model(**self.model_inputs(micro_batch)).logits, micro_batch)


class LMLoss(StepLoss):
    """Next-token cross entropy of one micro-batch ({'tokens', 'labels'})."""

    def loss(self, logits, micro_batch):
        return lm_loss(logits, micro_batch["labels"]), {}


lm_loss_fn = LMLoss()
LossFn = Union[StepLoss, Callable[[torch.nn.Module, dict], tuple]]


def require_step_loss(loss_fn: LossFn) -> StepLoss:
    """`loss_fn` as a StepLoss, or a ValueError saying how to write one (a pipeline needs it)."""
    if not isinstance(loss_fn, StepLoss):
        raise ValueError(f"with parallel.pp > 1 the loss runs on the last pipeline stage, so it must be a "
                         f"megatron_fp4.training.step_loss.StepLoss (model_inputs(mb) and loss(logits, mb)), not "
                         f"{type(loss_fn).__name__}; see lm_loss_fn and rl.algo.policy_loss.PolicyLoss")
    return loss_fn


class TensorParallelLoss(StepLoss):
    """`inner` on logits split along the vocabulary over the tensor-parallel ranks (`TPPlan`): the
    LM loss as vocab-parallel cross entropy (`TPPlan.loss`, never the full logits), any other
    `StepLoss` on the full logits all-gathered with a gradient path (each rank's loss is the same,
    so the gradient of its slice is its chunk of the full logits' gradient)."""

    def __init__(self, inner: StepLoss, plan):
        self.inner, self.plan = inner, plan

    def model_inputs(self, micro_batch):
        return self.inner.model_inputs(micro_batch)

    def loss(self, logits, micro_batch):
        if type(self.inner) is LMLoss:
            return self.plan.loss(logits, micro_batch["labels"]), {}
        return self.inner.loss(gather_whole(logits, self.plan.group, logits.dim() - 1), micro_batch)


def tensor_parallel_loss(loss_fn: LossFn, plan) -> LossFn:
    """`loss_fn` for a tensor-parallel model (`plan`: its `TPPlan`; None: `loss_fn` itself)."""
    if plan is None:
        return loss_fn
    if not isinstance(loss_fn, StepLoss):
        raise ValueError(f"with parallel.tp > 1 the model's logits are split along the vocabulary, so the loss must "
                         f"be a megatron_fp4.training.step_loss.StepLoss (model_inputs(mb) and loss(logits, mb)), "
                         f"not {type(loss_fn).__name__}; see lm_loss_fn and rl.algo.policy_loss.PolicyLoss")
    return TensorParallelLoss(loss_fn, plan)


class ContextParallelLoss(StepLoss):
    """The LM loss under context parallelism (`ContextParallelPlan`): the model reads this rank's
    tokens at their global positions (`context.split_sequence`), the loss is the micro-batch's
    (`context.lm_loss`: every cp rank gets the single process's value, its gradient is its own
    tokens' share). Other losses (GRPO/PPO, verl's) are refused: they are not split yet."""

    def __init__(self, inner: StepLoss, plan):
        lm = type(inner) is LMLoss or (type(inner) is TensorParallelLoss and type(inner.inner) is LMLoss)
        if not lm:
            raise ValueError(f"context parallel (parallel.cp={plan.size}) trains the LM loss only (lm_loss_fn); "
                             f"{type(inner).__name__} (the GRPO/PPO policy loss, verl's losses) is not split over "
                             f"the cp ranks yet: set parallel.cp=1")
        self.inner, self.plan = inner, plan

    def model_inputs(self, micro_batch):
        inputs = self.inner.model_inputs(micro_batch)
        tokens = inputs["tokens"]
        positions = inputs.get("positions")
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape)
        return {"tokens": context.split_sequence(tokens, self.plan),
                "positions": context.split_sequence(positions, self.plan)}

    def loss(self, logits, micro_batch):
        labels = micro_batch["labels"]
        if type(self.inner) is LMLoss:
            return context.lm_loss(logits, labels, self.plan), {}
        # tp: the vocab-parallel mean over this rank's tokens, weighted by their share of the labels
        local = context.split_sequence(labels, self.plan)
        mean = self.inner.loss(logits, {"labels": local})[0]
        share = mean * (local != -100).sum().to(mean.dtype) / (labels != -100).sum().to(mean.dtype)
        return reduce_from_tp(share, self.plan.group), {}


def context_parallel_loss(loss_fn: LossFn, plan) -> LossFn:
    """`loss_fn` for a context-parallel model (`plan`: its `ContextParallelPlan`; None: `loss_fn` itself)."""
    if plan is None:
        return loss_fn
    if not isinstance(loss_fn, StepLoss):
        raise ValueError(f"with parallel.cp > 1 the model reads a share of each sequence, so the loss must be "
                         f"megatron_fp4.training.step_loss.lm_loss_fn, not {type(loss_fn).__name__}")
    return ContextParallelLoss(loss_fn, plan)
