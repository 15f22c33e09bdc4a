"""The FP4 sidecar's format (`megatron_fp4_quant.json`, also the `quantization_config` block): its
names and the readers both sides use. The package (the export) writes it and quant.py (the vLLM
plugin) reads it; both import it from here, so neither imports the other.
"""
from __future__ import annotations

import json
from pathlib import Path

from megatron_fp4.config.choices import INVARIANCE_LEVELS
from megatron_fp4.fp4 import OperandFormat, Recipe

SIDECAR_FILE = "megatron_fp4_quant.json"
SIDECAR_VERSION = 1
QUANT_METHOD = "megatron_fp4"  # vLLM's `quant_method` name of the plugin
_LEGACY_QUANT_METHODS = ("megatron_fp4_moeresq",)  # sidecars written before the plugin existed


def recipe_from_sidecar(sidecar: dict, which: str = "rollout") -> Recipe:
    """The exact `Recipe` recorded in a sidecar (`which` = 'rollout' or 'train')."""
    if sidecar.get("format_version") != SIDECAR_VERSION or \
            sidecar.get("quant_method") not in (QUANT_METHOD, *_LEGACY_QUANT_METHODS):
        raise ValueError(f"not a megatron-fp4 sidecar of version {SIDECAR_VERSION}: "
                         f"format_version={sidecar.get('format_version')!r}, quant_method={sidecar.get('quant_method')!r}")
    if which not in ("rollout", "train"):
        raise ValueError(f"which={which!r}: must be 'rollout' or 'train'")
    r = dict(sidecar[f"{which}_recipe"])
    for op in ("input", "weight", "grad_output"):
        r[op] = OperandFormat(**r[op])
    return Recipe(**r)


def served_level(block: dict) -> str:
    """The numerics level (`numerics.invariance`) the vLLM plugin serves a recipe block at: the
    block's ``numerics_level`` (the export's ``numerics.invariance``: ``standard``, ``batch`` or
    ``exact``, each computed with the trainer's kernels of that level). A block written before the
    levels were recorded has only ``batch_invariant``: true was served ``exact``, false
    ``standard``. A trainer or verl actor that scores what the plugin rolled out computes at this
    level to agree with it (tests/integration/test_verl_ppo_vllm.py)."""
    level = block.get("numerics_level")
    if level is None:
        return "exact" if block.get("batch_invariant", False) else "standard"
    if level not in INVARIANCE_LEVELS:
        raise ValueError(f"quantization_config.numerics_level={level!r:.40} is not one of {INVARIANCE_LEVELS}: "
                         "re-export the checkpoint (tools/convert_checkpoint.py to-hf)")
    return level


def load_quant_sidecar(path) -> dict:
    """Read `megatron_fp4_quant.json` from an export directory (or the file itself)."""
    path = Path(path)
    file = path / SIDECAR_FILE if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{str(file)!r} not found: export with export_for_vllm to get the FP4 sidecar")
    return json.loads(file.read_text())
