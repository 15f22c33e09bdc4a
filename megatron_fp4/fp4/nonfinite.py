"""Deferred NaN/Inf checks of FP4 operands: device-side flags, read once per step.

An eager check (``bool(torch.isfinite(amax).all())``) copies a flag to the host at every
quantization, which on a GPU waits for the stream to drain. :class:`NonFiniteFlags` instead keeps
one 0-dim device bool per (quantizer, tensor name), OR-ing each quantization's flag into it with a
device op, and :meth:`error` reads them all with one host transfer. The error still names the
tensor (``NonFiniteInputError``, as the eager check raises); it cannot count the non-finite
elements (the tensor is gone by then), and it reports the first flagged tensor in recording
order plus how many others were flagged.
"""
from __future__ import annotations

import torch

from megatron_fp4.fp4.formats import NonFiniteInputError


class NonFiniteFlags:
    """Per-tensor non-finite flags of one step (see the module docstring)."""

    def __init__(self):
        self._flags: dict[tuple[str, str], torch.Tensor] = {}  # (what, name) -> 0-dim bool, device

    def record(self, name: str, what: str, finite: torch.Tensor) -> None:
        """Note ``finite`` (a 0-dim bool tensor: the operand had no NaN/Inf) without a host sync."""
        bad = torch.logical_not(finite)
        key = (what, name)
        # The same two ops whether the key is new or not, out of place: an activation recompute
        # re-runs the forward with these flags already holding the key, and selective checkpointing
        # requires the recompute's ops to match the forward's one for one.
        self._flags[key] = torch.logical_or(self._flags.get(key, bad), bad)

    def __len__(self) -> int:
        return len(self._flags)

    def any_flag(self, device=None) -> torch.Tensor:
        """A 0-dim float32 tensor on ``device``, 1 if any operand was non-finite, else 0 (no sync):
        fold it into a cross-rank all-reduce so every rank refuses the step together."""
        if not self._flags:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack(list(self._flags.values())).any().to(device=device, dtype=torch.float32)

    def error(self) -> NonFiniteInputError | None:
        """The first flagged operand as an error (not raised), or None. One host sync."""
        if not self._flags:
            return None
        keys = list(self._flags)
        bad = torch.stack(list(self._flags.values())).cpu().tolist()
        hits = [k for k, b in zip(keys, bad) if b]
        if not hits:
            return None
        what, name = hits[0]
        others = f" ({len(hits) - 1} other tensor(s) too)" if len(hits) > 1 else ""
        return NonFiniteInputError(
            f"{what}: tensor '{name}' had non-finite element(s) (NaN/Inf) in this step{others}; "
            "FP4 block scales cannot represent them (check the producer of this tensor)")

    def check(self) -> None:
        """Raise :meth:`error` if any operand was non-finite."""
        err = self.error()
        if err is not None:
            raise err

    def reset(self) -> None:
        self._flags.clear()


class FlagTee:
    """Records into `flags` and keeps what it recorded (a cached Q(W) records it again on a hit)."""

    def __init__(self, flags: NonFiniteFlags):
        self.flags, self.seen = flags, []

    def record(self, name: str, what: str, finite: torch.Tensor) -> None:
        self.seen.append((name, what, finite))
        self.flags.record(name, what, finite)
