"""Numerics as a value: what the FP4 and batch-invariant ops of one model compute, as one object.

A :class:`Numerics` is built from the config by whoever owns a model (the Trainer, the rollout
engine; ``model.specs.numerics_from_config``) and handed to the model at build time: every module
that computes numerics holds the same object (``apply_numerics(model, numerics)``; a model builds
its own by default), and passes it to the ``fp4`` functions as an explicit argument. Nothing in
``fp4/`` reads a ContextVar, a process-global mode or an environment variable to decide what a
GEMM computes (environment overrides are applied while loading the config: ``config/schema.py``), so two
models in one process run their own numerics (``tests/unit/test_numerics_value.py``).

What it holds (the per-layer FP4 ``Recipe`` — format, mode, rounding, ``compile`` — is the
other build-time value, set on each FP4 module by the model's specs):

- ``invariance``: one of :data:`INVARIANCE_LEVELS` (``invariant.py``): ``standard`` (the fastest
  kernels), ``batch`` (fixed-shape kernel calls: a row's bits do not depend on its batch; the
  default of the config) or ``exact`` (FP4 GEMMs summed exactly: bits independent of the layout too).
  Fixed when the object is built (setting it again raises): a model computes at one level, its
  training forward, scoring and decode alike; a caller that wants another level builds a model
  (a copy) with other numerics, as the rollout engine does for its own copy.
- ``triton``: ``auto`` | ``off`` | ``interpret``, where the Triton kernels serve: the FP4 quantizers
  (``triton_fp4.py``) and the ``batch`` level's GEMMs and attention (``triton_batch.py``). Fixed
  when the object is built, as the level.
- ``weight_cache``: a dict where derived weight operands (``Q(W)``, exact-GEMM splits, limbs) are
  reused (``exact_gemm.cached_for_weight``), or None. A ``rollout``-mode model also keeps the
  ``batch`` level's oneDNN packed weights there (:meth:`Numerics.weight_packs`).
- ``kernels``: the compiled fake-quant/ResQ backend this model's FP4 ops use where ``compile`` lets
  them (a ``fused.CompiledKernels``, given when the numerics are built — ``Numerics(kernels=...)``,
  ``rollout_numerics`` keeps the base's — and adopted between steps by its owner: the Trainer), or
  None: the process's (``fused.PROCESS``). The quantizers take it as an argument (``nvfp4.py`` and
  ``mxfp4.py`` import the compiled path; nothing installs itself into them). Kernels are checked
  bit-exact against the eager path before they serve; owning them keeps one job's compiles and
  refusals out of another's.
- ``position``: the step state (:class:`~megatron_fp4.fp4.context.QuantStep`: optimizer step,
  micro-batch, deferred non-finite flags) that keys stochastic-rounding streams; the owner
  advances it explicitly:

      with numerics.training_step(step, first_micro_batch=first) as fp4_step:
          for i, mb in enumerate(micro_batches):
              with numerics.micro_batch(i):
                  loss = model(mb); loss.backward()
      err = fp4_step.nonfinite_error()

The step position and the weight cache are changed by ``with`` blocks on the object (restored on
exit; neither changes a GEMM's bits): per object, not per thread. The level and ``triton`` (which
kernels run: on CUDA the Triton and the ``tiled.py`` kernels give other bits) are fixed when the
object is built. An FP4 Function captures the position in forward (its backward may run later, on
another thread). :data:`STANDARD` (the standard kernels, step 0, no cache) is what a bare function
call without ``numerics`` gets; it cannot be changed.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Iterator, Optional

import torch

from megatron_fp4.config.choices import INVARIANCE_LEVELS, TRITON_MODES  # torch-free constants, one definition each
from megatron_fp4.fp4.context import QuantStep
from megatron_fp4.fp4.nonfinite import NonFiniteFlags


class Numerics:
    """The numerics of one model (see the module docstring)."""

    STATE = ("weight_cache", "position")  # what a block may change (never the level or the kernels)
    FIXED = ("invariance", "triton")  # set once, when the numerics are built

    def __init__(self, *, invariance: str = "standard", triton: str = "auto", mode: str = "train", kernels=None):
        _check_level(invariance)
        if triton not in TRITON_MODES:
            raise ValueError(f"Numerics: triton={triton!r} is not one of {TRITON_MODES}")
        if mode not in ("train", "rollout"):
            raise ValueError(f"Numerics: mode={mode!r} is not 'train' or 'rollout'")
        self.mode = mode
        self.invariance = invariance
        self.triton = triton
        self.weight_cache: Optional[dict] = None
        self.kernels = kernels  # a fused.CompiledKernels, or None: the process's
        self.position = QuantStep()
        self._frozen = False

    def __setattr__(self, name, value):
        if name in self.FIXED and name in self.__dict__:
            raise ValueError(f"Numerics.{name} is fixed when the numerics are built (it is {getattr(self, name)!r}): "
                             "build the model with the level and kernels it computes with (model.specs.numerics_from_config, "
                             f"or fp4.apply_numerics(model, Numerics({name}=...)))")
        if getattr(self, "_frozen", False):
            raise ValueError(f"the STANDARD numerics cannot be changed (Numerics.{name}): give the model its own "
                             "(fp4.apply_numerics(model, Numerics(...)))")
        super().__setattr__(name, value)

    def __reduce_ex__(self, protocol):
        if self._frozen:
            return "STANDARD"  # copies and pickles of the STANDARD numerics are the one STANDARD
        return super().__reduce_ex__(protocol)

    def __repr__(self) -> str:
        return (f"Numerics(mode={self.mode!r}, invariance={self.invariance!r}, triton={self.triton!r}, "
                f"step={self.position.step}, micro_batch={self.position.micro_batch})")

    def invariant_for(self, x: Optional[torch.Tensor] = None) -> bool:
        """Whether a row-invariant level (``batch`` or ``exact``) applies (to ``x``'s dtype: never
        to float64, the verification mode, whose standard kernels agree to ~1e-16 anyway)."""
        return self.invariance != "standard" and (x is None or x.dtype != torch.float64)

    def exact_for(self, x: Optional[torch.Tensor] = None) -> bool:
        """Whether the ``exact`` level applies (exact GEMM sums) to ``x``'s dtype."""
        return self.invariance == "exact" and self.invariant_for(x)

    def tiled_for(self, x: Optional[torch.Tensor] = None) -> bool:
        """Whether the ``batch`` level applies (fixed-shape kernel calls) to ``x``'s dtype."""
        return self.invariance == "batch" and self.invariant_for(x)

    def _set(self, value=None, **changes):
        if self._frozen:
            raise ValueError("the STANDARD numerics cannot be changed: give the model its own "
                             "(fp4.apply_numerics(model, Numerics(...)))")
        return self._changed(value, changes)

    @contextmanager
    def _changed(self, value, changes: dict) -> Iterator:
        before = {k: getattr(self, k) for k in changes}
        for k, v in changes.items():
            setattr(self, k, v)
        try:
            yield value
        finally:
            for k, v in before.items():
                setattr(self, k, v)

    def training_step(self, step: int, first_micro_batch: int = 0, defer_nonfinite: Optional[bool] = None):
        """One optimizer step (``step`` as the trainer counts it). ``first_micro_batch``: global
        index of this rank's first micro-batch; ``defer_nonfinite``: True/False forces deferred /
        eager non-finite checks, None defers on non-CPU devices. Yields the step's ``QuantStep``."""
        for name, value in (("step", step), ("first_micro_batch", first_micro_batch)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"training_step: {name}={value!r} must be a non-negative int")
        position = QuantStep(step, first_micro_batch, first_micro_batch, NonFiniteFlags(), defer_nonfinite)
        return self._set(position, position=position)

    def micro_batch(self, local_index: int):
        """This rank's ``local_index``-th micro-batch of the current step."""
        if not isinstance(local_index, int) or local_index < 0:
            raise ValueError(f"micro_batch: local_index={local_index!r} must be a non-negative int")
        now = self.position
        return self._set(position=replace(now, micro_batch=now.first_micro_batch + local_index))

    def weight_packs(self) -> Optional[dict]:
        """Where the ``batch`` level's GEMMs keep a weight's oneDNN packed copy (``tiled._onednn_weight``),
        its row-streaming kernel's packed copy where the plan has ``RowPlan.stream`` (one copy either
        way: oneDNN's taller calls then read the dense weight), or, on ``mm``, its contiguous
        transposed copy (``RowPlan.transposed_copy``):
        the weight cache of a ``rollout``-mode model (an engine's or the vLLM plugin's: weights constant
        from one version to the next, decode steps of a few rows, which read a packed weight ~2.4× faster),
        None for a trainer's (its weights change every step; a copy of each would cost their memory, and
        its calls' many rows gain ~5 %). The bits are the same either way (``row_calls.row_plan``)."""
        return self.weight_cache if self.mode == "rollout" else None

    def cached_weights(self, store: Optional[dict] = None):
        """Reuse what GEMMs derive from a weight alone inside the block (``exact_gemm.cached_for_weight``);
        ``store``: a dict the caller keeps across blocks (default: dropped at the end)."""
        return self._set(weight_cache={} if store is None else store)

    def state(self) -> dict:
        """What the numerics are now (:attr:`STATE`), for :meth:`restored`."""
        return {k: getattr(self, k) for k in self.STATE}

    def restored(self, state: dict):
        """The block under an earlier :meth:`state` (activation recompute re-runs a forward in its
        numerics: the same step position, mode and cache)."""
        return nullcontext() if self._frozen else self._set(**state)


