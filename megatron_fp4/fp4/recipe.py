"""Which tensor of an FP4 linear gets which format: the `Recipe`.

A recipe is a frozen value so the training side and the rollout side can compare theirs with `==`
and so it can be hashed into caches. The modes are:

- ``bf16``: no quantization at all (the layer is exactly ``F.linear``).
- ``fp4``: ``y = Q(x)·Q(W)ᵀ`` (and FP4 operands in backward, without compensation).
- ``fp4_resq``: MoEResQ, ``y = Q(x)·Q(W)ᵀ + Q(x − Q(x))·Q(W)ᵀ``, and backward operands ``A``
  replaced by ``Q(A) + Q(A − Q(A))``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from megatron_fp4.config.choices import COMPILE_MODES  # the one definition of each
from megatron_fp4.config.choices import FP4_FORMATS as FORMATS
from megatron_fp4.config.choices import FP4_MODES as MODES


@dataclass(frozen=True)
class OperandFormat:
    """How one operand is quantized.

    format: ``nvfp4`` (16-element blocks, E4M3 block scale, fp32 global scale) or ``mxfp4``
        (32-element blocks, E8M0 block scale).
    scale: NVFP4 global scale granularity, ``row`` (one per row: batch invariant) or ``tensor``.
    block: NVFP4 block shape, ``1d`` (16 along the last dim) or ``2d`` (16×16 tiles).
    rounding: ``nearest`` (RNE) or ``stochastic`` (unbiased, seeded).
    mx_scale_mode: MXFP4 shared-exponent rule, ``floor`` (OCP) or ``rceil``.
    """

    format: str = "nvfp4"
    scale: str = "row"
    block: str = "1d"
    rounding: str = "nearest"
    mx_scale_mode: str = "floor"

    def __post_init__(self):
        checks = {
            "format": (self.format, FORMATS),
            "scale": (self.scale, ("row", "tensor")),
            "block": (self.block, ("1d", "2d")),
            "rounding": (self.rounding, ("nearest", "stochastic")),
            "mx_scale_mode": (self.mx_scale_mode, ("floor", "rceil")),
        }
        for name, (value, allowed) in checks.items():
            if value not in allowed:
                raise ValueError(f"OperandFormat.{name}={value!r} is not one of {allowed}")
        if self.format == "mxfp4" and self.block == "2d":
            raise ValueError("OperandFormat.block='2d' is NVFP4-only; use block='1d' with format='mxfp4'")

    @property
    def block_size(self) -> int:
        return 16 if self.format == "nvfp4" else 32


@dataclass(frozen=True)
class Recipe:
    """Per-operand formats of the MoEResQ linear and the mode.

    Defaults follow the NVFP4 training recipe: activations and gradients with per-row global
    scale and 1-D blocks (batch invariant), weights in 16×16 tiles with a per-tensor global scale so
    ``Q(W)`` and ``Q(W)ᵀ`` are the same numbers.
    """

    mode: str = "fp4_resq"
    input: OperandFormat = field(default_factory=OperandFormat)
    weight: OperandFormat = field(default_factory=lambda: OperandFormat(scale="tensor", block="2d"))
    grad_output: OperandFormat = field(default_factory=OperandFormat)
    # Quantize dgrad/wgrad operands too (FP4 backward). False keeps backward GEMMs in high precision.
    quantize_backward: bool = True
    # Base seed of stochastic rounding; each draw's stream is keyed by (seed, layer, step, micro-batch,
    # operand), see context.py.
    seed: int = 0
    # When fake-quant runs as compiled kernels (fused.py): auto | on | off. Not part of equality: the
    # bits are the same either way, so a training and a rollout recipe differing only here agree.
    compile: str = field(default="auto", compare=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"Recipe.mode={self.mode!r} is not one of {MODES}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"Recipe.compile={self.compile!r} is not one of {COMPILE_MODES} "
                             "(auto: compile in the background once a job has quantized enough)")

    @property
    def quantized(self) -> bool:
        return self.mode != "bf16"

    @property
    def compensated(self) -> bool:
        return self.mode == "fp4_resq"

    def with_mode(self, mode: str) -> "Recipe":
        return replace(self, mode=mode)

    @classmethod
    def for_format(cls, mode: str = "fp4_resq", fmt: str = "nvfp4", **kw) -> "Recipe":
        """Convenience constructor: every operand in ``fmt`` with its default options."""
        if fmt == "mxfp4":
            op = OperandFormat(format="mxfp4", scale="tensor", block="1d")
            return cls(mode=mode, input=op, weight=op, grad_output=op, **kw)
        return cls(mode=mode, **kw)


def row_local(fmt: OperandFormat) -> bool:
    """Whether a quantized row depends on that row alone (nearest rounding, per-row blocks/scales)."""
    if fmt.rounding != "nearest":
        return False
    return fmt.format == "mxfp4" or (fmt.scale == "row" and fmt.block == "1d")
