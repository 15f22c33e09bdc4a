"""transformer_engine."""
