"""Activation recomputation (``model.recompute``): trade backward compute for activation memory.

- ``full``: every block of ``model.recompute_num_layers`` consecutive decoder layers runs under
  ``torch.utils.checkpoint`` (non-reentrant): forward keeps only the block's input, backward re-runs
  the block to get what it reads.
- ``selective`` (in the spirit of torch's selective activation checkpointing): each module named in
  ``model.recompute_modules`` runs under a checkpoint whose policy (`save_gemm_outputs`) keeps the
  outputs of its GEMMs and recomputes the rest: the attention core (q/k-norm, RoPE, SDPA), the FP4
  operands (``Q(W)``, ``Q̃(X)`` and their residuals, which the MoEResQ halves save), activations and
  permutations. Names: ``attention`` (`Attention`), ``experts`` (`GroupedExperts`: local, no
  collective), ``mlp`` (dense MLPs and shared experts, `SwiGLU`), ``moe`` (the whole `MoELayer`:
  router, dispatch, experts; under expert parallelism its recompute repeats the all-to-all).

Why the recomputed bits equal the forward's (tests/unit/test_recompute.py checks equal gradients):

- the recompute runs the same ops on the same inputs under the forward's numerics: the state of the
  owners' ``fp4.Numerics`` (step position: stochastic-rounding seeds come from (layer, step,
  micro-batch, operand), and every quantization seeds a fresh generator from them, so it draws the
  forward's numbers; the per-step ``Q(W)`` cache; batch-invariant mode) is restored for it, and
  ``preserve_rng_state`` restores torch's global RNG (no layer draws from it today; dropout would).
  (The region flag below is a ContextVar, copied with the forward's context: it decides what is
  saved, never what an op computes);
- side effects happen once: the recompute gets ``routing_out=None`` (no second routing record) and
  the MoE layers' ``record_stats`` off; the aux-loss `AuxLossAutoScaler` of the original graph is the
  one that injects the gradient (a non-reentrant recompute only refills saved tensors);
- early stop is off, so every rank re-runs a region to its end: under expert parallelism each rank
  issues the same collectives in the same order.

Zero-bubble schedules run backward as an input-grad pass and a later weight-grad pass: each pass
recomputes the region once (twice in all); the selective policy's saved GEMM outputs serve both.
"""
from __future__ import annotations

import contextvars
import functools
from contextlib import ExitStack, contextmanager
from typing import Callable, Sequence

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from megatron_fp4.config.choices import RECOMPUTE_MODES as RECOMPUTE
from megatron_fp4.config.choices import RECOMPUTE_MODULES as MODULES

_aten = torch.ops.aten
# GEMMs whose outputs selective recompute keeps (the expensive part; everything else is re-run).
GEMM_OPS = frozenset(getattr(_aten, name).default for name in ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm")
                     if hasattr(_aten, name))

_IN_REGION = contextvars.ContextVar("megatron_fp4_recompute_region", default=False)


def save_gemm_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective policy: keep GEMM outputs, recompute every other op. Only a default overload's
    output is kept: a GEMM written through ``out=`` into a caller's buffer (the ``batch`` level's
    tiles, block attention's reused score buffers, which it then mutates in place) is re-run."""
    return CheckpointPolicy.MUST_SAVE if op in GEMM_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _Replayable:
    """torch's recompute mode marks each kept output consumed; a zero-bubble weight-grad pass
    recomputes a second time and needs them again, so each recompute restores the entries."""

    def __init__(self, mode):
        self.mode = mode

    def __enter__(self):
        self.kept = {key: dict(entries) for key, entries in self.mode.storage.items()}
        return self.mode.__enter__()

    def __exit__(self, *exc):
        try:
            return self.mode.__exit__(*exc)
        finally:
            for key, entries in self.kept.items():
                self.mode.storage[key].update(entries)
            self.kept = None


def _selective_contexts():
    forward_mode, recompute_mode = create_selective_checkpoint_contexts(save_gemm_outputs)
    return forward_mode, _Replayable(recompute_mode)


@contextmanager
def _stats_off(modules: Sequence[torch.nn.Module]):
    flags = ("record_stats", "count_load")  # MoE statistics and the expert-bias load counts
    saved = [(m, f, getattr(m, f)) for root in modules for m in root.modules() for f in flags if hasattr(m, f)]
    for m, f, _ in saved:
        setattr(m, f, False)
    try:
        yield
    finally:
        for m, f, on in saved:
            setattr(m, f, on)


