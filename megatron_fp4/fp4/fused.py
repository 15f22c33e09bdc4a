"""Compiled fake-quantization: the NVFP4/MXFP4 quantize-dequantize as two ``torch.compile``d kernels.

The eager path (``nvfp4.py``, ``mxfp4.py``) is the reference: a dozen elementwise passes over the
tensor. Here the same arithmetic, written once more as traced functions, is compiled by inductor
into two kernels: one reads the input and writes the per-block factors (block amaxes, row/tensor
amax, E4M3 or E8M0 scales, all vectorized across blocks), the other reads the input again and
writes the output. One kernel for both (the earlier layout) computed the block scales per block in
scalar code inside the element loop and was ~1.3x slower.

When it runs (``fake_quantize_nvfp4`` / ``fake_quantize_mxfp4``, nearest rounding, CPU tensors,
autograd not recording through the input; stochastic rounding and ``quantize_*`` stay eager) is
the ``compile`` setting: the FP4 recipe's ``compile`` field (config ``fp4.compile``, which
``MEGATRON_FP4_COMPILE`` overrides while the config loads), passed by the caller:

- ``auto`` (default): eager at first; once a variant (format, options, dtypes) has quantized
  :data:`AUTO_MIN_ELEMENTS` elements, a child process (``compile_worker.py``) compiles and checks it,
  filling inductor's on-disk cache, while the eager path keeps serving calls. The switch happens
  only at :func:`adopt_ready`, which the trainer calls between steps: the caller's thread compiles
  there from the warm cache (seconds, not the cold compile) and checks the kernels again. Short jobs
  and test suites never pause for (or pay) a compile, and a process exits without waiting for a
  warm-up it will not use (the child is killed; it also exits when its parent dies).
- ``on``: compile on the first call of each variant, in the caller (seconds).
- ``off``: always eager.

Whose kernels: a :class:`CompiledKernels` holds the variants, the ``auto`` warm-ups and a backend
failure of one owner. The Trainer gives its model's ``Numerics`` its own (``Numerics.kernels``) and
adopts it between its steps, so two jobs (or tests) in one process never share compiled state;
calls through ``resq.py`` that name none use :data:`PROCESS` (benchmarks, the vLLM plugin). The
store is the backend the reference quantizers are handed (their ``kernels`` argument: ``nvfp4.py``
and ``mxfp4.py`` never import this module, and nothing here installs itself into them); a bare
``fake_quantize_nvfp4`` / ``fake_quantize_mxfp4`` call without one is the eager reference.

Every variant is checked before use: the compiled kernels and the uncompiled bodies run on hard
probe inputs (E2M1 ties, saturation, subnormal values and scales) and on a random tensor (and, with
``on``, on the caller's first input) and must give the same bits; the C++ inductor generates
depends on the machine's vector unit (``ATEN_CPU_CAPABILITY``), and a kernel that is not bit-exact
there is not used (warning, eager from then on). If compilation fails (no C++ compiler, inductor
cannot build for ``ATEN_CPU_CAPABILITY=default``), ``on`` warns once and ``auto`` stays eager
quietly. A call that would recompile in the caller's thread (a size-1 dim, another global torch
state) runs eager instead (``fail_on_recompile`` stance): in ``auto`` the caller compiles only in
:func:`adopt_ready` (a caller that never calls it stays eager). Which step the switch lands on
depends on the machine's speed; the losses do not, as the kernels give the eager path's bits.

Why not a background thread (the earlier design): dynamo's compile changes process-global state for
its whole duration, whichever thread runs it: ``torch.compiler.is_compiling()`` is a module global
(``torch.optim``'s AdamW then computes its bias corrections as fp32 tensors, not Python floats:
other bits), the global RNG state is saved and restored around the trace (rewinding another
thread's draws), and ``set_stance`` is global too. A job's bits then depended on when the compile
ran. In-process compiles therefore run only on the caller's thread, at points the caller chooses.

Bit-exactness notes (each pinned by ``tests/unit/test_fp4_fused.py`` against the eager path):

- Divisions by constants are written with a tensor operand: inductor turns ``c / t`` into
  ``c * (1 / t)`` and ``t / c`` into ``t * (1 / c)``, each a second rounding.
- The E2M1 grid step is chosen by compares (``round_e2m1_select``): inductor lowers a float↔int32
  bit view to a scalar loop, compares vectorize.
- A NaN/Inf input is served by the eager path (``finite_only``): inductor's vector code may write
  NaNs with another sign or payload than ATen's, so the kernels are checked and used on finite inputs.
- The compiled C++ keeps IEEE semantics that matter here (``-ffp-contract=off``, no unsafe math);
  reductions are maxima, exact in any order.

Compilation uses ``dynamic=True`` (sample sizes ≥ 2 in every dim) so the varying token counts of
MoE experts reuse one kernel.
"""
from __future__ import annotations

