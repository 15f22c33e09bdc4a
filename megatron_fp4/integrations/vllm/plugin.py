"""vLLM's `vllm.general_plugins` entry point (setup.py): registers the `megatron_fp4` quantization
method and the `megatron_fp4` weight-transfer backend in every vLLM process (the front end and each
engine worker) before models are built."""
from __future__ import annotations

import platform


def register() -> None:
    """Import the quantization module (its `register_quantization_config` decorator registers it),
    register the plugin's out-of-tree ops (`ops.py`, active only in models served with it) and its
    model class (`model.py`, the trainer's RoPE and attention, in models served with the plugin's config).
    Idempotent (vLLM calls every general plugin once per process; repeats are harmless)."""
    from megatron_fp4.integrations.vllm import quant  # noqa: F401  (registration on import)
    from megatron_fp4.integrations.vllm.ops import register_ops

    register_ops()
    _register_model()
    _register_weight_transfer()
    _allow_amx()


def _register_model() -> None:
    """The plugin's model classes (model.py) under each family's own architecture (Qwen3MoeForCausalLM,
    GptOssForCausalLM, DeepseekV3ForCausalLM, from the registry's HF modules): subclasses of vLLM's
    that are stock vLLM unless the model is served with the `megatron_fp4` quantization config, so
    config.json keeps the one architecture transformers and verl expect (verl's HFModelConfig refuses
    a list of two). Registered lazily (a `module:class` string)."""
    from vllm import ModelRegistry

    from megatron_fp4.integrations.hf.families import BY_FAMILY

    classes = {"qwen3_moe": "model:MegatronFP4Qwen3MoeForCausalLM", "gpt_oss": "model_families:MegatronFP4GptOssForCausalLM",
               "deepseek_v3": "model_families:MegatronFP4DeepseekV3ForCausalLM"}
    for family, module in BY_FAMILY.items():
        ModelRegistry.register_model(module.HF_ARCHITECTURE, f"megatron_fp4.integrations.vllm.{classes[family]}")


def _register_weight_transfer() -> None:
    """The `megatron_fp4` backend of vLLM's weight-transfer API (`transfer.py`, imported only when a
    worker builds it: `--weight-transfer-config '{"backend": "megatron_fp4"}'`). A vLLM without the
    API (older than its `weight_transfer` package) just does not get it."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    if "megatron_fp4" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("megatron_fp4", "megatron_fp4.integrations.vllm.transfer",
                                                    "MegatronFP4WeightTransferEngine")


def _allow_amx() -> None:
    """Ask Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM) for this process. vLLM's CPU
    attention runs AMX instructions in bf16 without asking; stock vLLM gets the permission as a side
    effect of its oneDNN bf16 GEMMs, which the plugin's layers replace, so without this request the
    first bf16 attention dies with SIGILL. A no-op where there is no AMX (the call fails quietly)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(158, 0x1023, 18)  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    except (OSError, AttributeError):
        pass
