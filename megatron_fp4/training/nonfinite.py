"""The NaN guard's gate: non-finite values are caught at every decoder layer boundary, counted, and
replaced by zeros, so a step that goes bad on one rank still runs to the end on every rank.

Why a gate and not an exception. A NaN on one rank used to surface as `NonFiniteInputError` from an
FP4 quantizer in the middle of forward or backward. Unwinding from there leaves that rank's
collectives short: the pipeline's p2p sends and receives, the expert all-to-alls and ZeRO's
bucket all-reduces (launched by gradient hooks as backward goes) are then issued on one rank and
not on its peers, and the job dies with a collective mismatch or hangs. With the gate, every
layer's input (forward) and every gradient of a layer's output (backward) is checked; a non-finite
one trips the gate and continues as zeros. Every rank therefore runs the same operations in the
same order whatever its values, and the decision to skip or stop is taken afterwards, by every rank
together (`ParallelMesh.ranks_with`), before the optimizer touches anything.

Cost: one `isfinite` reduction per layer boundary and direction, the same kind of check the FP4
quantizers already make on each operand.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch


class NonFiniteError(RuntimeError):
    """Loss, gradients or weights were NaN/Inf; the run stops (the message says what was kept)."""


class _Gate(torch.autograd.Function):
    """Identity for finite tensors in both directions; a non-finite one trips the gate and is zeroed."""

    @staticmethod
    def forward(ctx, x, gate: "LayerGate", where: str):
        ctx.gate, ctx.where = gate, where
        return gate.clean(x, where).view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.gate.clean(grad, f"gradient of the {ctx.where}"), None, None


class LayerGate:
    """Watches the decoder layers of one model during a step (`watching`); `where` names the first
    place a non-finite value was seen on this rank (None: nothing seen)."""

    def __init__(self):
        self.where: Optional[str] = None

    @property
    def tripped(self) -> bool:
        return self.where is not None

    def reset(self) -> None:
        self.where = None

    def trip(self, where: str) -> None:
        if self.where is None:
            self.where = where

    def clean(self, x: torch.Tensor, where: str) -> torch.Tensor:
        if x is None or bool(torch.isfinite(x).all()):
            return x
        self.trip(where)
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)

    def _gate(self, x, where: str):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return _Gate.apply(x, self, where)
        return x

    @contextmanager
    def watching(self, layers):
        """Gate the input and the output of every layer in `layers` (absent pipeline placeholders
        are never called, so their hooks never run)."""
        handles = []
        for i, layer in enumerate(layers):
            def pre(module, args, i=i):
                return (self._gate(args[0], f"input of model.layers.{i}"),) + tuple(args[1:]) if args else None

            def post(module, args, output, i=i):
                if isinstance(output, tuple):
                    return (self._gate(output[0], f"output of model.layers.{i}"),) + output[1:]
                return self._gate(output, f"output of model.layers.{i}")

            handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()


def all_finite(tensors) -> bool:
    """True when every tensor holds only finite values (one reduction per tensor, one sync)."""
    flags = [torch.isfinite(t).all() for t in tensors]
    return bool(torch.stack(flags).all()) if flags else True
