"""Packed sequences: several sequences back to back in one row, no padding between them.

The model's ``attention_mask`` [B, T] carries the layout. A 0/1 mask is today's padded batch (one
sequence per row, 0 = padding). A mask with a value above 1 is *packed*: each maximal run of one
nonzero value is one sequence (`training/packing.py` numbers a row's sequences 1, 2, 3, ...), 0 is
padding (a pipeline's micro-batches are padded at the end to one length). A packed token's
position restarts at 0 with its sequence (`segment_positions`: RoPE sees each sequence from 0),
and it attends only to the earlier tokens of its own sequence.

Attention on a packed batch runs on the sequences unpacked into rows of their own (`SequenceLayout`:
[N, L], right-padded; by length class, `by_length`, so the rows hold at most twice the real
tokens), through the same attention a padded batch uses at every numerics level, and the outputs
are packed back. At the ``batch`` and ``exact`` levels a query's
bits then equal those of the padded batch (the attention's contract: a row's result depends only
on its keys by position, not on its batch, padding or tile), and every other op is per token, so
a packed forward gives each token the padded forward's bits (tests/unit/test_packed_batches.py).
At ``standard`` the unpacked rows run SDPA's causal kernel: the same math, other rounding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def is_packed(attention_mask: Optional[torch.Tensor]) -> bool:
    """Whether `attention_mask` describes packed rows (a value above 1; module doc)."""
    return attention_mask is not None and attention_mask.numel() > 0 and int(attention_mask.max()) > 1


def run_starts(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the first token of each sequence (a nonzero value unlike the one before it)."""
    prev = torch.cat([attention_mask.new_zeros(attention_mask.shape[0], 1), attention_mask[:, :-1]], 1)
    return (attention_mask != 0) & (attention_mask != prev)


def segment_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions of a batch's tokens: counted from each sequence's first token (0 for padding). A 0/1
    mask gives the padded layout's positions, ``cumsum - 1`` clamped at 0 (the rollout engine's
    ``positions_from_mask``: the same integers as always); a packed one restarts at each sequence."""
    if not is_packed(attention_mask):
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    T = attention_mask.shape[1]
    idx = torch.arange(T, device=attention_mask.device).expand_as(attention_mask)
    start = torch.where(run_starts(attention_mask), idx, torch.zeros_like(idx)).cummax(-1).values
    return torch.where(attention_mask != 0, idx - start, torch.zeros_like(idx))


@dataclass
class SequenceLayout:
    """Where the N sequences of a packed [B, T] batch sit: sequence n is row ``index // T``, slots
    ``index[n, :lengths[n]] % T``; `unpack` lays them out as rows [N, L] (L the longest), right-padded
    with zeros, and `repack` puts per-slot results back (zeros at the padding)."""

    index: torch.Tensor  # [N, L] flat slot (b·T + t) of sequence n's token j (0 where j >= length)
    valid: torch.Tensor  # [N, L] bool: j < lengths[n]
    shape: tuple  # (B, T) of the packed batch

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> "SequenceLayout":
        B, T = attention_mask.shape
        starts = run_starts(attention_mask).reshape(-1)
        flat_starts = starts.nonzero().squeeze(1)  # [N], sequence order
        N = flat_starts.numel()
        if N == 0:
            raise ValueError("a packed batch without a single real token (attention_mask all 0)")
        # A real token belongs to the last sequence started at or before it (a sequence ends at the
        # next start, at padding, or at its row's end: the next row's first token starts a sequence).
        real = (attention_mask != 0).reshape(-1)
        lengths = torch.bincount((starts.long().cumsum(0) - 1)[real], minlength=N)
        L = int(lengths.max())
        j = torch.arange(L, device=attention_mask.device)
        valid = j[None, :] < lengths[:, None]
        index = torch.where(valid, flat_starts[:, None] + j[None, :], torch.zeros_like(valid, dtype=torch.long))
        return cls(index, valid, (B, T))

    @property
    def positions(self) -> torch.Tensor:
        """[N, L] positions of the unpacked rows (0..length-1, 0 at the padding)."""
        j = torch.arange(self.index.shape[1], device=self.index.device).expand_as(self.index)
        return torch.where(self.valid, j, torch.zeros_like(j))

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, ...] -> [N, L, ...]: sequence n's tokens in row n, zeros after its end."""
        flat = x.reshape(self.shape[0] * self.shape[1], *x.shape[2:])
        rows = flat.index_select(0, self.index.reshape(-1)).view(*self.index.shape, *x.shape[2:])
        keep = self.valid.view(*self.valid.shape, *(1,) * (x.dim() - 2))
        return torch.where(keep, rows, torch.zeros((), dtype=x.dtype, device=x.device))

    def repack(self, y: torch.Tensor, into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """y [N, L, ...] -> [B, T, ...]: each sequence's slots back in place, zeros at the padding
        (`into` [B, T, ...]: written into a copy of it instead of zeros)."""
        B, T = self.shape
        sel = self.valid.reshape(-1).nonzero().squeeze(1)
        src = y.reshape(-1, *y.shape[2:]).index_select(0, sel)
        base = y.new_zeros(B * T, *y.shape[2:]) if into is None else into.reshape(B * T, *y.shape[2:])
        out = base.index_copy(0, self.index.reshape(-1).index_select(0, sel), src)
        return out.view(B, T, *y.shape[2:])

    def by_length(self) -> list["SequenceLayout"]:
        """The sequences in length classes (lengths in (2^(c-1), 2^c]), each class padded only to its
        longest: the unpacked rows hold at most twice the real tokens (one long sequence beside many
        short ones would otherwise pad them all to its length)."""
        lengths = self.valid.sum(1)
        classes = torch.ceil(torch.log2(lengths.double())).long()
        out = []
        for c in torch.unique(classes).tolist():
            rows = (classes == c).nonzero().squeeze(1)
            L = int(lengths.index_select(0, rows).max())
            out.append(SequenceLayout(self.index.index_select(0, rows)[:, :L], self.valid.index_select(0, rows)[:, :L],
                                      self.shape))
        return out


def refuse_packed(attention_mask: Optional[torch.Tensor], family: str) -> None:
    """A clear error for an attention without packed-sequence support."""
    if is_packed(attention_mask):
        raise ValueError(f"packed sequences (an attention_mask with values > 1) are not supported by the {family} "
                         "attention; set rl.max_tokens_per_micro_batch=0 (padded micro-batches) for this family")
