"""FP4 numerics: the one definition of NVFP4/MXFP4 and the MoEResQ linear used everywhere."""
from megatron_fp4.fp4.context import QuantStep, name_quant_sites, sr_seed
from megatron_fp4.fp4.e2m1 import E2M1_VALUES, pack_codes, unpack_fp4
from megatron_fp4.fp4 import invariant
from megatron_fp4.fp4 import fused, fused_resq  # noqa: F401  (the compiled fake-quant / ResQ paths, a Numerics' kernels)
from megatron_fp4.fp4.formats import FP4Tensor, NonFiniteInputError
from megatron_fp4.fp4.moeresq import (
                                      MoEResQLinear, fake_quantize, moeresq_linear, resq_quantize, sqnr_db,
                                      )
from megatron_fp4.fp4.nonfinite import NonFiniteFlags
from megatron_fp4.fp4.numerics import STANDARD, Numerics, WeightStore, apply_numerics, numerics_of, rollout_numerics
from megatron_fp4.fp4.mxfp4 import fake_quantize_mxfp4, quantize_mxfp4
from megatron_fp4.fp4.nvfp4 import fake_quantize_nvfp4, quantize_nvfp4
from megatron_fp4.fp4.recipe import FORMATS, MODES, OperandFormat, Recipe

from_packed = FP4Tensor.from_packed

__all__ = [
    "NonFiniteInputError", "NonFiniteFlags", "invariant", "Numerics", "STANDARD", "WeightStore", "apply_numerics", "numerics_of", "rollout_numerics",
    "QuantStep", "sr_seed", "name_quant_sites",
    "FORMATS", "MODES", "OperandFormat", "Recipe",
    "MoEResQLinear", "moeresq_linear", "fake_quantize", "resq_quantize", "sqnr_db",
    "FP4Tensor", "quantize_nvfp4", "quantize_mxfp4", "fake_quantize_nvfp4", "fake_quantize_mxfp4",
    "E2M1_VALUES", "pack_codes", "unpack_fp4", "from_packed",
]
