"""Compiled ResQ: ``Q(x) + Q(x − Q(x))`` (NVFP4, 1D blocks, nearest rounding) as one compiled call.

``portable_resq_quantize`` (``resq.py``) runs two fake quantizations, a subtraction and an addition:
about thirty small eager ops, or four compiled calls through ``fused.py``'s fake-quant kernels. At
the sizes of a decode step (a few tokens × hidden) the cost is the per-call overhead, not the
arithmetic: a compiled call costs ~45 µs of guards and wrapper whatever its size, the eager ResQ
~140 µs, the four compiled calls ~200 µs. Here the whole ResQ is one traced body (one compiled call,
~40 µs at 16 × 128), made of ``fused.py``'s own bodies (``_nvfp4_scales``, ``_apply2``) in the
eager path's order: ``xf = x.float()``, ``q = Q(xf)``, ``r = xf − q``, ``q + Q(r)``.

A variant is a ``fused._Variant`` (key ``("resq_nvfp4", scale, "1d", dtype, float32)``), so it is
compiled, checked bitwise against the uncompiled body on the hard probe inputs, warmed up in a
child process under ``auto`` and adopted at ``fused.adopt_ready`` exactly like the fake-quant
variants (read ``fused.py``). :func:`prepare` builds one now (a server at load, ``vllm/quant.py``).
The all-finite flags of ``x`` and of the residual come back separately: when both hold the
compiled output is returned (recorded under the eager names when checks are deferred); when one
does not, the caller runs the eager path, which raises (or records) with its own message and
writes its own NaN bits (the compiled kernel's NaN payloads can differ).
"""
from __future__ import annotations

import logging
import warnings

import torch

from megatron_fp4.fp4 import fused

KIND = "resq_nvfp4"


def _resq_nvfp4(xb: torch.Tensor, scale: str):
    """``Q(xf) + Q(xf − Q(xf))`` in fp32 of a (rows, blocks, 16) ``xb``, and the two finite flags."""
    xf = xb.to(torch.float32)
    enc, s1, s2, finite_x = fused._nvfp4_scales(xf, scale, False)
    q = fused._apply2(xf, enc, s1, s2, torch.float32)
    r = xf - q
    enc, s1, s2, finite_r = fused._nvfp4_scales(r, scale, False)
    return q + fused._apply2(r, enc, s1, s2, torch.float32), torch.stack([finite_x, finite_r])


def _unused(*args):  # the second body of a fused._Variant: never called here, so never compiled
    raise AssertionError("fused_resq: a ResQ variant has one body")


class ResqVariant(fused._Variant):
    """A ``fused._Variant`` whose one compiled body is the whole ResQ."""

    def run(self, fns, xb):
        return fns[0](xb, *self.scales_args)

    def build(self, samples, loud: bool) -> None:
        """``fused._Variant.build`` with single-threaded kernels (``cpp.threads=1``): its inputs are a
        decode step's few rows, where an OpenMP region's fork and barrier cost more than the work,
        and on a loaded machine a barrier waits for a descheduled thread (at 16 × 128 with 2
        threads: median 3.7 ms a call against 86 µs single-threaded). Maxima and elementwise ops:
        the same bits in any partition, and the check below still compares them."""
        import torch._inductor.config as inductor_config

        with inductor_config.patch({"cpp.threads": 1}):
            super().build(samples, loud)


def make_variant(key) -> ResqVariant:
    """A new variant of ``key`` (``key_of``): the factory ``fused.CompiledKernels.variant_of`` is given."""
    return ResqVariant(key, _resq_nvfp4, _unused, (key[1],), key[-1])


def variant_of(key, kernels: fused.CompiledKernels | None = None) -> ResqVariant:
    """The (one) ResQ variant of ``key`` in ``kernels`` (None: ``fused.PROCESS``)."""
    return fused.variant_of(key, kernels, make_variant)


def key_of(scale: str, dtype: torch.dtype) -> tuple:
    return (KIND, scale, "1d", dtype, torch.float32)


