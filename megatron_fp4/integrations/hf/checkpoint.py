"""Hugging Face checkpoints on disk (every family of `families.py`): `config.json` + safetensors.

The family is the config.json's ``model_type`` when reading and ``model.family`` when writing.

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
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron_fp4.training.checkpoint.directory import check_not_input, check_replaceable_export, replace_dir
from megatron_fp4.config import Config, FP4Config, ModelConfig
from megatron_fp4.integrations.hf.families import (check_hf_state_dict, from_hf_state_dict, hf_config_from_ours,
                                                   ours_config_from_hf, to_hf_state_dict)
from megatron_fp4.integrations.hf.safetensors_header import TensorInfo, read_header

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _model_config(cfg) -> ModelConfig:
    if isinstance(cfg, ModelConfig):
        return cfg
    if isinstance(cfg, Config):
        return cfg.model
    raise ValueError(f"cfg must be a megatron_fp4 Config or ModelConfig, got {type(cfg).__name__}")


def check_out_dir(out_dir, overwrite: bool, flag: str = "overwrite=True", inputs=()) -> None:
    """Refuse an existing non-empty `out_dir` unless `overwrite`, one that is not a former export
    even then, and one that is, holds or lies inside one of `inputs` (the paths the export is made
    from); `flag` is how the caller's interface spells the option (``--overwrite`` on the command line)."""
    out_dir = Path(out_dir)
    check_not_input(out_dir, inputs)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        if not overwrite:
            raise ValueError(f"{str(out_dir)!r} already exists and is not an empty directory; pass {flag} "
                             f"to replace it or choose a new output directory")
        check_replaceable_export(out_dir)


def save_hf_checkpoint(model, cfg, out_dir, dtype: Optional[torch.dtype] = None, overwrite: bool = False,
                       quantization_config: Optional[dict] = None, inputs=(), mxfp4_experts: bool = False) -> Path:
    """Write `model` as a Hugging Face checkpoint of its family (`config.json` + `model.safetensors`,
    per-expert layout) to `out_dir`, atomically. `cfg` is our Config or ModelConfig; `dtype`
    casts the tensors (default: as they are). An existing non-empty `out_dir` is replaced only
    with overwrite=True. `quantization_config` goes into config.json as that block (the vLLM
    plugin's FP4 recipe, `integrations.vllm.hf_quantization_config`). `inputs`: paths the model was
    read from, which `out_dir` may not be, hold or lie inside. `mxfp4_experts` (GPT-OSS): the expert
    weights packed in MXFP4 as OpenAI's checkpoints hold them (they must lie on the MXFP4 grid).
    Returns the directory."""
    model_cfg = _model_config(cfg)
    out_dir = Path(out_dir)
    check_out_dir(out_dir, overwrite, inputs=inputs)
    hf_cfg = hf_config_from_ours(model_cfg)
    tensors = {}
    for key, t in to_hf_state_dict(model, mxfp4_experts=mxfp4_experts).items():
        t = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        # Per-expert tensors are views into w13/w2; safetensors needs separate contiguous storage.
        tensors[key] = t.detach().to("cpu").contiguous().clone()
    saved_dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(saved_dtypes) == 1:
        hf_cfg["dtype"] = hf_cfg["torch_dtype"] = str(saved_dtypes.pop()).replace("torch.", "")
    if mxfp4_experts:  # what transformers reads OpenAI's packed experts by
        quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    if quantization_config is not None:
        hf_cfg["quantization_config"] = quantization_config

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
        replace_dir(tmp, out_dir, inputs)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def read_hf_config(path: Path) -> ModelConfig:
    """Our ModelConfig from the checkpoint directory's config.json; every problem is one ValueError
    naming the file and the field."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"{str(path)!r} is not a Hugging Face checkpoint directory: {CONFIG_FILE} not found")
    try:
        hf_cfg = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{str(file)!r}: cannot read it as JSON ({type(err).__name__}: {str(err):.200})") from None
    try:
        return ours_config_from_hf(hf_cfg)
    except ValueError as err:
        raise ValueError(f"{str(file)!r}: {err}") from None


def _read_index(index: Path) -> list[str]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{str(index)!r}: cannot read it as JSON ({type(err).__name__}: {str(err):.200})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{str(index)!r} has no 'weight_map' mapping of tensor names to shard file names; it is "
                         f"not a safetensors shard index")
    return sorted(set(weight_map.values()))


def _confined(path: Path, name: str) -> Path:
    """`path / name`, refused unless it stays inside the checkpoint directory `path` once every
    symlink is resolved (a Hub cache snapshot's links into its own ``blobs/`` are allowed)."""
    root = path.resolve()
    file = (path / name).resolve()
    allowed = [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])
    if Path(name).is_absolute() or ".." in Path(name).parts or not any(file.is_relative_to(a) for a in allowed):
        raise ValueError(f"checkpoint file {name!r} of {str(path)!r} is outside that directory (it resolves to "
                         f"{str(file)!r}); {INDEX_FILE} may only name files in the checkpoint directory")
    return path / name


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.exists():
        files = [_confined(path, name) for name in _read_index(index)]
    elif (path / WEIGHTS_FILE).exists():
        files = [_confined(path, WEIGHTS_FILE)]
    else:
        others = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {others}: convert them to safetensors first)" if others else ""
        raise ValueError(f"{str(path)!r} has neither {WEIGHTS_FILE} nor {INDEX_FILE}{hint}")
    absent = [str(f) for f in files if not f.is_file()]
    if absent:
        raise ValueError(f"checkpoint shards listed in {INDEX_FILE} are missing: {absent}")
    return files


