"""vLLM's `vllm.general_plugins` entry point (setup.py): registers the `megatron_fp4` quantization
method in every vLLM process (the front end and each engine worker) before models are built."""
from __future__ import annotations


def register() -> None:
    """Import the quantization module: its `register_quantization_config` decorator registers it.
    Idempotent (vLLM calls every general plugin once per process; repeats are harmless)."""
    from megatron_fp4.integrations.vllm import quant  # noqa: F401  (registration on import)
