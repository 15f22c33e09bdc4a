"""megatron_fp4: Megatron-style FP4 MoE training with MoEResQ compensation on both RL sides."""
__version__ = "0.1.0"