import atexit
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import types
import warnings
import weakref

import torch

from megatron_fp4.config.choices import COMPILE_MODES
# In ``auto``, a variant is compiled once it has quantized this many elements eagerly (~100 calls of a
# 4096x1024 activation): by then the job has shown it is long enough to repay a compile of seconds.
AUTO_MIN_ELEMENTS = 1 << 28

# Exit codes of compile_worker.py besides 0 (ready): not bit-exact on this CPU, backend failure.
WORKER_NOT_EXACT, WORKER_BROKEN = 3, 4


def resolve_compile(mode: str | None) -> str:
    """The setting ``mode`` checked (None → ``auto``)."""
    mode = "auto" if mode is None else mode
    if mode not in COMPILE_MODES:
        raise ValueError(f"FP4 compile={mode!r} is not one of {COMPILE_MODES}")
    return mode


def use_fused(x: torch.Tensor, rounding: str, mode: str | None = None, kernels=None) -> bool:
    """Whether ``x`` may take the compiled path of ``kernels`` (a :class:`CompiledKernels`; None: the
    process's, :data:`PROCESS`) at all (the variant decides if it is ready)."""
    return (x.device.type == "cpu" and rounding == "nearest" and (kernels or PROCESS).broken is None
            and not (torch.is_grad_enabled() and x.requires_grad) and not torch.compiler.is_compiling()
            and resolve_compile(mode) != "off")


# -- the traced bodies (run uncompiled they are the reference the compiled kernels must match) --------
def _nvfp4_scales(xb: torch.Tensor, scale: str, two_d: bool):
    from megatron_fp4.fp4.nvfp4 import nvfp4_scales

    block_amax = xb.to(torch.float32).abs().amax(dim=(1, 3) if two_d else (-1,), keepdim=True)
    amax, _, s_blk32, s_dec, enc_blk = nvfp4_scales(block_amax, scale)
    return enc_blk, s_blk32, s_dec, torch.isfinite(amax).all()


def _mxfp4_scales(xb: torch.Tensor, scale_mode: str):
    from megatron_fp4.fp4.formats import pow2_fp32
    from megatron_fp4.fp4.mxfp4 import shared_exponent

    block_amax = xb.to(torch.float32).abs().amax(dim=-1, keepdim=True)
    e = shared_exponent(block_amax, scale_mode)
    return pow2_fp32(-e), pow2_fp32(e), torch.isfinite(block_amax.amax())


def round_e2m1_mul(y: torch.Tensor) -> torch.Tensor:
    """``round_e2m1_select`` (the same bits) with ``y / step`` written as ``y · (1 / step)``.

    The step is a power of two (0.5, 1, 2), so its reciprocal is exact and ``y · (1 / step)`` is
    the exact quotient (``|y| ≤ 6``: no overflow; subnormal ``y`` only meets the factor 2). A vector
    multiply instead of a vector divide: the divide was the slowest instruction of the kernel.
    """
    a = y.abs()
    small, mid = a < 2.0, a < 4.0
    inv = torch.where(small, 2.0, torch.where(mid, 1.0, 0.5))
    step = torch.where(small, 0.5, torch.where(mid, 1.0, 2.0))
    return torch.round(y * inv) * step


def _apply2(xb, enc, s1, s2, out_dtype):
    """NVFP4: ``round(clamp(x · enc)) · s_blk · S_dec``, left to right."""
    y = (xb.to(torch.float32) * enc).clamp(-6.0, 6.0)
    return (round_e2m1_mul(y) * s1 * s2).to(out_dtype)