class WeightStore(dict):
    """A store of weight-derived operands (``Numerics.weight_cache``: ``Q(W)``, exact-GEMM splits,
    oneDNN packs) that weak references may point at: the packs' clean-up callbacks
    (``tiled._kept``) then hold the store weakly, so a store dropped without ``clear()`` (an engine
    or plugin that goes away) is freed at once instead of living on in a reference cycle until
    the cyclic GC. Otherwise a dict."""

    __slots__ = ("__weakref__",)


def _check_level(level) -> None:
    if not isinstance(level, str) or level not in INVARIANCE_LEVELS:
        raise ValueError(f"Numerics: invariance={level!r} is not one of {INVARIANCE_LEVELS} "
                         "(the old boolean batch_invariant: true is 'exact' or the faster 'batch')")


STANDARD = Numerics()
object.__setattr__(STANDARD, "_frozen", True)


def apply_numerics(model: torch.nn.Module, numerics: Numerics) -> Numerics:
    """Give every module of ``model`` that computes numerics (a ``numerics`` attribute) ``numerics``."""
    if not isinstance(numerics, Numerics):
        raise ValueError(f"apply_numerics: expected a Numerics, got {type(numerics).__name__}")
    for m in model.modules():
        if hasattr(m, "numerics"):
            m.numerics = numerics
    return numerics


def numerics_of(model) -> Numerics:
    """The numerics ``model`` computes with; for a module without its own (not built by this
    package) a fresh ``Numerics()``: the standard ops, which a caller may switch for its own ops
    around the module (the scoring log-softmax)."""
    found = getattr(model, "numerics", None)
    return found if isinstance(found, Numerics) and found is not STANDARD else Numerics()


def rollout_numerics(base: Numerics, invariance: str) -> Numerics:
    """New rollout-side numerics at ``invariance`` for a model that had ``base`` (its backend and
    compiled kernels kept): what an inference engine gives the model copy it owns, once, at build."""
    if not isinstance(base, Numerics):
        raise ValueError(f"rollout_numerics: expected a Numerics, got {type(base).__name__}")
    return Numerics(invariance=invariance, triton=base.triton, mode="rollout", kernels=base.kernels)
