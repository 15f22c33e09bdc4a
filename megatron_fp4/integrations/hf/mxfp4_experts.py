"""GPT-OSS's packed MXFP4 expert weights (OpenAI's checkpoints), read and written natively.

HF stores an expert weight ``W [E, out, in]`` as

    <name>_blocks  uint8 [E, out, in/32, 16]   two E2M1 codes a byte, element 2j in the low nibble
    <name>_scales  uint8 [E, out, in/32]       E8M0 biased exponents, one per 32 elements (255 = NaN)

which is our MXFP4 format (`fp4/mxfp4.py`: 1-D blocks of 32 along `in`, E8M0 scales, the same code
and nibble order), so reading is `fp4.formats.FP4Tensor.dequantize` of the unpacked codes: exact,
the bits of ``transformers.integrations.mxfp4.convert_moe_packed_tensors`` in fp32. The weights
then lie on the MXFP4 grid and the project's MXFP4 weight quantizer returns them unchanged
(``Q(W) = W``). Shapes and dtypes are checked against the safetensors header before anything is
allocated; an expert-parallel rank reads only its experts' rows.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from megatron_fp4.fp4.e2m1 import unpack_fp4
from megatron_fp4.fp4.formats import FP4Tensor
from megatron_fp4.fp4.mxfp4 import MX_BLOCK, quantize_mxfp4

E8M0_NAN = 255


def is_packed(sd: Mapping, key: str) -> bool:
    """Whether `sd` holds HF tensor `key` packed (``key_blocks`` and ``key_scales``)."""
    return f"{key}_blocks" in sd and f"{key}_scales" in sd


def _meta(sd, key: str):
    """(shape, dtype name) from the header (lazy `sd`) or the tensor."""
    if hasattr(sd, "rows"):
        return tuple(sd.shape(key)), str(sd.dtype(key)).lower()
    t = sd[key]
    return tuple(t.shape), str(t.dtype).replace("torch.", "").lower()


def _check(sd, key: str, want: tuple) -> None:
    shape, dtype = _meta(sd, key)
    if shape != want or dtype not in ("u8", "uint8"):
        raise ValueError(f"packed MXFP4 tensor {key!r}: {dtype} {list(shape)} in the checkpoint, the model needs "
                         f"uint8 {list(want)}; build the model from the checkpoint's own config.json")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, name: str = "experts") -> torch.Tensor:
    """blocks uint8 [..., out, in/32, 16], scales uint8 [..., out, in/32] -> fp32 [..., out, in]."""
    nan = scales == E8M0_NAN
    if bool(nan.any()):
        raise ValueError(f"packed MXFP4 tensor {name!r}: {int(nan.sum())} block scale(s) are E8M0 255 (NaN); "
                         "the checkpoint is corrupt: re-download or re-export it")
    codes = unpack_fp4(blocks).flatten(-2)  # [..., out, in]
    return FP4Tensor(codes, scales.view(torch.float8_e8m0fnu), None, "mxfp4", "1d").dequantize(torch.float32)


def read(sd: Mapping, key: str, shape: tuple, rows: tuple, headers_only: bool = False) -> Optional[torch.Tensor]:
    """Rows [lo, hi) (experts) of the packed HF weight `key` of full shape ``[E, out, in]``,
    dequantized to fp32 [hi - lo, out, in] (a meta tensor with ``headers_only``)."""
    E, out, inner = shape
    if inner % MX_BLOCK:
        raise ValueError(f"packed MXFP4 tensor {key!r}: in-dim {inner} is not a multiple of {MX_BLOCK}")
    nblk = inner // MX_BLOCK
    _check(sd, key + "_blocks", (E, out, nblk, MX_BLOCK // 2))
    _check(sd, key + "_scales", (E, out, nblk))
    lo, hi = rows
    if headers_only:
        return torch.empty((hi - lo, out, inner), device="meta")

    def take(k):
        return sd.rows(k, lo, hi) if hasattr(sd, "rows") else sd[k][lo:hi]

    return dequantize(take(key + "_blocks"), take(key + "_scales"), key)


def pack(w: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of `w` [E, out, in] on the MXFP4 grid (a ValueError otherwise: packing would
    round, and an export must give back the weights it was given)."""
    q = quantize_mxfp4(w.detach().to(torch.float32), scale_mode="floor", name=name)
    if not torch.equal(q.dequantize(torch.float32), w.detach().to(torch.float32)):
        raise ValueError(f"{name}: the expert weights are not on the MXFP4 grid (trained in higher precision), so "
                         "packing them would round them; export without --mxfp4-experts")
    codes = q.codes
    blocks = ((codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)).to(torch.uint8)
    return blocks.reshape(*w.shape[:-1], -1, MX_BLOCK // 2).contiguous(), \
        q.block_scales.view(torch.uint8).contiguous()
