"""Hugging Face Qwen3-MoE checkpoints on disk: `config.json` + safetensors.

    save_hf_checkpoint(model, cfg, "out/qwen3_moe_hf")       # loadable by Qwen3MoeForCausalLM.from_pretrained
    model_cfg, sd = load_hf_checkpoint("out/qwen3_moe_hf")   # our ModelConfig + HF tensors
    model = build_model_from_hf("out/qwen3_moe_hf", fp4_cfg)  # our MoETransformer with those weights
    load_hf_shard(trainer.model, "out/qwen3_moe_hf")          # a sharded rank: only its own tensors

Writing is atomic: everything goes to a temporary sibling directory that is renamed into place
only when complete, so an interrupted save never leaves a half-written checkpoint under `out_dir`.
Saving writes one `model.safetensors` in the per-expert ("checkpoint") layout; loading also reads
Hub-style sharded checkpoints (`model.safetensors.index.json`) and the fused layout.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Mapping, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_fp4.training.checkpoint import replace_dir
from megatron_fp4.config import Config, FP4Config, ModelConfig
from megatron_fp4.integrations.hf.qwen3_moe import (from_hf_state_dict, hf_config_from_ours, ours_config_from_hf,
                                                    to_hf_state_dict)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _model_config(cfg) -> ModelConfig:
    if isinstance(cfg, ModelConfig):
        return cfg
    if isinstance(cfg, Config):
        return cfg.model
    raise ValueError(f"cfg must be a megatron_fp4 Config or ModelConfig, got {type(cfg).__name__}")


def check_out_dir(out_dir, overwrite: bool, flag: str = "overwrite=True") -> None:
    """Refuse an existing non-empty `out_dir` unless `overwrite`; `flag` is how the caller's
    interface spells the option (``--overwrite`` on the command line)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not overwrite:
        raise ValueError(f"{str(out_dir)!r} already exists and is not an empty directory; pass {flag} "
                         f"to replace it or choose a new output directory")


def save_hf_checkpoint(model, cfg, out_dir, dtype: Optional[torch.dtype] = None, overwrite: bool = False,
                       quantization_config: Optional[dict] = None) -> Path:
    """Write `model` as a Hugging Face Qwen3-MoE checkpoint (`config.json` + `model.safetensors`,
    per-expert layout) to `out_dir`, atomically. `cfg` is our Config or ModelConfig; `dtype`
    casts the tensors (default: as they are). An existing non-empty `out_dir` is replaced only
    with overwrite=True. `quantization_config` goes into config.json as that block (the vLLM
    plugin's FP4 recipe, `integrations.vllm.hf_quantization_config`). Returns the directory."""
    model_cfg = _model_config(cfg)
    out_dir = Path(out_dir)
    check_out_dir(out_dir, overwrite)
    hf_cfg = hf_config_from_ours(model_cfg)
    tensors = {}
    for key, t in to_hf_state_dict(model).items():
        t = t.to(dtype) if dtype is not None else t
        # Per-expert tensors are views into w13/w2; safetensors needs separate contiguous storage.
        tensors[key] = t.detach().to("cpu").contiguous().clone()
    saved_dtypes = {t.dtype for t in tensors.values()}
    if len(saved_dtypes) == 1:
        hf_cfg["dtype"] = hf_cfg["torch_dtype"] = str(saved_dtypes.pop()).replace("torch.", "")
    if quantization_config is not None:
        hf_cfg["quantization_config"] = quantization_config

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{str(index)!r} has no 'weight_map' mapping; it is not a safetensors shard index")
        files = [path / name for name in sorted(set(weight_map.values()))]
    elif (path / WEIGHTS_FILE).exists():
        files = [path / WEIGHTS_FILE]
    else:
        others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {others}: convert them to safetensors first)" if others else ""
        raise ValueError(f"{str(path)!r} has neither {WEIGHTS_FILE} nor {INDEX_FILE}{hint}")
    absent = [str(f) for f in files if not f.exists()]
    if absent:
        raise ValueError(f"checkpoint shards listed in {INDEX_FILE} are missing: {absent}")
    return files


