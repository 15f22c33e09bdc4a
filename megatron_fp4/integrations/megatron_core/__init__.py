"""megatron_core."""
