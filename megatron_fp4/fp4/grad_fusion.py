"""Gradient-accumulation fusion (Megatron-Core's ``gradient_accumulation_fusion``, portable): a
weight-gradient kernel writes its GEMMs straight into the optimizer's zeroed gradient buffer instead
of returning a weight-sized tensor that autograd then adds into that buffer.

At 100M+ expert parameters the add is a pass over every expert gradient (read two, write one) and
the returned tensor a fresh weight-sized allocation each step (issue 37). The optimizer
(`parallel.zero.ZeroAdamW`) attaches a :class:`FusedGrad` to each parameter whose gradient is a view
of a buffer it zeroes every step (``param.fused_grad``); the ``batch`` level's tiled GEMMs
(``fp4/tiled.py``: the dense ones — attention projections, router, LM head — and the FP4-off grouped
experts) and ``fp4/moeresq_grouped.py``'s wgrad ask it for the destination with
:meth:`FusedGrad.claim` and return no gradient when they get one.

The bits are those of autograd's accumulation into the zeroed buffer, ``0 + g``: the kernel writes
``g`` and adds ``+0.0`` (a ``-0.0`` becomes ``+0.0``, as in ``0 + g``; nothing else changes). A claim
is granted only when nothing can have been accumulated before it in the step and no other
contribution of the kernel's own can follow in the same sum:

- the buffer is still zero: set by the optimizer's ``zero_grad``, cleared by the first claim and by
  every ordinary accumulation into the parameter (the optimizer's post-accumulate-grad hook calls
  :meth:`FusedGrad.accumulated`);
- the kernel's forward was the parameter's only use in flight (:meth:`FusedGrad.forward_use`
  counts uses whose backward has not run yet): several uses in one graph (chunked expert calls,
  a pipeline's micro-batches in flight, recompute) take the ordinary path, whose summation order
  the fused write would change;
- the parameter's ``.grad`` is still the buffer's view (someone may have set it to ``None``);
- the running backward accumulates into ``.grad`` (``torch.autograd.grad`` returns gradients: the
  zero-bubble schedules' split input/weight passes take the ordinary path).

A granted claim fires none of the optimizer's bucket hooks: the optimizer grants claims only for
buffers it reduces in a group of one (nothing to overlap), and reduces every bucket whose hooks did
not all fire when the step is applied, so correctness never depends on them.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch


class FusedGrad:
    """The zeroed gradient destination of one parameter (``view``: its ``.grad``, a view of the
    optimizer's flat buffer), granted once per step to the kernel that is the parameter's sole use."""

    __slots__ = ("param_ref", "view", "is_zero", "in_flight", "uses")

    def __init__(self, param: torch.Tensor, view: torch.Tensor):
        self.param_ref, self.view = weakref.ref(param), view
        self.reset(zeroed=False)

    def reset(self, zeroed: bool) -> None:
        """A new step (the optimizer's ``zero_grad``): ``zeroed`` the buffer was just zeroed."""
        self.is_zero, self.in_flight, self.uses = zeroed, 0, 0

    def accumulated(self) -> None:
        """An ordinary (autograd) accumulation into the parameter's gradient happened."""
        self.is_zero = False

    def forward_use(self) -> "FusedGrad":
        """A fused kernel's forward used the parameter (call once per forward, with autograd)."""
        self.in_flight += 1
        self.uses += 1
        return self

    def claim(self) -> Optional[torch.Tensor]:
        """In that kernel's backward (exactly once per `forward_use`): the zeroed destination to write
        the gradient into (then return no gradient for the parameter), or None (return it as usual)."""
        sole = self.uses == 1 and self.in_flight == 1
        self.in_flight = max(0, self.in_flight - 1)
        if self.in_flight == 0:
            self.uses = 0
        param = self.param_ref()
        if not (sole and self.is_zero) or param is None or param.grad is None \
                or param.grad.data_ptr() != self.view.data_ptr() or param.grad.shape != self.view.shape \
                or not _accumulates(param):
            return None
        self.is_zero = False
        return self.view


def _accumulates(param: torch.Tensor) -> bool:
    """Whether the running backward accumulates into ``param.grad`` (``.backward()``, also with
    ``inputs`` naming it), not ``torch.autograd.grad`` returning gradients (zero-bubble pipeline
    schedules' input and weight passes) or a ``.backward(inputs=...)`` without it."""
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if will_execute is None:
        return False
    with torch.enable_grad():
        node = param.view_as(param).grad_fn.next_functions[0][0]  # its AccumulateGrad
    try:
        return bool(will_execute(node))
    except RuntimeError:  # autograd.grad() with the leaf as an input: returned, not accumulated
        return False


def claim_fused(ctx) -> Optional[torch.Tensor]:
    """In a fused kernel's backward: `FusedGrad.claim` of the `fused_grad_of` its forward stored as
    ``ctx.fused``, once per forward (a retained graph's second backward takes the ordinary path)."""
    fused, ctx.fused = getattr(ctx, "fused", None), None
    return fused.claim() if fused is not None else None


def fused_grad_of(weight: torch.Tensor, needs_grad: bool) -> Optional[FusedGrad]:
    """In a fused kernel's forward (``needs_grad``: ``ctx.needs_input_grad`` of the weight): the
    weight's `FusedGrad`, recorded as one forward use, when the kernel may claim it (a leaf parameter
    the optimizer gave one); else None."""
    fused = getattr(weight, "fused_grad", None)
    if fused is None or not needs_grad or not weight.is_leaf or fused.param_ref() is not weight:
        return None  # (a copy of the parameter carries its original's attribute: not its buffer)
    return fused.forward_use()


def finish_fused(dest: torch.Tensor) -> None:
    """After the kernel wrote a claimed destination: ``0 + g``'s bits (``-0.0`` → ``+0.0``)."""
    dest.add_(0.0)
