"""verl's two batch layouts, scored by our model.

Padded (DataProto.batch): `input_ids`/`attention_mask` [B, P+R] (left-padded prompts, right-padded
responses), `responses` [B, R]: outputs are [B, R] (position j = log p(response token j)).

No-padding (after verl's `left_right_2_no_padding`): `input_ids` a jagged nested tensor [B, j1] of
each sequence's real tokens, scored as one packed row (`nested_to_packed`: the nested tensor's
values back to back, `model/packing.py`; no re-padding): outputs are nested [B, j1] in verl's
left-shifted convention (position t of a sequence = log p(token t+1 | tokens <= t), 0 at its last
token), which verl's `no_padding_2_padding` slices back to [B, R] for its losses.

`entropy` (when asked) is the entropy of the same next-token distributions, same layout. verl's
`temperature` divides the logits (`rollout.logprobs.log_probs_from_logits`: the temperature-scaled
numbers come from the model's log-softmax rows).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron_fp4.model.packing import run_starts
from megatron_fp4.model.router import check_route_dtype
from megatron_fp4.rollout.logprobs import log_probs_from_logits
from megatron_fp4.rollout.scoring import model_inputs
from megatron_fp4.training.forward_only import RoutingCapture
from megatron_fp4.training.step_loss import StepLoss


def _temperature(data) -> float:
    # data["temperature"] unwraps a non-tensor entry (verl's trainer puts meta_info["temperature"]
    # there as NonTensorData); .get() would hand back the wrapper
    t = data["temperature"] if "temperature" in data.keys() else None
    if t is None:
        return 1.0
    if isinstance(t, torch.Tensor):
        t = t.reshape(-1)[0] if t.numel() else 1.0
    t = float(t)
    if not t > 0:
        raise ValueError(f"temperature={t}: must be > 0 (it divides the logits)")
    return t


def packed_route_capture(model, micro_batches: list, device) -> RoutingCapture:
    """The Trainer's `RoutingCapture` for nested micro-batches scored as packed rows (R2's old-log-prob
    pass records the routes): micro-batch n's tokens at their own slots of one row [1, ΣN], so
    `micro_batch(n)` is its [1, N, num_moe_layers, k], position t's route at row t."""
    sizes = [int(mb["input_ids"].offsets()[-1]) for mb in micro_batches]
    starts = [sum(sizes[:n]) for n in range(len(sizes))]
    slots = [torch.arange(s, s + n, device=device)[None] for s, n in zip(starts, sizes)]
    return RoutingCapture(model, (1, sum(sizes)), starts, 1, device, token_slots=slots)


