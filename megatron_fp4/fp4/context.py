"""Where in training an FP4 quantization runs: the step context.

Two things depend on it, and both are explicit values set by the trainer, never ad hoc globals:

- **Stochastic-rounding seeds.** Each SR draw gets its own stream, seeded from
  ``(recipe.seed, layer, step, micro-batch, operand)`` by :func:`sr_seed` (a keyed hash, the same
  in every process and Python run). ``layer`` is the module's *global* name (set once on the full
  model by :func:`name_quant_sites`, kept by pipeline and expert splitting; experts append their
  global expert id), ``micro_batch`` the *global* micro-batch index of the step
  (``first_micro_batch`` of this rank + the local index), so pp/dp layouts and a resumed run draw
  the same numbers as one uninterrupted process for the same micro-batch. Consecutive steps,
  micro-batches, layers and operands draw independent noise, which is what lets SR noise average
  out (a stream reused every step would add the same error every step).
- **Deferred non-finite checks.** Inside a step, quantizations record a device-side NaN/Inf flag
  per tensor (:class:`NonFiniteFlags`) instead of syncing the host with ``bool(...)`` at every
  call; the trainer reads them once, at the end of the step. Deferral is on for non-CPU tensors
  by default (where a sync stalls a stream) and can be forced on (tests) or off.

The step state lives in the model's ``Numerics`` (``numerics.py``), which the trainer advances
explicitly (``numerics.training_step(...)``, ``numerics.micro_batch(i)``). An FP4 Function
captures it in forward and carries it into its backward explicitly (backward may run on another
thread, or after the micro-batch's block has closed, as pipeline schedules do). Outside any step
everything is step 0, micro-batch 0, eager checks.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_fp4.fp4.nonfinite import NonFiniteFlags


@dataclass(frozen=True)
class QuantStep:
    """The training position of the FP4 quantizations that run now."""

    step: int = 0
    first_micro_batch: int = 0  # global index of this rank's first micro-batch of the step
    micro_batch: int = 0  # global micro-batch index
    flags: Optional[NonFiniteFlags] = None  # the step's deferred non-finite flags (None: no step open)
    defer_nonfinite: Optional[bool] = None  # None: defer on non-CPU devices only

    def nonfinite_flags_for(self, device: torch.device) -> Optional[NonFiniteFlags]:
        """Where a quantization on ``device`` records its non-finite flag (None: check eagerly)."""
        if self.flags is None:
            return None
        defer = self.defer_nonfinite if self.defer_nonfinite is not None else torch.device(device).type != "cpu"
        return self.flags if defer else None

    def nonfinite_error(self):
        """The step's first deferred non-finite operand as a ``NonFiniteInputError``, or None (one sync)."""
        return None if self.flags is None else self.flags.error()

    def check_nonfinite(self) -> None:
        """Raise the error of :meth:`nonfinite_error` if there is one."""
        if self.flags is not None:
            self.flags.check()


def sr_seed(base_seed: int, layer: str, step: int, micro_batch: int, operand: str) -> int:
    """63-bit seed of one stochastic-rounding stream: a keyed BLAKE2b hash of the identifiers
    (stable across processes and runs, unlike Python's ``hash``)."""
    key = "\x1f".join((str(base_seed), layer, str(step), str(micro_batch), operand)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, person=b"fp4-sr").digest(), "little") >> 1


def name_quant_sites(model: torch.nn.Module) -> None:
    """Give every FP4 module of ``model`` (those with a ``quant_name`` attribute) its global module
    name. Call on the full model, before pipeline or expert splitting, so names stay global."""
    for name, module in model.named_modules():
        if hasattr(module, "quant_name"):
            module.quant_name = name
