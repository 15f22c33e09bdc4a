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

    with training_step(step, first_micro_batch=dp_rank * num_micro_batches) as fp4_step:
        for i, mb in enumerate(micro_batches):
            with micro_batch(i):
                loss = model(mb); loss.backward()
    err = fp4_step.nonfinite_error()   # one host sync; a NonFiniteInputError naming the tensor, or None

The context is a ``contextvars.ContextVar`` (per thread / task, like autocast state). An FP4
Function captures it in forward and carries it into its backward explicitly (backward may run
on another thread, or after the micro-batch's context has closed, as pipeline schedules do).
Outside any step everything is step 0, micro-batch 0, eager checks.
"""
from __future__ import annotations

import contextvars
import hashlib
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator, Optional

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


_CURRENT: contextvars.ContextVar[QuantStep] = contextvars.ContextVar("megatron_fp4_quant_step", default=QuantStep())


def current() -> QuantStep:
    return _CURRENT.get()


@contextmanager
def _use(value: QuantStep) -> Iterator[QuantStep]:
    token = _CURRENT.set(value)
    try:
        yield value
    finally:
        _CURRENT.reset(token)


def training_step(step: int, first_micro_batch: int = 0, defer_nonfinite: Optional[bool] = None):
    """Context of one optimizer step (``step`` as the trainer counts it, restored on resume).

    ``first_micro_batch``: global index of this rank's first micro-batch (dp rank × micro-batches
    per rank when each dp rank reads a contiguous part of the global batch). ``defer_nonfinite``:
    True/False forces deferred/eager non-finite checks, None defers on non-CPU devices.
    """
    for field, value in (("step", step), ("first_micro_batch", first_micro_batch)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"training_step: {field}={value!r} must be a non-negative int")
    return _use(QuantStep(step, first_micro_batch, first_micro_batch, NonFiniteFlags(), defer_nonfinite))


def micro_batch(local_index: int):
    """Context of this rank's ``local_index``-th micro-batch of the current step."""
    if not isinstance(local_index, int) or local_index < 0:
        raise ValueError(f"micro_batch: local_index={local_index!r} must be a non-negative int")
    now = current()
    return _use(replace(now, micro_batch=now.first_micro_batch + local_index))


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