def _apply1(xb, enc, s1, out_dtype):
    """MXFP4: ``round(clamp(x · 2^-e)) · 2^e``."""
    y = (xb.to(torch.float32) * enc).clamp(-6.0, 6.0)
    return (round_e2m1_mul(y) * s1).to(out_dtype)


def _compiled_copy(body, tag: str):
    # One code object per variant: dynamo keeps its cache of compiled graphs on the code object, and
    # all variants in one cache would pass its recompile limit.
    code = body.__code__.replace(co_name=f"{body.__name__}_{tag}", co_qualname=f"{body.__name__}_{tag}")
    fresh = types.FunctionType(code, body.__globals__, code.co_name, body.__defaults__, body.__closure__)
    return torch.compile(fresh, dynamic=True)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _probe_like(blocks, dtype) -> torch.Tensor:
    """Hard inputs in the block layout ``blocks`` (every dim ≥ 2): E2M1 ties and grid points,
    saturation, and the same block at scales from 2^-133 to 2^17 (subnormal fp32 values, subnormal /
    zero E4M3 scales)."""
    base = torch.tensor([0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -2.5, -5.0, -6.0, 0.1, 7.0])
    rows = torch.stack([base * 2.0 ** k for k in range(-133, 20, 3)])  # [51, 16]
    if len(blocks) == 3:  # (rows, blocks, block): one probe row per row, repeated over its blocks
        probe = rows.repeat(1, blocks[2] // 16)[:, None, :].expand(-1, max(2, blocks[1]), -1)
    else:  # (16-row tiles, 16, 16-col tiles, 16): the rows stacked into 16×16 tiles
        probe = rows[:48].reshape(3, 16, 1, 16).expand(-1, -1, max(2, blocks[2]), -1)
    return probe.to(dtype).contiguous()


def _random_like(blocks, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    shape = [4] + [max(2, s) for s in blocks[1:]]
    return (torch.randn(shape, generator=g) * torch.logspace(-20, 20, shape[-1])).to(dtype)


def _warn(reason: str) -> None:
    warnings.warn(f"megatron_fp4: compiled FP4 fake-quant disabled, using the eager path ({reason})",
                  RuntimeWarning, stacklevel=5)


class _Variant:
    """One (format, options, dtypes): its compiled kernels, state and the eager work seen so far."""

    def __init__(self, key, scales_body, apply_body, scales_args, out_dtype):
        self.key, self.scales_body, self.apply_body = key, scales_body, apply_body
        self.scales_args, self.out_dtype = scales_args, out_dtype
        self.state = "new"  # new | warming (auto: a child compiles) | ready | refused
        self.blocks = None
        self.seen = 0
        self.fns = None
        self.store = None  # the CompiledKernels holding it (variant_of sets it)

    def run(self, fns, xb):
        scales, apply = fns
        *factors, finite = scales(xb, *self.scales_args)
        return apply(xb, *factors, self.out_dtype), finite

    def build(self, samples, loud: bool) -> None:
        """Compile, check against the uncompiled bodies on ``samples``, then publish (or refuse)."""
        tag = "_".join(str(k).replace("torch.", "") for k in self.key)
        try:
            import torch._inductor.config as inductor_config

            # compile_threads=1: no pool of compile processes, which would hold the interpreter's
            # exit for seconds (the pool's shutdown); a few small kernels compile fine in-process.
            with torch.no_grad(), inductor_config.patch(compile_threads=1):
                fns = (_compiled_copy(self.scales_body, tag), _compiled_copy(self.apply_body, tag))
                for xb in samples:
                    _mark_static_elements(xb)
                    got, want = self.run(fns, xb), self.run((self.scales_body, self.apply_body), xb)
                    if not (_same_bits(got[0], want[0]) and torch.equal(got[1], want[1])):
                        self.state = "refused"
                        if loud:
                            _warn(f"the compiled {self.key[0]} kernel is not bit-exact on this CPU's kernel set "
                                  f"({torch.backends.cpu.get_cpu_capability()})")
                        return
        except Exception as err:  # a backend failure, never an input error: inputs are validated first
            self.state = "refused"
            self.store.broken = f"{type(err).__name__}: {err}"
            if loud:
                _warn(self.store.broken)
            return
        self.fns, self.state = fns, "ready"

    def __call__(self, x, shape, mode: str):
        """(output, finite flag) of the compiled kernels on ``x`` viewed as ``shape``, or None."""
        blocks = (x.numel() // math.prod(shape[1:]), *shape[1:])
        if self.state in ("new", "warming") and mode == "auto":  # count only: no dynamo import here
            self.seen += x.numel()
            if self.state == "new" and self.seen >= AUTO_MIN_ELEMENTS:
                self.start_warmup(blocks)
            return None
        if self.state in ("new", "warming") and mode == "on":  # compile here, in the caller (seconds)
            # The caller's input joins the check unless a size-1 dim would specialize the kernel, or it
            # holds a NaN/Inf (served eager: ``finite_only``), whose NaN bits would refuse a good kernel.
            own = [_blocked(x, shape)] if min(blocks) >= 2 and bool(torch.isfinite(x).all()) else []
            self.build(_samples(blocks, x.dtype) + own, loud=True)
        if self.state != "ready" or min(blocks) < 2:
            return None
        xb = _blocked(x, shape)
        try:
            with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
                return self.run(self.fns, xb)
        except RuntimeError as err:
            if "fail_on_recompile" in str(err):  # another size class / global state: eager, no pause
                return None
            raise

    def start_warmup(self, blocks) -> None:
        """auto, past the threshold: compile and check in a child process, off this process's state."""
        self.state, self.blocks = "warming", blocks
        spec = json.dumps({"key": [_dtype_name(k) for k in self.key], "blocks": list(blocks), "parent": os.getpid()})
        log = tempfile.TemporaryFile()
        try:
            proc = subprocess.Popen(_worker_command(spec), stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        except OSError:  # cannot start a process here: this variant stays eager, quietly
            log.close()
            self.state = "refused"
            return
        self.store.owner_pid = os.getpid()
        self.store.warmups.append((self, proc, log))

    def finish_warmup(self, rc: int, log) -> None:
        """The child is done: on success compile here from the warm cache (checked again), else refuse."""
        if rc == 0:
            self.build(_samples(self.blocks, self.key[-2]), loud=False)
            return
        self.state = "refused"  # not bit-exact here, or the child died (killed, out of memory)
        if rc == WORKER_BROKEN:  # the backend cannot compile: nothing compiles in this process either
            log.seek(0)
            lines = log.read()[-2000:].decode(errors="replace").strip().splitlines()
            self.store.broken = lines[-1] if lines else "the compile worker failed"


def _dtype_name(k):
    return str(k).replace("torch.", "") if isinstance(k, torch.dtype) else k


def _samples(blocks, dtype) -> list:
    """The check inputs of a variant (the same in the worker and here: the same graphs, cache hits)."""
    return [_probe_like(blocks, dtype), _random_like(blocks, dtype)]  # never the caller's tensor


def _worker_command(spec: str) -> list:
    """The warm-up child: this interpreter, this copy of the package (its root put on the path
    when the child would not find it), ``compile_worker.py`` on ``spec``."""
    boot = ("import runpy, sys\nif sys.argv[1] not in sys.path: sys.path.insert(0, sys.argv[1])\n"
            "runpy.run_module('megatron_fp4.fp4.compile_worker', run_name='__main__')")
    return [sys.executable, "-c", boot, _PACKAGE_ROOT, spec]


_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
class CompiledKernels:
    """The compiled kernels of one owner: its variants (each checked bit-exact against the eager
    path before it serves), its ``auto`` warm-ups not adopted yet, and a backend failure it met.

    Whoever builds a model owns one (the Trainer: ``Numerics.kernels``) and adopts its warm-ups at
    its own quiet points, so one job's (or test's) compiles and refusals never change what another
    runs. Calls without one use :data:`PROCESS`. What it holds is what this process learnt about its
    compiler, never a numerics choice: a copy (deepcopy, pickle) starts empty."""

    def __init__(self):
        self.variants: dict = {}
        self.warmups: list = []  # (variant, child process, its output file): auto warm-ups not adopted yet
        self.broken = None  # a backend failure (no compiler, ...): no variant of this store compiles any more
        self.owner_pid = None  # the process that started the warm-ups (a forked copy must not touch them)
        self._lock = threading.Lock()
        _STORES.add(self)

    def __reduce__(self):
        return CompiledKernels, ()

    def __deepcopy__(self, memo):
        return CompiledKernels()

    # The backend interface the reference quantizers call (``nvfp4.py``/``mxfp4.py`` take the store as
    # their ``kernels`` argument; they never import this module).
    def use_fused(self, x: torch.Tensor, rounding: str, mode: str | None = None) -> bool:
        return use_fused(x, rounding, mode, self)

    def fake_quantize_nvfp4(self, x, scale: str, block: str, out_dtype, mode: str | None = None):
        return fake_quantize_nvfp4_fused(x, scale, block, out_dtype, mode, self)

    def fake_quantize_mxfp4(self, x, scale_mode: str, out_dtype, mode: str | None = None):
        return fake_quantize_mxfp4_fused(x, scale_mode, out_dtype, mode, self)

    def variant_of(self, key, make=None) -> _Variant:
        """The (one) variant of ``key``: ("nvfp4", scale, block, dtype, out_dtype), ("mxfp4", scale_mode,
        dtype, out_dtype), or another kind's built by ``make(key)`` (``fused_resq.make_variant``: that
        module builds on this one, so it names its own factory)."""
        v = self.variants.get(key)
        if v is None:
            if make is not None:
                made = make(key)
            elif key[0] == "nvfp4":
                made = _Variant(key, _nvfp4_scales, _apply2, (key[1], key[2] == "2d"), key[-1])
            elif key[0] != "mxfp4":
                raise ValueError(f"compiled kernels: no factory for the kind {key[0]!r}; pass make= "
                                 "(the ResQ kind: fused_resq.variant_of)")
            else:
                made = _Variant(key, _mxfp4_scales, _apply1, (key[1],), key[-1])
            made.store = self
            with self._lock:
                v = self.variants.setdefault(key, made)
        return v

    def adopt_ready(self) -> None:
        """Switch every variant whose warm-up child has finished to its compiled kernels (or refuse it).

        Call it at a quiet point (the trainer: between steps) on the thread that runs the FP4 layers,
        with no other thread running torch ops: the compile here changes process-global torch state
        while it runs. A warm-up still running is left alone; nothing waits."""
        for entry in (list(self.warmups) if self.owner_pid == os.getpid() else []):
            variant, proc, log = entry
            rc = proc.poll()
            if rc is None:
                continue
            self.warmups.remove(entry)
            try:
                if variant.state == "warming":
                    variant.finish_warmup(rc, log)
            finally:
                log.close()

    def wait_compiled(self, timeout: float | None = None) -> None:
        """Wait (up to ``timeout`` s each) for the warm-ups started so far, then adopt them (benchmarks, tests)."""
        for _, proc, _ in list(self.warmups):
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.adopt_ready()

    def compiled_ready(self, fmt: str) -> bool:
        """Whether some variant of ``fmt`` ("nvfp4" / "mxfp4" / "resq_nvfp4") has compiled kernels in use."""
        return any(v.state == "ready" for k, v in list(self.variants.items()) if k[0] == fmt)

    def stop_warmups(self) -> None:
        """Kill the warm-ups still running (at exit: never wait for a compile this process will not use)."""
        for _, proc, log in (list(self.warmups) if self.owner_pid == os.getpid() else []):
            if proc.poll() is None:
                proc.kill()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
            log.close()
        self.warmups.clear()


_STORES: "weakref.WeakSet[CompiledKernels]" = weakref.WeakSet()
PROCESS = CompiledKernels()  # the kernels of calls that name none (bare calls, benchmarks, the vLLM plugin)


def variant_of(key, kernels: CompiledKernels | None = None, make=None) -> _Variant:
    """``kernels.variant_of(key, make)`` (None: :data:`PROCESS`)."""
    return (kernels or PROCESS).variant_of(key, make)


def adopt_ready(kernels: CompiledKernels | None = None) -> None:
    """``kernels.adopt_ready()`` (None: :data:`PROCESS`)."""
    (kernels or PROCESS).adopt_ready()


def wait_compiled(timeout: float | None = None, kernels: CompiledKernels | None = None) -> None:
    """``kernels.wait_compiled(timeout)`` (None: :data:`PROCESS`)."""
    (kernels or PROCESS).wait_compiled(timeout)


def compiled_ready(fmt: str, kernels: CompiledKernels | None = None) -> bool:
    """``kernels.compiled_ready(fmt)`` (None: :data:`PROCESS`)."""
    return (kernels or PROCESS).compiled_ready(fmt)


@atexit.register
def _stop_warmups() -> None:
    for store in list(_STORES):
        store.stop_warmups()


def _blocked(x: torch.Tensor, shape) -> torch.Tensor:
    """Contiguous block-layout alias (or copy) of ``x`` for the compiled function, guarded lightly:

    - not a view (``detach``): dynamo guards a view input on its base's sizes and strides;
    - contiguous: one stride pattern, one kernel (eager copies non-contiguous input too);
    - the element dims (16/32) static: else "duck sizing" ties a block count that happens to be
      16 to them, and the next shape recompiles.
    """
    xb = x.reshape(shape)
    if not xb.is_contiguous():
        xb = xb.contiguous()
    return _mark_static_elements(xb.detach())


def _mark_static_elements(xb: torch.Tensor) -> torch.Tensor:
    for d in ((1, 3) if xb.dim() == 4 else (2,)):
        torch._dynamo.mark_static(xb, d)
    return xb


def eager_serves(key, x: torch.Tensor, shape, mode: str | None, calls: int,
                 kernels: CompiledKernels | None = None) -> bool:
    """Whether ``calls`` fake quantizations of ``x``'s size under the variant ``key`` would run eager
    (not compiled, and nothing compiles in the caller now: ``auto`` before the variant is ready, or a
    refused variant); under ``auto`` they are counted towards its warm-up as the calls themselves
    would be. For a caller that runs the calls' eager ops fused (``resq._resq_sweep``)."""
    variant = variant_of(key, kernels)
    mode = resolve_compile(mode)
    if variant.state == "refused":
        return True
    if mode != "auto" or variant.state == "ready":
        return False
    for _ in range(calls):
        variant(x, shape, mode)  # counts only (and may start the warm-up): nothing runs
    return True


def finite_only(res, shape):
    """``res`` (output, all-finite flag) of a compiled call with the output viewed as ``shape``, or
    None when it is None or ``x`` held a NaN/Inf: the caller then runs the eager path, which reports
    (or records) with its own message and writes its own bits. Inductor's vectorized code may give
    NaN another sign or payload than ATen's (``0xFFFFFFFF`` for ``0x7FC00000``), and which one ATen
    writes depends on the machine, so only eager can give eager's bits there. A CPU flag: no device
    sync; a non-finite input is an error or a skipped step, so the extra pass costs nothing that matters."""
    if res is None or not bool(res[1].all()):
        return None
    return res[0].view(shape), res[1]


def fake_quantize_nvfp4_fused(x: torch.Tensor, scale: str, block: str, out_dtype: torch.dtype,
                              mode: str | None = None, kernels: CompiledKernels | None = None):
    """Compiled ``fake_quantize_nvfp4`` of a validated ``x``: (output, all-finite flag), or None
    (not compiled yet / not for this input / a non-finite input: the caller runs eager)."""
    n = x.shape[-1]
    shape = (-1, n // 16, 16) if block == "1d" else (-1, 16, n // 16, 16)  # 2d: row tiles of all batches in dim 0
    variant = variant_of(("nvfp4", scale, block, x.dtype, out_dtype), kernels)
    return finite_only(variant(x, shape, resolve_compile(mode)), x.shape)


def fake_quantize_mxfp4_fused(x: torch.Tensor, scale_mode: str, out_dtype: torch.dtype, mode: str | None = None,
                              kernels: CompiledKernels | None = None):
    """Compiled ``fake_quantize_mxfp4`` of a validated ``x``: (output, all-finite flag) or None (as nvfp4)."""
    variant = variant_of(("mxfp4", scale_mode, x.dtype, out_dtype), kernels)
    res = variant(x, (-1, x.shape[-1] // 32, 32), resolve_compile(mode))
    return finite_only(res, x.shape)
