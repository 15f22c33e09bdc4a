"""Micro-batches packed to a token budget (``rl.max_tokens_per_micro_batch``): a padded batch's rows
(verl's layout: left-padded prompt, right-padded response) cut to their real tokens and laid back
to back in one row per micro-batch, no padding in between (`model/packing.py`: the attention mask
numbers a row's sequences 1, 2, ...; positions restart with each).

- `token_bins(lengths, budget)`: which rows go together. First-fit decreasing: rows by length,
  longest first (ties: lower index first), each into the first micro-batch it fits; rows inside a
  micro-batch in index order. Deterministic: the same lengths give the same bins on every rank.
- `pack_rows(batch, rows)`: one packed micro-batch of those rows: every [B, T, ...] tensor at the
  real tokens, every [B] tensor (advantages) repeated per token, and ``token_slots`` [1, L] (the
  flat index b·T + t in the padded batch of each packed token; -1 at padding) to put per-token
  results back (`unpack_rows`).
- `balanced_bins`: the bins of a batch cut into ``shares`` contiguous equal shares (data-parallel
  ranks), each share's bins split until every share has the same count (at least ``minimum``: the
  pipeline's micro-batches), since expert and pipeline parallel ranks step through micro-batches together.
"""
from __future__ import annotations

from typing import Optional

import torch

FIELD = "rl.max_tokens_per_micro_batch"


def check_budget(budget) -> int:
    """``budget`` as an int >= 0 (0/None: padded micro-batches), or a ValueError naming the field."""
    if budget is None:
        return 0
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"{FIELD}={budget!r} must be an integer >= 0 (0: padded micro-batches of micro_batch_size "
                         "rows; N: micro-batches packed to at most N tokens)")
    return budget


def token_bins(lengths, budget: int) -> list[list[int]]:
    """Row indices per micro-batch: first-fit decreasing of `lengths` into bins of at most `budget` tokens."""
    lengths = [int(n) for n in lengths]
    for i, n in enumerate(lengths):
        if n > budget:
            raise ValueError(f"a sequence of {n} tokens (row {i}: prompt + response) is longer than {FIELD}={budget}; "
                             f"raise {FIELD} to at least the longest prompt + max_new_tokens, or set it to 0 "
                             "(padded micro-batches)")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return [sorted(b) for b in bins]


def _split_largest(bins: list[list[int]], lengths: list[int]) -> bool:
    """Split the bin of most rows (then most tokens, then first) into two halves by row order; False if none can."""
    candidates = [b for b in range(len(bins)) if len(bins[b]) > 1]
    if not candidates:
        return False
    b = max(candidates, key=lambda b: (len(bins[b]), sum(lengths[i] for i in bins[b]), -b))
    rows = bins.pop(b)
    half = len(rows) // 2
    bins[b:b] = [rows[:half], rows[half:]]
    return True


def balanced_bins(lengths, budget: int, shares: int = 1, minimum: int = 1) -> list[list[list[int]]]:
    """Per contiguous share of the rows (global indices), its bins; every share the same count (the
    most any share needs, at least `minimum`), by splitting a share's fullest bins."""
    lengths = [int(n) for n in lengths]
    size = len(lengths) // shares
    if len(lengths) % shares or size < minimum:
        raise ValueError(f"{len(lengths)} rows do not split into {shares} equal data-parallel shares of at least "
                         f"{minimum} rows (one per pipeline micro-batch)")
    per = [[[s * size + i for i in b] for b in token_bins(lengths[s * size:(s + 1) * size], budget)]
           for s in range(shares)]
    count = max(minimum, max(len(b) for b in per))
    for bins in per:
        while len(bins) < count:
            assert _split_largest(bins, lengths), (bins, count)  # a share has >= count rows
    return per


def real_lengths(attention_mask: torch.Tensor) -> list[int]:
    """Real tokens per row of a padded batch."""
    return (attention_mask != 0).sum(-1).tolist()


def pack_rows(batch: dict, rows: list[int], pad_to: Optional[int] = None) -> dict:
    """One packed micro-batch [1, L] of `rows` of the padded `batch` (module doc); `pad_to`: L at
    least that (padding at the end: mask 0, token_slots -1; a pipeline's micro-batches need one
    shape). Keys other than [B, ...] tensors (e.g. ``prompt_len``) are left out."""
    mask = batch["attention_mask"]
    B, T = mask.shape
    real = [(mask[r] != 0).nonzero().squeeze(1) for r in rows]
    flat = torch.cat([r * T + t for r, t in zip(rows, real)])
    L = flat.numel()
    width = max(L, pad_to or 0)
    out = {}
    seg = torch.cat([torch.full((t.numel(),), n + 1, dtype=mask.dtype) for n, t in enumerate(real)])
    for key, value in batch.items():
        if not torch.is_tensor(value) or value.shape[:1] != (B,):
            continue
        if value.dim() >= 2 and value.shape[1] == T:
            packed = value.reshape(B * T, *value.shape[2:]).index_select(0, flat)
        else:  # one value per row: repeated over its tokens
            packed = torch.cat([value[r].expand(t.numel(), *value.shape[1:]) for r, t in zip(rows, real)])
        if key == "attention_mask":
            packed = seg
        if width > L:
            fill = -1 if key == "replay_routing" else 0
            packed = torch.cat([packed, packed.new_full((width - L, *packed.shape[1:]), fill)])
        out[key] = packed.unsqueeze(0)
    out["token_slots"] = torch.cat([flat, flat.new_full((width - L,), -1)]).unsqueeze(0)
    return out


def unpack_rows(values: torch.Tensor, token_slots: torch.Tensor, out: torch.Tensor) -> None:
    """Write per-token `values` [R, L, ...] of a packed micro-batch into `out` [B, T, ...] at their slots."""
    slots = token_slots.reshape(-1)
    keep = (slots >= 0).nonzero().squeeze(1)
    flat = out.view(-1, *out.shape[2:])
    flat[slots.index_select(0, keep).to(out.device)] = values.reshape(-1, *values.shape[2:]).index_select(
        0, keep.to(values.device)).to(out.dtype)