class SafetensorsTensors(Mapping):
    """The tensors of a checkpoint's safetensors files by HF name, read lazily: a key's tensor is
    read from its file only when asked for (``sd[key]``), ``shape(key)`` and ``dtype(key)`` come from
    the header alone (checked by `read_header` before the safetensors library opens the file) and
    ``rows(key, lo, hi)`` reads only rows [lo, hi) (an expert-parallel rank's experts of a fused
    tensor). Nothing else is ever in memory, so a rank loading its shard never holds the full model."""

    def __init__(self, files: list[Path]):
        self._file: dict[str, Path] = {}
        self._info: dict[str, TensorInfo] = {}
        for file in files:
            for key, info in read_header(file).items():
                if key in self._file:
                    raise ValueError(f"tensor {key!r} appears in more than one shard of {str(file.parent)!r} "
                                     f"({self._file[key].name}, {file.name})")
                self._file[key], self._info[key] = file, info

    def _read(self, key: str, get):
        try:
            with safe_open(str(self._file[key]), framework="pt", device="cpu") as f:
                return get(f)
        except SafetensorError as err:  # e.g. the file changed after its header was checked
            raise ValueError(f"{str(self._file[key])!r}: safetensors cannot read tensor {key!r} ({err})") from None

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._read(key, lambda f: f.get_tensor(key))

    def __iter__(self):
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)

    def __contains__(self, key) -> bool:
        return key in self._file

    def shape(self, key: str) -> tuple:
        return self._info[key].shape

    def dtype(self, key: str) -> str:
        return self._info[key].dtype

    def rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        return self._read(key, lambda f: f.get_slice(key)[lo:hi])


def _check_against_headers(path: Path, model_cfg: ModelConfig, tensors: SafetensorsTensors) -> None:
    """The checkpoint's tensors match the model `model_cfg` describes (names, shapes, float dtypes),
    checked on a meta-device model against the headers alone: nothing is allocated or read, so a
    config.json claiming sizes its files do not hold is refused before the model is built."""
    from megatron_fp4.model import MoETransformer

    with torch.device("meta"):
        model = MoETransformer(model_cfg, FP4Config(scope="none"))
    try:
        check_hf_state_dict(model, tensors)
    except ValueError as err:
        raise ValueError(f"{str(path / CONFIG_FILE)!r} describes another model than its safetensors files hold: "
                         f"{err}") from None


def load_hf_shard(model, path) -> None:
    """Load into `model` — one rank's part of it (pipeline chunks, local experts) or all of it —
    exactly the tensors it holds from the Hugging Face checkpoint at `path` (one file or Hub-style
    shards, either expert layout), reading each tensor or expert slice from safetensors on its own.
    The checkpoint's config must match ``model.cfg`` (the fields that shape the weights)."""
    path = Path(path)
    theirs = read_hf_config(path)
    fields = ("family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts",
              "moe_ffn_hidden_size", "dense_layers", "tie_embeddings") + (("dense_ffn_hidden_size",)
                                                                          if model.cfg.dense_layers else ())
    differ = [f"model.{f}: ours {getattr(model.cfg, f)!r}, checkpoint {getattr(theirs, f)!r}"
              for f in fields if getattr(model.cfg, f) != getattr(theirs, f)]
    if differ:
        raise ValueError(f"{str(path)!r} holds another model ({'; '.join(differ)}); build the model from the "
                         f"checkpoint's own config (ours_config_from_hf)")
    from_hf_state_dict(model, SafetensorsTensors(_weight_files(path)), shard=True)


def load_hf_checkpoint(path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a checkpoint directory of any supported family: (our ModelConfig, HF-named CPU tensors). Accepts a
    single `model.safetensors` or Hub-style shards with `model.safetensors.index.json`. The tensors
    must be those of the config's model (names, shapes, float dtypes: checked on the headers before
    any tensor is read)."""
    path = Path(path)
    model_cfg = read_hf_config(path)
    tensors = SafetensorsTensors(_weight_files(path))
    _check_against_headers(path, model_cfg, tensors)
    return model_cfg, {key: tensors[key] for key in tensors}


def build_model_from_hf(path, fp4_cfg: Optional[FP4Config] = None):
    """Our `MoETransformer` (fp32 parameters, on CPU) built from the checkpoint's config and
    loaded with its weights (strict). `fp4_cfg` None means the project default `FP4Config()`
    (experts in FP4, MoEResQ); pass `FP4Config(scope="none")` for the exact HF numerics."""
    from megatron_fp4.config.validate import _validate_fp4_shapes
    from megatron_fp4.model import MoETransformer

    path = Path(path)
    model_cfg = read_hf_config(path)
    fp4_cfg = FP4Config() if fp4_cfg is None else fp4_cfg
    _validate_fp4_shapes(Config(model=model_cfg, fp4=fp4_cfg))  # FP4 block sizes must divide the dims
    tensors = SafetensorsTensors(_weight_files(path))
    _check_against_headers(path, model_cfg, tensors)  # before the model is allocated
    model = MoETransformer(model_cfg, fp4_cfg)
    from_hf_state_dict(model, tensors)
    return model