def resq_nvfp4_fused(x: torch.Tensor, scale: str, name: str, nonfinite=None, mode: str | None = None,
                     kernels: fused.CompiledKernels | None = None):
    """Compiled ``portable_resq_quantize(x, nvfp4 1d nearest scale)`` (fp32) from ``kernels`` (None:
    ``fused.PROCESS``), or None: not compiled (yet) for this input, or a non-finite input or
    residual (the eager path then reports it)."""
    n = x.shape[-1] if x.dim() else 0
    if n == 0 or n % 16 or x.numel() == 0 or scale not in ("row", "tensor"):
        return None  # the eager path validates (and raises)
    res = variant_of(key_of(scale, x.dtype), kernels)(x, (-1, n // 16, 16), fused.resolve_compile(mode))
    if res is None:
        return None
    out, flags = res
    if not bool(flags.all()):  # (a CPU tensor: no device sync) NaN bits differ from eager's: eager reports
        return None
    if nonfinite is not None:  # the eager path's records, under its names
        nonfinite.record(name, "quantize_nvfp4", flags[0])
        nonfinite.record(name + " residual", "quantize_nvfp4", flags[1])
    return out.view(x.shape)


def prepare(scale: str, dtype: torch.dtype, inference: bool = False, width: int = 64,
            kernels: fused.CompiledKernels | None = None) -> bool:
    """Compile and check the ResQ variant of (``scale``, ``dtype``) now, in this thread (seconds;
    a warm inductor cache makes it quick). Returns whether it serves (False: not bit-exact here,
    or no compiler: the eager path serves, quietly). Call it where no other thread runs torch ops.

    ``inference``: for callers in ``torch.inference_mode`` (vLLM's forward): the kernels are
    compiled for inference tensors, whose guards differ (another mode would need a recompile,
    which the caller's calls never do: they run eager)."""
    variant = variant_of(key_of(scale, dtype), kernels)
    if variant.state in ("new", "warming") and variant.store.broken is None:
        samples = fused._samples((4, max(2, width // 16), 16), dtype)
        with torch.inference_mode(inference):
            variant.build(samples, loud=False)
        if inference and variant.state == "ready":
            _unguarded(variant, samples)
    return variant.state == "ready"


def _unguarded(variant: ResqVariant, samples) -> None:
    """Serve ``variant`` (built and checked) through the same body exported (rows and blocks
    dynamic) and compiled by inductor once more without dynamo: a call then skips dynamo's guard
    evaluation and frame wrapper (~20 µs of a ~40 µs call at a decode step's 16 × 128). Used only
    if it gives the uncompiled body's bits on every sample, else the dynamo kernels stay, quietly.
    For `prepare`'s callers (a server at load), whose calls are all inference mode."""
    import torch._inductor.config as inductor_config
    from torch.export import Dim

    scale = variant.scales_args[0]

    class Body(torch.nn.Module):
        def forward(self, xb):
            return _resq_nvfp4(xb, scale)

    try:
        dims = ({0: Dim("rows", min=2), 1: Dim("blocks", min=2)},)
        # quietly: torch's deprecation notes from inside export, and inductor's note that it cannot
        # pickle this graph's cache key (it then compiles without its on-disk graph cache)
        log = logging.getLogger("torch._inductor.codecache")
        level = log.level
        with warnings.catch_warnings(), inductor_config.patch({"cpp.threads": 1, "compile_threads": 1}):
            warnings.simplefilter("ignore")
            log.setLevel(logging.ERROR)
            try:
                graph = torch.export.export(Body(), (samples[0],), dynamic_shapes=dims, strict=False).module()
                art = torch._inductor.standalone_compile(graph, [samples[0]], dynamic_shapes="from_graph")
            finally:
                log.setLevel(level)
        dtype = samples[0].dtype
        with torch.inference_mode():  # the load's samples and other sizes (vector tails of rows and blocks)
            for xb in samples + fused._samples((37, 8, 16), dtype) + fused._samples((3, 67, 16), dtype):
                got, want = art(xb), _resq_nvfp4(xb, scale)
                if not (fused._same_bits(got[0], want[0]) and torch.equal(got[1], want[1])):
                    return
    except Exception:  # no export/standalone compile here: the checked dynamo kernels serve
        return
    variant.fns = (lambda xb, *_: art(xb), variant.fns[1])


