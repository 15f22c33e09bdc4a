"""Sizes in DCP's `.metadata` checked before anything is allocated for them (`checkpoint/dcp.py`).

`.metadata` is read as data (`checkpoint/dcp_metadata.py`) but its sizes are still claims: a crafted or
damaged one (its checksum made consistent) could size a tensor at terabytes. Every stored chunk
must lie inside its shard file, each tensor must have its bytes really stored, and where the
model is known (resume; `tools/convert_checkpoint.py` builds it from meta.json's config on the
meta device) each tensor's shape must be the model's.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from megatron_fp4.training.checkpoint import directory as ckpt
from megatron_fp4.training.checkpoint.dcp_metadata import METADATA_FILE


def _tensor_bytes(md) -> int:
    size = getattr(md, "size", None)
    if not isinstance(size, torch.Size) or getattr(md, "properties", None) is None:
        return 0  # bytes (not tensor) entries are read as what they are
    return size.numel() * torch.empty((), dtype=md.properties.dtype).element_size()


def check_declared_bytes(metadata, step_dir: Path, keys=None) -> None:
    """Sizes in `.metadata` against the files (before anything is allocated): every stored chunk
    must lie inside its shard file, and each tensor (of `keys`, default all) must have at least its
    own bytes stored, so a crafted or damaged `.metadata` cannot size one at terabytes."""
    stored: dict = {}
    for index, info in metadata.storage_data.items():
        path = step_dir / str(info.relative_path)
        if path.parent != step_dir or not path.is_file():
            raise ckpt.CorruptCheckpointError(f"{step_dir / METADATA_FILE} places {index.fqn} in "
                                              f"{str(info.relative_path)[:80]!r}, not a file of the step; it is "
                                              f"damaged")
        if info.offset < 0 or info.length < 0 or info.offset + info.length > path.stat().st_size:
            raise ckpt.CorruptCheckpointError(f"{path} is truncated: {METADATA_FILE} places {index.fqn} at bytes "
                                              f"{info.offset}..{info.offset + info.length} of a {path.stat().st_size}"
                                              f"-byte file; the checkpoint is damaged")
        stored[index.fqn] = stored.get(index.fqn, 0) + info.length
    for key, md in metadata.state_dict_metadata.items():
        if (keys is None or key in keys) and _tensor_bytes(md) > stored.get(key, 0):
            raise ckpt.CorruptCheckpointError(f"{step_dir / METADATA_FILE} sizes {key} as {tuple(md.size)} "
                                              f"({_tensor_bytes(md):,} bytes) but its files store "
                                              f"{stored.get(key, 0):,} "
                                              f"bytes of it; the metadata is damaged or crafted")


def model_key_shapes(keys, full: dict) -> dict:
    """DCP key -> the shape the model gives it: `model/<name>` the full parameter's, a per-expert
    `model/<name>/expert<e>` one expert's slice (None where the model has no such tensor)."""
    out = {}
    for key in keys:
        name = key[len("model/"):]
        m = re.match(r"^(?P<name>.+)/expert(?P<e>\d+)$", name)
        shape = full.get(m["name"] if m else name)
        if m and shape is not None:
            shape = tuple(shape)[1:] if int(m["e"]) < tuple(shape)[0] else None
        out[key] = None if shape is None else tuple(shape)
    return out


def check_declared_shapes(declared: dict, expected: dict, step_dir: Path) -> None:
    """Each tensor of `.metadata` (key -> its metadata) against `expected` (key -> shape)."""
    problems = []
    for key, md in declared.items():
        size, shape = tuple(getattr(md, "size", ()) or ()), expected.get(key)
        if shape is None or size != tuple(shape):
            problems.append(f"{key}: checkpoint {size} vs model {shape}")
    if problems:
        raise ckpt.CheckpointError(f"checkpoint {step_dir} was written for a different model ({len(problems)} "
                                   f"tensor(s) differ, e.g. {'; '.join(problems[:3])}). Use the config it was "
                                   f"trained with (its config.yaml; meta.json's config may have been edited)")
