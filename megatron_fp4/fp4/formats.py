"""FP4 block formats: the quantized-tensor value and the checks shared by NVFP4 and MXFP4.

The quantizers themselves live in ``nvfp4.py`` (two-level scaling, E4M3 block scales) and
``mxfp4.py`` (OCP MX, E8M0 block scales); both return an :class:`FP4Tensor`.

Behaviour on bad input (the same for both formats):

- Non-finite input (NaN, ±Inf) raises ``ValueError`` naming the tensor and the number of
  non-finite elements (or, given ``nonfinite=`` flags, records a device-side flag that the step
  reads once: see ``nonfinite.py``). A block format cannot carry them (an Inf would silently become the
  per-tensor/per-row amax and zero every other block), and the training loop checks for NaN in
  high precision before quantization anyway. The check costs nothing extra on the happy path: the
  quantizer reduces to block amaxes anyway and only looks at those.
- A last dim that is not a multiple of the block size (16 NVFP4, 32 MXFP4), or, for NVFP4
  ``block='2d'``, a second-to-last dim that is not a multiple of 16, raises ``ValueError`` naming
  the dim, its size and the multiple required. Callers pad (the MoEResQ wgrad path pads tokens).
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_fp4.fp4.e2m1 import codes_to_values, pack_codes, unpack_fp4

FLT_MAX = torch.finfo(torch.float32).max


@dataclass
class FP4Tensor:
    """A tensor quantized to FP4 with block scales.

    codes: uint8, one unpacked E2M1 code per element, same shape as the input, sign in bit 3.
    block_scales: ``float8_e4m3fn`` (NVFP4) or ``float8_e8m0fnu`` (MXFP4). Shape
        ``shape[:-1] + (n // bs,)`` for 1-D blocks, ``shape[:-2] + (m // 16, n // 16)`` for 2-D.
    global_scale: NVFP4 only, fp32 *decode* scale ``S_dec`` (value = code · block_scale ·
        global_scale); shape ``shape[:-1]`` for per-row scale, ``()`` for per-tensor. None for MX.
    """

    codes: torch.Tensor
    block_scales: torch.Tensor
    global_scale: torch.Tensor | None
    format: str  # "nvfp4" | "mxfp4"
    block: str = "1d"  # "1d" | "2d"

    @property
    def block_size(self) -> int:
        return 16 if self.format == "nvfp4" else 32

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """code value · block scale (· global scale), computed left to right in fp32."""
        values = codes_to_values(self.codes)
        scales = block_scales_fp32(self.block_scales)
        shape = self.codes.shape
        bs = self.block_size
        if self.block == "2d":
            m, n = shape[-2], shape[-1]
            v = values.reshape(-1, m // 16, 16, n // 16, 16) * scales.reshape(-1, m // 16, 1, n // 16, 1)
        else:
            v = values.reshape(-1, shape[-1] // bs, bs) * scales.reshape(-1, shape[-1] // bs, 1)
        if self.global_scale is not None:
            g = self.global_scale
            v = v * (g.reshape(-1, 1, 1) if g.dim() > 0 else g)
        return v.reshape(shape).to(dtype)

    def pack(self) -> torch.Tensor:
        """Codes as ``torch.float4_e2m1fn_x2`` (last dim halved, even element in the low nibble)."""
        return pack_codes(self.codes)

    @classmethod
    def from_packed(cls, packed, block_scales, global_scale=None, *, format=None, block="1d") -> "FP4Tensor":
        """Rebuild from :meth:`pack` output and the scales; format inferred from the scale dtype."""
        if format is None:
            format = "mxfp4" if block_scales.dtype == torch.float8_e8m0fnu else "nvfp4"
        return cls(unpack_fp4(packed), block_scales, global_scale, format, block)


def block_scales_fp32(scales: torch.Tensor) -> torch.Tensor:
    """Block scales (E4M3 or E8M0) as exact fp32 values."""
    if scales.dtype == torch.float8_e8m0fnu:
        return e8m0_to_fp32(scales.view(torch.uint8))
    return scales.to(torch.float32)


def e8m0_to_fp32(biased: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponents (uint8, 255 = NaN) to fp32 powers of two; 0 gives 2^-127 (subnormal)."""
    return pow2_fp32(biased.to(torch.int32) - 127)


def pow2_fp32(e: torch.Tensor) -> torch.Tensor:
    """2^e as fp32 for int32 ``e`` in [−127, 127] (2^−127 is the subnormal 0x00400000), NaN for 128.

    Built from the bit pattern (biased exponent in bits 23..30): exact, and no float64 pass.
    """
    bits = torch.where(e > -127, (e + 127) << 23, 0x00400000)
    bits = torch.where(e > 127, 0x7FC00000, bits)
    return bits.view(torch.float32)


def to_fp32_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """Validate and convert the quantizer input to contiguous fp32 (a new or the same tensor, never
    modified)."""
    check_input(x, name)
    if x.dtype == torch.float32:
        return x.contiguous()
    return x.to(torch.float32, memory_format=torch.contiguous_format)


def check_input(x: torch.Tensor, name: str) -> None:
    """The type/dtype/rank checks of :func:`to_fp32_rows`, without converting."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype.itemsize < 2:
        raise ValueError(f"{name}: FP4 quantization takes fp32/bf16/fp16 input, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{name}: FP4 quantization needs at least one dim, got a scalar")


def abs_block_max(xf: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(|xf|, max of |xf| over consecutive ``block`` elements of the last dim) for contiguous fp32 ``xf``.

    Shapes: ``|xf|`` keeps ``xf``'s shape (a fresh buffer the caller may overwrite), the maxima are
    ``xf.shape[:-1] + (n // block,)``. ``max_pool1d`` with kernel = stride = block is a few times
    faster on CPU than ``amax`` over a trailing dim of 16/32, and like ``amax`` it propagates NaN
    (the non-finite check relies on that); a max is exact in any order.
    """
    a = xf.abs()
    n = xf.shape[-1]
    m = F.max_pool1d(a.view(-1, 1, n), block, block)
    return a, m.view(*xf.shape[:-1], n // block)


# Rows per step of the eager sweeps (``Sweep``): about this many elements, so that a step's input,
# output and scratch buffers stay in the shared cache (fp32: 2 MiB each) while each op is long
# enough that its fixed cost (~5 µs) stays small (2^17: 1.5x the time of 2^19 at [4096, 1024]).
SWEEP_ELEMENTS = 1 << 19


class _Pool(threading.local):
    """Each thread's idle sweep scratch buffers (flat; lent to one ``Sweep`` at a time). Kept across
    calls: a fresh tensor of a MiB or more is a fresh mapping whose pages fault in on first write,
    which costs more than the pass that writes them."""

    def __init__(self):
        self.idle: list = []


_POOL = _Pool()


class Sweep:
    """Row ranges of a 2-D ``[rows, n]`` tensor and the scratch buffers of an eager quantizer that
    processes them one range at a time (every op elementwise or within a block: the same bits as
    one call over all rows). ``align``: a range is a multiple of this many rows (16: NVFP4's 2-D
    tiles). A context manager: the scratch (two fp32 buffers and one int32 buffer of a range's size)
    is borrowed from the thread's pool on entry and given back on exit."""

    def __init__(self, rows: int, n: int, device, align: int = 1):
        per = max(align, SWEEP_ELEMENTS // max(n, 1) // align * align)
        self.n, self.device = n, device
        self.spans = [(r, min(r + per, rows)) for r in range(0, rows, per)]
        self.size = min(per, rows) * n
        self._flat = None

    def __enter__(self) -> "Sweep":
        pool = _POOL.idle
        i = next((i for i, t in enumerate(pool) if t.device == self.device and t.numel() >= 3 * self.size), None)
        if i is not None:
            flat = pool.pop(i)
        else:  # a normal tensor even under inference mode (vLLM's forward): the pool serves both modes
            with torch.inference_mode(False):
                flat = torch.empty(3 * max(self.size, SWEEP_ELEMENTS), dtype=torch.float32, device=self.device)
        self._flat, c = flat, self.size // max(self.n, 1)
        self.f32 = [flat[k * self.size:(k + 1) * self.size].view(c, self.n) for k in range(2)]
        self.i32 = flat[2 * self.size:3 * self.size].view(torch.int32).view(c, self.n)
        return self

    def __exit__(self, *exc) -> None:
        self.f32 = self.i32 = None
        if len(_POOL.idle) < 4:
            _POOL.idle.append(self._flat)
        self._flat = None

    def fp32(self, xc: torch.Tensor) -> torch.Tensor:
        """``xc`` as contiguous fp32: itself when it is, else its exact copy in scratch buffer 0."""
        if xc.dtype == torch.float32 and xc.is_contiguous():
            return xc
        return self.f32[0][:xc.shape[0]].copy_(xc)

    @staticmethod
    def finite(maxima: list) -> bool:
        """Whether every 0-dim max of |x| in ``maxima`` is finite (a max propagates NaN; NaN < inf is false)."""
        return bool((torch.stack(maxima).max() if len(maxima) > 1 else maxima[0]) < math.inf)

    def block_amax(self, src: torch.Tensor, block: int) -> torch.Tensor:
        """Max of |src| over each ``block`` consecutive elements of a row, ``(c, n // block)``
        (``abs_block_max``'s maxima; |src| is written to scratch buffer 1)."""
        a = torch.abs(src, out=self.f32[1][:src.shape[0]])
        return F.max_pool1d(a.view(-1, 1, self.n), block, block).view(src.shape[0], self.n // block)


def reduced_amax(amax: torch.Tensor, amax_reduce) -> torch.Tensor:
    """``amax_reduce(amax)`` (a max over the ranks holding the tensor's other slices) with NaN sent
    as +Inf: a max of NaN is order-dependent, +Inf is not, so every rank sees the non-finite value
    and raises (or flags) together instead of one rank leaving the others waiting in a collective."""
    return amax_reduce(torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax))


def check_multiple(x: torch.Tensor, dim: int, multiple: int, name: str, what: str) -> None:
    size = x.shape[dim]
    if size % multiple:
        raise ValueError(
            f"{what}: dim {dim % x.dim()} of '{name}' (shape {tuple(x.shape)}) has size {size}, "
            f"which is not a multiple of {multiple}; pad it to a multiple of {multiple}"
        )


class NonFiniteInputError(ValueError):
    """An FP4 operand holds NaN/Inf (the trainer turns this into its NaN policy: stop or skip)."""


def check_finite(x: torch.Tensor, block_amax: torch.Tensor, name: str, what: str, nonfinite=None) -> None:
    """Raise if ``x`` has NaN/Inf; ``block_amax`` (a reduction of |x|) is checked first, cheaply.

    With ``nonfinite`` (a ``NonFiniteFlags``) the flag is only recorded on the device (no host
    sync); the caller reads it once per step. Eagerly the check is ``max < inf`` (a max propagates
    NaN and NaN < inf is false; every element is ≥ 0 or non-finite): two ops instead of
    ``isfinite(·).all()``'s five."""
    if nonfinite is None and block_amax.numel():
        if not bool(block_amax.max() < math.inf):
            raise_non_finite(x, name, what)
        return
    check_finite_flag(x, torch.isfinite(block_amax).all(), name, what, nonfinite)


def check_finite_flag(x: torch.Tensor, finite: torch.Tensor, name: str, what: str, nonfinite=None) -> None:
    """:func:`check_finite` from an already reduced 0-dim bool ``finite``."""
    if nonfinite is not None:
        nonfinite.record(name, what, finite)
    elif not bool(finite):
        raise_non_finite(x, name, what)


def raise_non_finite(x: torch.Tensor, name: str, what: str) -> None:
    bad = int((~torch.isfinite(x)).sum())
    where = "" if bad else " here, but its slice on another tensor-parallel rank has"
    raise NonFiniteInputError(
        f"{what}: tensor '{name}' has {bad} non-finite element(s) (NaN/Inf) out of {x.numel()}{where}; "
        "FP4 block scales cannot represent them (check the producer of this tensor)"
    )
