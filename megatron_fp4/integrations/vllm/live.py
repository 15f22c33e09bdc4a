"""Live weight updates into a running in-process `vllm.LLM` served with the `megatron_fp4` plugin.

    update_weights(llm, {"model.layers.0.mlp.experts.3.up_proj.weight": t, ...})   # HF names

The tensors (any subset of the served checkpoint's, by HF name) are checked against the served
checkpoint's safetensors headers (names, shapes, dtypes) before anything is written, so a bad update
leaves the previous weights serving. They are then loaded by the model's own `load_weights` (vLLM's
name mapping: fused qkv / gate_up shards, per-expert rows), every plugin layer clears its cached
Q(W) on the write and re-derives its view of the weights. The plugin owns every weight that vLLM's
CPU path would otherwise prepack (experts, decoder linears, LM head), which is why an update is
served exactly as a fresh start on the new weights would serve it (tests/integration/
test_vllm_plugin.py checks it bitwise). The engine must run in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`): `llm.apply_model` then reaches the model directly.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from megatron_fp4.integrations.hf.checkpoint import SafetensorsTensors, _weight_files
from megatron_fp4.training.nonfinite import all_finite


# what an update may hold: floating types that are cast to the parameter's on load and that the
# finiteness check can sum (torch has no CPU sum for the float8 types: refused here, not by torch)
UPDATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def checkpoint_shapes(model_dir) -> dict[str, tuple]:
    """{HF name: shape} of the safetensors checkpoint in `model_dir` (read from its headers)."""
    tensors = SafetensorsTensors(_weight_files(Path(model_dir)))
    return {key: tensors.shape(key) for key in tensors}


def served_shapes(llm) -> dict[str, tuple]:
    """{HF name: shape} of the checkpoint `llm` serves."""
    return checkpoint_shapes(llm.llm_engine.model_config.model)


def check_manifest(served: Mapping[str, tuple], manifest: Mapping[str, tuple]) -> None:
    """ValueError naming the first entry of `manifest` ({HF name: (shape, dtype)}) that the served
    checkpoint lacks or holds in another shape, or whose dtype is not one of `UPDATE_DTYPES` (each is
    cast to the parameter's on load)."""
    if not manifest:
        raise ValueError("update_weights: no tensors given")
    for name, (shape, dtype) in manifest.items():
        if name not in served:
            raise ValueError(f"update_weights: {name!r} is not a tensor of the served checkpoint (HF names, e.g. "
                             f"{next(iter(served))!r}); nothing was loaded")
        if dtype not in UPDATE_DTYPES:
            raise ValueError(f"update_weights: {name!r} is {dtype}; an update holds floating-point tensors of "
                             f"{', '.join(map(str, UPDATE_DTYPES))} (cast it before publishing); nothing was loaded")
        if tuple(shape) != tuple(served[name]):
            raise ValueError(f"update_weights: {name!r} has shape {tuple(shape)}, the served checkpoint "
                             f"{tuple(served[name])}; nothing was loaded")


def check_update(served: Mapping[str, tuple], update: Mapping[str, torch.Tensor]) -> None:
    """`check_manifest` of `update` (HF name -> tensor), then every tensor finite."""
    for name, t in update.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"update_weights: {name!r} must be a floating-point tensor, got {type(t).__name__}; "
                             "nothing was loaded")
    check_manifest(served, {name: (tuple(t.shape), t.dtype) for name, t in update.items()})
    if not all_finite(update.values()):  # one sum per tensor (an exact scan only when one is not finite)
        bad = next(name for name, t in update.items() if not bool(torch.isfinite(t).all()))
        raise ValueError(f"update_weights: {bad!r} holds NaN/Inf; nothing was loaded")


def plugin_layers(model) -> list:
    """(module, method) of every layer of `model` that the megatron_fp4 plugin computes."""
    from megatron_fp4.integrations.vllm.quant import MegatronFP4Config

    return [(m, m.quant_method) for m in model.modules()
            if isinstance(getattr(getattr(m, "quant_method", None), "config", None), MegatronFP4Config)]


def load_into(model, update: Mapping[str, torch.Tensor]) -> None:
    """Write checked tensors into `model` (vLLM's `load_weights`) and refresh every plugin layer."""
    model.load_weights(iter(update.items()))  # each plugin weight loader clears the Q(W) store first
    for module, method in plugin_layers(model):  # and each layer re-derives what it keeps from its weights
        method.process_weights_after_loading(module)


def update_weights(llm, update: Mapping[str, torch.Tensor]) -> None:
    """Load `update` (HF name -> tensor) into the running in-process engine `llm` (module doc)."""
    if not all(llm.apply_model(lambda model: bool(plugin_layers(model)))):
        raise ValueError("update_weights: the engine does not serve with the megatron_fp4 plugin (config.json has "
                         "no quantization_config block); stock vLLM's CPU layers keep prepacked copies of their "
                         "weights, which a load would leave stale; nothing was loaded")
    check_update(served_shapes(llm), update)
    llm.apply_model(lambda model: load_into(model, update))
