"""Single-process checkpoints, written atomically.

Layout::

    <dir>/step_00000100/state.pt    model, optimizer, step, sampler position, RNG states
    <dir>/step_00000100/meta.json   step, format version, the config that wrote it
    <dir>/latest                    name of the newest complete step directory

A step directory is written under a temporary name and renamed into place only when complete, and
`latest` is replaced with `os.replace`, so a crash mid-save never leaves a checkpoint that loads
half-written state. (The sharded, reshardable DCP checkpoint of the parallel trainer lives beside
this one and uses the same directory layout.)
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Optional

import torch
import yaml

FORMAT_VERSION = 1
STATE_FILE, META_FILE, LATEST_FILE = "state.pt", "meta.json", "latest"

# Model fields that must match between a checkpoint and the config resuming from it.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts",
                "top_k", "moe_ffn_hidden_size", "num_shared_experts", "shared_expert_ffn_hidden_size",
                "dense_layers", "dense_ffn_hidden_size", "tie_embeddings")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the path and what to do."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def write_atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def replace_dir(src: Path, dst: Path) -> None:
    """Put the completely written directory `src` at `dst`. An existing `dst` is first renamed
    aside, so at every instant `dst` is either the old complete tree or the new one."""
    old = None
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def commit_step_dir(tmp_dir: Path, final_dir: Path, root: Path) -> None:
    """Rename a completely written temp dir into place and point `latest` at it."""
    replace_dir(tmp_dir, final_dir)
    write_atomic_text(root / LATEST_FILE, final_dir.name + "\n")


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: str | Path, step: int, state: dict, config: dict, kind: str = "single") -> Path:
    """Write `state` (tensors and plain Python values) as step `step` under `root`, atomically.

    kind: "single" (a full training state) or "weights" (model only, e.g. converted from HF: the
    trainer starts from these weights at step 0). The config is also written as `config.yaml`, a
    file that `--config` accepts."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    torch.save(state, tmp / STATE_FILE)
    meta = {"format_version": FORMAT_VERSION, "step": step, "kind": kind, "config": config}
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2, default=str))
    (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    commit_step_dir(tmp, final, root)
    return final


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory, or a root holding `latest` → the step directory to load."""
    path = Path(path)
    if (path / META_FILE).exists():
        return path
    if (path / LATEST_FILE).exists():
        step = path / (path / LATEST_FILE).read_text().strip()
        if not (step / META_FILE).exists():
            raise CheckpointError(f"{path}/latest points at {step.name}, which is incomplete or missing; "
                                  f"pass one of the step_* directories in {path} explicitly")
        return step
    raise CheckpointError(f"{path} is not a megatron-fp4 checkpoint (no {META_FILE} and no {LATEST_FILE}); "
                          f"pass a step_* directory or the checkpoint.dir that holds them")


def read_meta(step_dir: Path) -> dict:
    meta = json.loads((step_dir / META_FILE).read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{step_dir}: checkpoint format {meta.get('format_version')} is not supported "
                              f"(this version reads {FORMAT_VERSION})")
    return meta


def check_compatible(meta: dict, model_cfg, where: Path) -> None:
    """Refuse to load a checkpoint of a differently shaped model, naming every differing field."""
    saved = meta.get("config", {}).get("model", {})
    diffs = [f"model.{k}: checkpoint {saved.get(k)!r} vs config {getattr(model_cfg, k)!r}"
             for k in SHAPE_FIELDS if k in saved and saved[k] != getattr(model_cfg, k)]
    if diffs:
        raise CheckpointError(f"checkpoint {where} was written for a different model; " + "; ".join(diffs)
                              + ". Use the config it was trained with (see its meta.json)")


def load_checkpoint(path: str | Path, model_cfg=None) -> tuple[dict, dict]:
    """Return (state, meta) of the checkpoint at `path` after validating it."""
    step_dir = resolve_checkpoint(path)
    meta = read_meta(step_dir)
    if model_cfg is not None:
        check_compatible(meta, model_cfg, step_dir)
    if meta.get("kind") not in ("single", "weights"):
        raise CheckpointError(f"{step_dir} is a sharded ({meta.get('kind')}) checkpoint; load it with the parallel "
                              f"trainer (or convert it with tools/convert_checkpoint.py)")
    state = torch.load(step_dir / STATE_FILE, map_location="cpu", weights_only=False)
    return state, meta


def latest_step(root: str | Path) -> Optional[int]:
    try:
        return read_meta(resolve_checkpoint(root))["step"]
    except (CheckpointError, FileNotFoundError):
        return None
