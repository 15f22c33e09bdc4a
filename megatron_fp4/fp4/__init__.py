"""FP4 numerics: the one definition of NVFP4/MXFP4 and the MoEResQ linear used everywhere."""
from megatron_fp4.fp4.recipe import FORMATS, MODES, OperandFormat, Recipe
from megatron_fp4.fp4.moeresq import MoEResQLinear, fake_quantize, moeresq_linear, sqnr_db

__all__ = [
    "FORMATS", "MODES", "OperandFormat", "Recipe",
    "MoEResQLinear", "moeresq_linear", "fake_quantize", "sqnr_db",
]
