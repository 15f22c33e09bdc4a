"""verl's two batch layouts, scored by our model.

Padded (DataProto.batch): `input_ids`/`attention_mask` [B, P+R] (left-padded prompts, right-padded
responses), `responses` [B, R]: outputs are [B, R] (position j = log p(response token j)).

No-padding (after verl's `left_right_2_no_padding`): `input_ids` a jagged nested tensor [B, j1] of
each sequence's real tokens: outputs are nested [B, j1] in verl's left-shifted convention (position
t of a sequence = log p(token t+1 | tokens <= t), 0 at its last token), which verl's
`no_padding_2_padding` slices back to [B, R] for its losses.

`entropy` (when asked) is the entropy of the same next-token distributions, same layout. verl's
`temperature` divides the logits: log_softmax(z / T) = log_softmax(log_softmax(z) / T), so the
temperature-scaled numbers come from the model's log-softmax rows.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_fp4.rollout.scoring import compute_log_probs


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


def score_padded_tokens(model, tokens: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0,
                        entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log_probs [B, T], entropy [B, T] or None): position t is about token t (0 at t = 0 and
    where `mask` is 0), logits divided by `temperature`."""
    if temperature == 1.0 and not entropy:
        return compute_log_probs(model, tokens, mask).log_probs, None
    dists = compute_log_probs(model, tokens, mask, return_distributions=True).distributions  # [B, T, V]
    if temperature != 1.0:
        dists = torch.log_softmax(dists / temperature, dim=-1)
        dists = torch.cat([torch.zeros_like(dists[:, :1]), dists[:, 1:]], dim=1)
    keep = mask.to(dists.dtype)
    lp = dists.gather(-1, tokens[..., None]).squeeze(-1) * keep
    lp = torch.cat([torch.zeros_like(lp[:, :1]), lp[:, 1:]], dim=1)
    ent = None
    if entropy:
        ent = -(dists.exp() * dists).sum(-1) * keep
        ent = torch.cat([torch.zeros_like(ent[:, :1]), ent[:, 1:]], dim=1)
    return lp, ent


def score_padded(model, mb, entropy: bool = False) -> dict:
    """Outputs of a padded-layout micro-batch: {"log_probs": [B, R], "entropy": [B, R]}."""
    R = mb["responses"].shape[1]
    lp, ent = score_padded_tokens(model, mb["input_ids"], mb["attention_mask"], _temperature(mb), entropy)
    keep = mb["response_mask"].to(lp.dtype) if "response_mask" in mb.keys() else 1.0
    out = {"log_probs": lp[:, -R:] * keep}
    if ent is not None:
        out["entropy"] = ent[:, -R:] * keep
    return out


def nested_to_padded(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B, L] right-padded with 0, mask [B, L], lengths [B]) of a jagged nested [B, j1]."""
    lengths = ids.offsets().diff()
    tokens = ids.to_padded_tensor(0)
    mask = (torch.arange(tokens.shape[1], device=tokens.device)[None] < lengths[:, None].to(tokens.device)).long()
    return tokens, mask, lengths


def to_shifted_nested(per_token: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, L] (position t about token t) -> jagged nested [B, j1] (position t about token t+1, 0 last)."""
    shifted = torch.cat([per_token[:, 1:], torch.zeros_like(per_token[:, :1])], dim=1)
    rows = [shifted[i, :int(n)] for i, n in enumerate(lengths.tolist())]
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def score_nested(model, mb, entropy: bool = False) -> dict:
    """Outputs of a no-padding micro-batch: {"log_probs": nested [B, j1], "entropy": nested [B, j1]}."""
    tokens, mask, lengths = nested_to_padded(mb["input_ids"])
    lp, ent = score_padded_tokens(model, tokens, mask, _temperature(mb), entropy)
    out = {"log_probs": to_shifted_nested(lp, lengths)}
    if ent is not None:
        out["entropy"] = to_shifted_nested(ent, lengths)
    return out