class SafetensorsTensors(Mapping):
    """The tensors of a checkpoint's safetensors files by HF name, read lazily: a key's tensor is
    read from its file only when asked for (``sd[key]``), ``shape(key)`` reads the header alone and
    ``rows(key, lo, hi)`` only rows [lo, hi) (an expert-parallel rank's experts of a fused tensor).
    Nothing else is ever in memory, so a rank loading its shard never holds the full model."""

    def __init__(self, files: list[Path]):
        self._file: dict[str, Path] = {}
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key in self._file:
                        raise ValueError(f"tensor {key!r} appears in more than one shard of {str(file.parent)!r} "
                                         f"({self._file[key].name}, {file.name})")
                    self._file[key] = file

    def __getitem__(self, key: str) -> torch.Tensor:
        with safe_open(str(self._file[key]), framework="pt", device="cpu") as f:
            return f.get_tensor(key)

    def __iter__(self):
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)

    def __contains__(self, key) -> bool:
        return key in self._file

    def shape(self, key: str) -> tuple:
        with safe_open(str(self._file[key]), framework="pt", device="cpu") as f:
            return tuple(f.get_slice(key).get_shape())

    def rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        with safe_open(str(self._file[key]), framework="pt", device="cpu") as f:
            return f.get_slice(key)[lo:hi]


def load_hf_shard(model, path) -> None:
    """Load into `model` — one rank's part of it (pipeline chunks, local experts) or all of it —
    exactly the tensors it holds from the Hugging Face checkpoint at `path` (one file or Hub-style
    shards, either expert layout), reading each tensor or expert slice from safetensors on its own.
    The checkpoint's config must match ``model.cfg`` (the fields that shape the weights)."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(f"{str(path)!r} is not a Hugging Face checkpoint directory: {CONFIG_FILE} not found")
    theirs = ours_config_from_hf(json.loads((path / CONFIG_FILE).read_text()))
    fields = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts",
              "moe_ffn_hidden_size", "dense_layers", "tie_embeddings") + (("dense_ffn_hidden_size",)
                                                                          if model.cfg.dense_layers else ())
    differ = [f"model.{f}: ours {getattr(model.cfg, f)!r}, checkpoint {getattr(theirs, f)!r}"
              for f in fields if getattr(model.cfg, f) != getattr(theirs, f)]
    if differ:
        raise ValueError(f"{str(path)!r} holds another model ({'; '.join(differ)}); build the model from the "
                         f"checkpoint's own config (ours_config_from_hf)")
    from_hf_state_dict(model, SafetensorsTensors(_weight_files(path)), shard=True)


def load_hf_checkpoint(path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Qwen3-MoE checkpoint directory: (our ModelConfig, HF-named CPU tensors). Accepts a
    single `model.safetensors` or Hub-style shards with `model.safetensors.index.json`."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(f"{str(path)!r} is not a Hugging Face checkpoint directory: {CONFIG_FILE} not found")
    model_cfg = ours_config_from_hf(json.loads((path / CONFIG_FILE).read_text()))
    tensors = SafetensorsTensors(_weight_files(path))
    return model_cfg, {key: tensors[key] for key in tensors}


def build_model_from_hf(path, fp4_cfg: Optional[FP4Config] = None):
    """Our `MoETransformer` (fp32 parameters, on CPU) built from the checkpoint's config and
    loaded with its weights (strict). `fp4_cfg` None means the project default `FP4Config()`
    (experts in FP4, MoEResQ); pass `FP4Config(scope="none")` for the exact HF numerics."""
    from megatron_fp4.config_validate import _validate_fp4_shapes
    from megatron_fp4.model import MoETransformer

    model_cfg, sd = load_hf_checkpoint(path)
    fp4_cfg = FP4Config() if fp4_cfg is None else fp4_cfg
    _validate_fp4_shapes(Config(model=model_cfg, fp4=fp4_cfg))  # FP4 block sizes must divide the dims
    model = MoETransformer(model_cfg, fp4_cfg)
    from_hf_state_dict(model, sd)
    return model
