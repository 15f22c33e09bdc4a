"""The E2M1 element format (FP4) shared by NVFP4 and MXFP4: rounding, codes, packing.

E2M1 magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7); bit 3 of a code is the sign, so
one code is a 4-bit value in a uint8. Rounding works on fp32 values that the caller has already
scaled and clamped to [-6, 6]:

- nearest: round-to-nearest-even on the E2M1 grid (ties 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2,
  3.5→4, 5→4). The grid spacing is 0.5 below 2, 1 in [2, 4), 2 in [4, 6], so RNE is
  ``round(a / step) * step`` with torch's (half-to-even) ``round``; all steps are exact in fp32.
- stochastic: round up to the next grid point with probability (a − lo) / step, so
  E[Q(a)] = a for |a| ≤ 6. The uniform draws come from the caller's ``torch.Generator``.

Signs are kept with ``copysign``, so a negative value that rounds to zero becomes −0 (code 8), as
the hardware conversion does.

Packing follows ``torch.float4_e2m1fn_x2``: two codes a byte, the even element in the low nibble.
"""
from __future__ import annotations

import torch

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _grid_step(y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Spacing of the E2M1 grid at fp32 ``y`` with |y| ≤ 6: 0.5 below 2, 1 below 4, else 2.

    That is 2^(max(exponent(|y|), 0) − 1): read the exponent bits (sign masked off), clamp them at
    the exponent of 1.0 and subtract one; three integer passes, cheaper than nested ``where``.
    ``out``: an int32 buffer of ``y``'s shape to write the step's bits into (no fresh tensor).
    """
    if out is None:
        bits = y.contiguous().view(torch.int32) & 0x7F800000
    else:
        bits = torch.bitwise_and(y.view(torch.int32), 0x7F800000, out=out)
    return bits.clamp_(min=127 << 23).sub_(1 << 23).view(torch.float32)


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """RNE of fp32 ``y`` (already clamped to [-6, 6]) onto the signed E2M1 grid, as fp32 values."""
    return round_e2m1_(y.clone())


def round_e2m1_(y: torch.Tensor, step_buf: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`round_e2m1` in place on contiguous fp32 ``y`` (returns ``y``): six passes, one buffer.

    ``y / step`` is exact (step is a power of two), so rounding it with torch's half-to-even
    ``round`` and scaling back is RNE on the grid; −0 survives (round(−0.2) = −0). ``step_buf``:
    an int32 scratch of ``y``'s shape for the step (else a fresh tensor).
    """
    step = _grid_step(y, step_buf)
    return y.div_(step).round_().mul_(step)


def round_e2m1_select(y: torch.Tensor) -> torch.Tensor:
    """Same values and bits as :func:`round_e2m1`, with the step chosen by two compares.

    For traced/compiled code: inductor's C++ backend vectorizes compares and selects but lowers a
    float↔int32 bit view to a scalar loop. Equal to ``_grid_step`` for every |y| ≤ 6 (0.5 below 2,
    1 below 4, else 2); tests check the two against each other.
    """
    a = y.abs()
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    return torch.round(y / step) * step


def stochastic_round_e2m1(y: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Unbiased stochastic rounding of fp32 ``y`` (clamped to [-6, 6]) onto the E2M1 grid."""
    a = y.abs()
    step = _grid_step(a)
    lo = torch.floor(a / step).mul_(step)
    frac = (a - lo).div_(step)  # in [0, 1): probability of rounding up
    u = torch.rand(a.shape, generator=generator, device=a.device, dtype=torch.float32)
    up = (u < frac).to(torch.float32)
    return torch.copysign(lo.add_(up.mul_(step)), y)


def values_to_codes(v: torch.Tensor) -> torch.Tensor:
    """Signed E2M1 grid values (fp32) to 4-bit codes in uint8, sign in bit 3."""
    mag = v.abs()
    code = torch.where(mag <= 2.0, mag * 2.0, torch.where(mag <= 4.0, mag + 2.0, 7.0)).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


_VALUE_TABLE = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float32)


def codes_to_values(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8) to fp32 values; code 8 decodes to −0."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"E2M1 codes must be uint8, got {codes.dtype}")
    table = _VALUE_TABLE.to(codes.device)
    return table[(codes & 0xF).long()]


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes (last dim even) into ``torch.float4_e2m1fn_x2``, even element low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"packing FP4 needs an even last dim, got {codes.shape[-1]}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    byte = (pairs[..., 0] & 0xF) | ((pairs[..., 1] & 0xF) << 4)
    return byte.contiguous().view(torch.float4_e2m1fn_x2)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``float4_e2m1fn_x2`` (or uint8) to uint8 codes, last dim ×2."""
    if packed.dtype not in (torch.float4_e2m1fn_x2, torch.uint8):
        raise ValueError(f"unpack_fp4 expects float4_e2m1fn_x2 or uint8, got {packed.dtype}")
    byte = packed.contiguous().view(torch.uint8)
    codes = torch.stack((byte & 0xF, byte >> 4), dim=-1)
    return codes.reshape(*byte.shape[:-1], byte.shape[-1] * 2)
