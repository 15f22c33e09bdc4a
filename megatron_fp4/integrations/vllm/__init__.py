"""vLLM rollout adapter: export for vLLM, and (when vLLM is installed) build a `vllm.LLM` from it.

    out = export_for_vllm(model, cfg, "out/rollout_model")   # HF Qwen3-MoE checkpoint + sidecar
    llm = build_vllm_llm(out)                                # needs vLLM (and in practice a GPU)

The export is a Hugging Face Qwen3-MoE checkpoint written by
`megatron_fp4.integrations.hf.save_hf_checkpoint` (high-precision weights: vLLM reads it as a
plain Qwen3-MoE model) plus `megatron_fp4_quant.json`, which says which linears the training side
runs in FP4 and with which `Recipe` (format, scales, blocks, rounding, mode), so a vLLM-side plugin
can apply the *same* MoEResQ numerics at the *same* layers — the point of MoEResQ is that both sides
compensate (DESIGN.md). `recipe_from_sidecar` rebuilds the exact `Recipe` from the file; a plugin
must compute with `megatron_fp4.fp4` (ground rule 2), never a re-implementation.

Honesty note: this project ships no vLLM plugin. Stock vLLM loading this export runs the linears in
bf16/fp32, i.e. rollout mode 'bf16' whatever the sidecar says; `build_vllm_llm` warns about that.
The vLLM parts are untested here (vLLM is not installed in CI and needs a GPU); the export and the
sidecar are tested on CPU.
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

from megatron_fp4.training.checkpoint import replace_dir
from megatron_fp4.config import Config
from megatron_fp4.fp4 import OperandFormat, Recipe
from megatron_fp4.model.specs import recipe_from_config

SIDECAR_FILE = "megatron_fp4_quant.json"
SIDECAR_VERSION = 1
QUANT_METHOD = "megatron_fp4_moeresq"


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
        "producer": "megatron-fp4",
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
    }


def recipe_from_sidecar(sidecar: dict, which: str = "rollout") -> Recipe:
    """The exact `Recipe` recorded in a sidecar (`which` = 'rollout' or 'train')."""
    if sidecar.get("format_version") != SIDECAR_VERSION or sidecar.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"not a megatron-fp4 sidecar of version {SIDECAR_VERSION}: "
                         f"format_version={sidecar.get('format_version')!r}, quant_method={sidecar.get('quant_method')!r}")
    if which not in ("rollout", "train"):
        raise ValueError(f"which={which!r}: must be 'rollout' or 'train'")
    r = dict(sidecar[f"{which}_recipe"])
    for op in ("input", "weight", "grad_output"):
        r[op] = OperandFormat(**r[op])
    return Recipe(**r)


def load_quant_sidecar(path) -> dict:
    """Read `megatron_fp4_quant.json` from an export directory (or the file itself)."""
    path = Path(path)
    file = path / SIDECAR_FILE if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{str(file)!r} not found: export with export_for_vllm to get the FP4 sidecar")
    return json.loads(file.read_text())


def export_for_vllm(model, cfg: Config, out_dir, dtype: Optional[torch.dtype] = torch.bfloat16,
                    overwrite: bool = False) -> Path:
    """Write an HF Qwen3-MoE checkpoint of `model` plus the FP4 sidecar to `out_dir`, atomically
    (both files appear together or not at all). `dtype` casts the weights (default bf16, what
    vLLM serves; None keeps them). Returns the directory."""
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
        export = save_hf_checkpoint(model, cfg, staging / "export", dtype=dtype)
        (export / SIDECAR_FILE).write_text(json.dumps(sidecar, indent=2, sort_keys=True) + "\n")
        replace_dir(export, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def build_vllm_llm(export_dir, **llm_kwargs):
    """`vllm.LLM` over an `export_for_vllm` directory (extra kwargs go to `vllm.LLM`).

    Raises RuntimeError when vLLM is not importable. Warns when the sidecar asks for FP4 in the
    rollout: stock vLLM serves these weights unquantized, so the rollout would not match the
    training numerics without a plugin applying `recipe_from_sidecar`."""
    cap = vllm_available()
    if not cap:
        raise RuntimeError(f"vLLM backend unavailable: {cap.reason}. Install vllm on a GPU machine, or use "
                           f"megatron_fp4.rollout (the portable engine with the same numerics).")
    sidecar = load_quant_sidecar(export_dir)
    if sidecar.get("rollout_mode") != "bf16" and sidecar.get("scope") != "none":
        warnings.warn(f"{SIDECAR_FILE} asks for rollout_mode={sidecar.get('rollout_mode')!r} on scope "
                      f"{sidecar.get('scope')!r}; stock vLLM runs these linears unquantized, so rollout and "
                      f"training numerics differ unless a megatron-fp4 vLLM plugin applies the recipe", stacklevel=2)
    import vllm

    llm_kwargs.setdefault("dtype", "bfloat16")
    return vllm.LLM(model=str(export_dir), **llm_kwargs)


__all__ = ["SIDECAR_FILE", "SIDECAR_VERSION", "QUANT_METHOD", "Capability", "vllm_available", "quant_sidecar",
           "recipe_from_sidecar", "load_quant_sidecar", "export_for_vllm", "build_vllm_llm"]
