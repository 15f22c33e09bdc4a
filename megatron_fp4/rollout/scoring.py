"""Trainer-side recomputation of token log-probs and routing: one full-sequence forward.

One way to score: `TokenLogProbs` is the model-level computation of a micro-batch's token
log-probs (its model inputs, and the log-probs of its logits: `rollout.logprobs`, the definition
the engine's decode uses too). On a layout it runs through the Trainer, per micro-batch
(`Trainer.forward_rows` -> `forward_backward(forward_only=True)`: `rl.algo.scorer.PolicyScorer`);
on a bare single-process model (the rollout engine's copy: consistency tools, benchmarks, tests)
`compute_log_probs` runs it on the whole batch as one micro-batch; `score` is that for token-id lists.

Scoring runs at the numerics level and FP4 mode the model was built with (``numerics.invariance``,
default ``batch``, ``fp4/invariant.py``; design rule 6), with or without autograd: at ``batch``, as
in the rollout engine, a token's log-prob has the same bits as the engine's KV-cache decode gave
it, in any batch, padding or split. ``mode`` / ``invariance`` arguments only check that the model
was built that way (a clear error otherwise); nothing switches the model's numerics per call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_fp4.fp4 import numerics_of
from megatron_fp4.model.packing import segment_positions
from megatron_fp4.rollout.engine import check_built_numerics
from megatron_fp4.rollout.logprobs import log_probs_from_logits, to_token_positions
from megatron_fp4.training.forward_only import RowLoss

__all__ = ["ScoreOutput", "TokenLogProbs", "compute_log_probs", "log_probs_from_logits", "score"]


@dataclass
class ScoreOutput:
    """log_probs [B, T]: position t holds log p(tokens[:, t] | tokens[:, :t]) (0 at t=0 and where
    the response mask is 0). routing [B, T, num_moe_layers, k]: the experts of the position that
    predicts token t (position t-1; row t=0 repeats nothing and is zero). distributions [B, T, V]:
    the raw log-softmax rows behind log_probs, same alignment."""

    log_probs: torch.Tensor
    routing: Optional[torch.Tensor] = None
    distributions: Optional[torch.Tensor] = None


def model_inputs(tokens: torch.Tensor, attention_mask: torch.Tensor, routing_in: Optional[torch.Tensor] = None) -> dict:
    """The model's inputs for a scored batch (verl layout, or packed rows: `model/packing.py`): positions
    from the mask, routes to replay (only when given: a bare model need not take ``routing_in``)."""
    inputs = {"tokens": tokens, "positions": segment_positions(attention_mask), "attention_mask": attention_mask}
    return inputs if routing_in is None else {**inputs, "routing_in": routing_in}


class TokenLogProbs(RowLoss):
    """The token log-probs of a micro-batch {input_ids, attention_mask, response_mask, replay_routing
    (optional)}: `model_inputs(mb)` and `scored(logits, mb)` (log-probs [b, T] as `compute_log_probs`,
    log-softmax rows [b, T-1, V]). The Trainer runs it per micro-batch on any layout (`rows`: the
    rows of `Trainer.forward_rows`), `compute_log_probs` on a bare model; `numerics`: the model's."""

    def __init__(self, numerics=None):
        self.numerics = numerics

    def model_inputs(self, mb: dict) -> dict:
        return model_inputs(mb["input_ids"], mb["attention_mask"], mb.get("replay_routing"))

    def scored(self, logits: torch.Tensor, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return log_probs_from_logits(logits, mb["input_ids"], mb["response_mask"], self.numerics)

    def rows(self, logits: torch.Tensor, mb: dict) -> torch.Tensor:
        return self.scored(logits, mb)[0]


def compute_log_probs(model, tokens: torch.Tensor, attention_mask: torch.Tensor,
                      response_mask: Optional[torch.Tensor] = None, mode: Optional[str] = None,
                      return_routing: bool = False, return_distributions: bool = False,
                      invariance: Optional[str] = None, routing_in: Optional[torch.Tensor] = None) -> ScoreOutput:
    """Score `tokens` [B, T] (verl layout: left-padded prompt, right-padded response) with a bare
    single-process `model` as one `TokenLogProbs` micro-batch, in one forward, in the FP4 mode and
    numerics level the model was built with (`mode`, `invariance`: None, or the ones it was built
    with: anything else is a ValueError; module doc). `response_mask`: the tokens scored (default:
    the attention mask). Differentiable: call under torch.no_grad() when only the numbers are needed.
    `routing_in`: routes to replay (`MoETransformer.run_layers`; position-aligned, not shifted)."""
    if tokens.shape != attention_mask.shape:
        raise ValueError(f"tokens {tuple(tokens.shape)} and attention_mask {tuple(attention_mask.shape)} "
                         "must have the same [batch, seq] shape")
    check_built_numerics(model, mode, invariance)
    mb = {"input_ids": tokens, "attention_mask": attention_mask,
          "response_mask": attention_mask if response_mask is None else response_mask, "replay_routing": routing_in}
    scoring = TokenLogProbs(numerics_of(model))
    out = model(**scoring.model_inputs(mb), return_routing=return_routing)
    log_probs, logp_all = scoring.scored(out.logits, mb)
    routing = dists = None
    if return_routing:
        moe = [r for r in out.routing if r is not None]
        routing = to_token_positions(torch.stack(moe, dim=2))  # [B, T, L_moe, k]
    if return_distributions:
        dists = torch.cat([logp_all.new_zeros(logp_all[:, :1].shape), logp_all], dim=1)
    return ScoreOutput(log_probs, routing, dists)


def score(model, prompts, responses, pad_id: int = 0, mode: Optional[str] = None,
          return_routing: bool = False, return_distributions: bool = False, invariance: Optional[str] = None):
    """Convenience over `compute_log_probs` for token-id lists: returns per-request tensors
    (log_probs [L], routing [L, num_moe_layers, k], distributions [L, V]) in the engine's format."""
    from megatron_fp4.rollout.engine import pad_prompt_response

    batch = pad_prompt_response(prompts, responses, pad_id)
    with torch.no_grad():
        out = compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"], mode,
                                return_routing, return_distributions, invariance)
    P = batch["prompt_len"]
    per = {"log_probs": [], "routing": [], "distributions": []}
    for i, r in enumerate(responses):
        sl = slice(P, P + len(r))
        per["log_probs"].append(out.log_probs[i, sl])
        per["routing"].append(out.routing[i, sl] if return_routing else None)
        per["distributions"].append(out.distributions[i, sl] if return_distributions else None)
    return per