def padded_outputs(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0,
                   entropy: bool = False, numerics=None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log_probs [B, T], entropy [B, T] or None) of `tokens` [B, T] under `logits` [B, T, V]: position
    t is about token t (0 at t = 0 and where `mask` is 0), logits divided by `temperature`."""
    lp, rows = log_probs_from_logits(logits, tokens, mask, numerics, temperature)  # rows [B, T-1, V]
    if not entropy:
        return lp, None
    ent = -(rows.exp() * rows).sum(-1)
    return lp, torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1) * mask.to(ent.dtype)


class VerlScore(StepLoss):
    """verl's model outputs of a micro-batch as a `StepLoss` (so `Trainer.forward_backward` runs them
    on any layout: under tp the logits arrive gathered over the vocabulary): `model_inputs` reads the
    micro-batch's tokens (padded or nested layout, `nested`), `outputs(logits, mb)` gives verl's dict
    ({"log_probs", "entropy"}, "routed_experts" when `recorder`, a `packed_route_capture` of the same
    micro-batches, records the routes); `loss` hands it to `loss_fn(outputs, mb)` -> (loss, metrics)."""

    def __init__(self, nested: bool, entropy: bool, replay: str = "off", recorder: Optional[RoutingCapture] = None,
                 numerics=None, loss_fn: Optional[Callable] = None):
        self.nested, self.entropy, self.replay, self.recorder = nested, entropy, replay, recorder
        self.numerics, self.loss_fn = numerics, loss_fn
        self.scored = 0  # micro-batches whose outputs were taken (the recorder's micro-batch index)

    def _tokens(self, mb):
        if self.nested:
            return nested_to_packed(mb["input_ids"])
        return mb["input_ids"], mb["attention_mask"], None

    def model_inputs(self, mb) -> dict:
        tokens, mask, _ = self._tokens(mb)
        routing_in = replay_routes(mb, self.replay, tokens.shape, self.nested) if self.replay != "off" else None
        return model_inputs(tokens, mask, routing_in)

    def outputs(self, logits: torch.Tensor, mb) -> dict:
        tokens, mask, lengths = self._tokens(mb)
        if self.nested:  # packed: a sequence's first token has no prediction (it would read the previous sequence's)
            mask = (mask != 0) & ~run_starts(mask)
        lp, ent = padded_outputs(logits, tokens, mask, _temperature(mb), self.entropy, self.numerics)
        if not self.nested:
            R = mb["responses"].shape[1]
            keep = mb["response_mask"].to(lp.dtype) if "response_mask" in mb.keys() else 1.0
            out = {"log_probs": lp[:, -R:] * keep}
            if ent is not None:
                out["entropy"] = ent[:, -R:] * keep
            return out
        out = {"log_probs": to_shifted_nested(lp, lengths)}
        if ent is not None:
            out["entropy"] = to_shifted_nested(ent, lengths)
        if self.recorder is not None:  # verl's shifted layout: position t's route at t, each final one -1 (live)
            used = self.recorder.micro_batch(self.scored)[0]
            starts = [0] + lengths.cumsum(0).tolist()[:-1]
            rows = [torch.cat([used[o:o + int(n) - 1], torch.full_like(used[:1], -1)])
                    for o, n in zip(starts, lengths.tolist())]
            out["routed_experts"] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
        self.scored += 1
        return out

    def loss(self, logits, mb):
        return self.loss_fn(self.outputs(logits, mb), mb)


def nested_to_packed(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [1, N], mask [1, N] numbering the sequences 1..B, lengths [B]) of a jagged nested [B, j1]:
    its values back to back in one packed row (`model/packing.py`)."""
    lengths = ids.offsets().diff()
    tokens = ids.values()[None]
    number = torch.arange(1, lengths.numel() + 1, device=tokens.device)
    return tokens, torch.repeat_interleave(number, lengths.to(tokens.device))[None], lengths


def to_shifted_nested(per_token: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Packed [1, N] (position t about token t; 0 at each sequence's first) -> jagged nested [B, j1]
    (position t about token t+1, 0 last)."""
    shifted = torch.cat([per_token[0, 1:], torch.zeros_like(per_token[0, :1])])
    return torch.nested.as_nested_tensor(list(shifted.split(lengths.tolist())), layout=torch.jagged)


def replay_routes(mb, replay: str, shape, packed: bool = False) -> torch.Tensor:
    """The model's ``routing_in`` [B, L, num_moe_layers, k] from ``mb["routed_experts"]`` (-1: live);
    `packed`: [1, N, ...] of the sequences back to back (`nested_to_packed`)."""
    from verl.utils.megatron.router_replay_utils import align_r3_router_replay_data, build_r3_replay_mask

    if "routed_experts" not in mb.keys() or mb["routed_experts"] is None:
        raise ValueError("router_replay: the micro-batch has no routed_experts; R2 records them in the "
                         "old-log-prob pass (compute_log_prob), R3 takes them from the rollout")
    ids, routes = mb["input_ids"], mb["routed_experts"]
    if not routes.is_nested:
        raise ValueError("router_replay: routed_experts must be a jagged nested tensor [B, j1, layers, k]")
    check_route_dtype(routes, "router_replay: routed_experts")  # verl's are int16; a float would be truncated
    keep = None
    if replay == "r3":
        routes = align_r3_router_replay_data(routes, ids)
        keep = build_r3_replay_mask(ids, mb["response_mask"])
    rows = [r.to(torch.long) for r in routes.unbind()]
    if keep is not None:
        rows = [torch.where(k.to(torch.bool)[:, None, None], r, -1) for r, k in zip(rows, keep.unbind())]
    if packed:
        return torch.cat(rows)[None].to(ids.device)
    out = torch.full((shape[0], shape[1], *rows[0].shape[1:]), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :r.shape[0]] = r
    return out.to(ids.device)