def checkpointed(fn: Callable, args: tuple, owners: Sequence[torch.nn.Module], selective: bool = False,
                 outputs: tuple = ()):
    """``fn(*args)`` under a non-reentrant checkpoint. ``owners``: the modules ``fn`` runs (their MoE
    statistics stay off in the recompute); ``outputs``: indices of ``args`` that are side-effect
    outputs (``routing_out`` lists), passed as None in the recompute."""
    forward_context = contextvars.copy_context()
    found = {id(n): n for root in owners for m in root.modules() for n in (getattr(m, "numerics", None),)
             if n is not None}
    numerics = [(n, n.state()) for n in found.values()]  # the forward's numerics, restored for the recompute
    calls = [0]

    def inside(*a):  # nested wrapped modules run plain inside a region
        token = _IN_REGION.set(True)
        try:
            return fn(*a)
        finally:
            _IN_REGION.reset(token)

    def region(*a):
        calls[0] += 1
        if calls[0] == 1:
            return inside(*a)
        a = tuple(None if i in outputs else v for i, v in enumerate(a))
        with _stats_off(owners), ExitStack() as stack:
            for n, state in numerics:
                stack.enter_context(n.restored(state))
            return forward_context.run(inside, *a)

    return checkpoint(region, *args, use_reentrant=False, preserve_rng_state=True, early_stop=False,
                      **({"context_fn": _selective_contexts} if selective else {}))


def active(recompute: str, cache) -> bool:
    """Recompute only where backward will run: grad enabled, no KV cache (generation), not nested."""
    return recompute != "none" and cache is None and torch.is_grad_enabled() and not _IN_REGION.get()


def _checkpointed_forward(module: torch.nn.Module, outputs: tuple):
    original = module.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        # keyword calls and generation (a KV cache argument) run as they are
        if kwargs or not active("selective", None) or any(
                a is not None and not isinstance(a, (torch.Tensor, list)) for a in args):
            return original(*args, **kwargs)
        return checkpointed(original, args, (module,), selective=True, outputs=outputs)
    return forward


@contextmanager
def selective(layer: torch.nn.Module, names: Sequence[str], targets: dict):
    """Within the block, every module of `layer` whose kind is in `names` runs its forward under a
    selective checkpoint. `targets`: {name: (module class, indices of side-effect output arguments)}.

    Per call, not at build time: modules swapped in after the build (expert parallelism's local
    experts) are covered, and no wrapper outlives the call (a deep copy of the model, e.g. the
    rollout engine's, must not call back into the original's forward)."""
    kinds = [(cls, outputs) for name, (cls, outputs) in targets.items() if name in names]
    wrapped = []
    for m in layer.modules() if kinds else ():
        outputs = next((o for cls, o in kinds if type(m) is cls), None)
        if outputs is not None and "forward" not in m.__dict__:
            m.forward = _checkpointed_forward(m, outputs)
            wrapped.append(m)
    try:
        yield
    finally:
        for m in wrapped:
            del m.__dict__["forward"]


def run_blocks(layer_fn: Callable, layers: Sequence[int], h: torch.Tensor, per_block: int,
               modules: Callable[[int], torch.nn.Module], extra: tuple, routing_out):
    """Full recompute: ``layer_fn(i, h, *extra, routing_out)`` over `layers`, each block of
    `per_block` consecutive layers one checkpoint (the hidden state between blocks is all it keeps)."""
    layers = list(layers)
    for start in range(0, len(layers), per_block):
        block = layers[start:start + per_block]

        def run(h, routing_out, *extra, block=block):
            for i in block:
                h = layer_fn(i, h, *extra, routing_out)
            return h
        h = checkpointed(run, (h, routing_out, *extra), [modules(i) for i in block], outputs=(1,))
    return h


class _TrackStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the storage of every tensor an op creates (weakly: it keeps nothing alive)."""

    def __init__(self):
        super().__init__()
        self.made: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef

        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                self.made.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        return out


def held_activation_bytes(forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """(``forward()``, bytes of the tensors its ops created that are still alive when it returns):
    the activation memory a backward of its result starts from (saved tensors, checkpoint inputs,
    selective recompute's kept GEMM outputs, the output itself). Deterministic, any device."""
    import gc

    mode = _TrackStorages()
    with mode:
        out = forward()
    gc.collect()
    return out, sum(n for ref, n in mode.made.values() if not ref.expired())
