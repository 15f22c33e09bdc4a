"""Tensor-parallel shards in DCP checkpoints (`checkpoint/dcp.py`).

A weight `parallel/tensor_parallel.py` cut (``param.tp_shard = (dim, index)``: a contiguous block
of `dim`, the tp rank's in rank order) is stored as what it is, a chunk of the *global* tensor: a
DTensor over the mesh's tp axis with placement ``Shard(dim)`` (a kv head that ``tp_replicas``
ranks share: ``Shard(dim), Replicate()`` over the tp axis unflattened as heads × replicas). DCP
records every chunk's global offsets, so the weights load into any tp size (tp2 → tp1 or back,
also `read_full_model_state` without a process group) and dp / pp replicas are written once.

The AdamW state of a cut weight reshards too (`checkpoint/dcp_state.py`). Checkpoints written
before session 13 keyed it by the shard (``optim/<name>/tp<i>/...``, flat ranges of the local
shard, which a column cut's strided rows keep from being placed in the global tensor): those load
only at the tp size they were saved with (`check_tp_layout`).
"""
from __future__ import annotations

import torch

from megatron_fp4.training.checkpoint import directory as ckpt


def tp_replicas_needed(model_cfg, tp: int) -> list[int]:
    """The tp meshes a checkpoint of this model uses: 1 (plain shards), and tp / num_kv_heads when
    kv heads are replicated (the same on every rank: the meshes are built collectively)."""
    if tp == 1:
        return []
    return [1] + ([tp // model_cfg.num_kv_heads] if model_cfg.num_kv_heads < tp else [])


def shard_index(p, tp_rank: int) -> int:
    """Which of the distinct shards of `p` this tp rank holds (replicated kv heads: several ranks one)."""
    return tp_rank // getattr(p, "tp_replicas", 1)


def tp_entry(p, mesh) -> torch.Tensor:
    """`p`'s data for DCP: itself when whole, else a DTensor chunk of the global weight (same storage,
    so a load writes into the parameter)."""
    shard = getattr(p, "tp_shard", None)
    if shard is None:
        return p.data
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dim, index = shard
    replicas = getattr(p, "tp_replicas", 1)
    start, n = int(index[0]), index.numel()
    assert torch.equal(index, torch.arange(start, start + n)) and start == shard_index(p, mesh.coord("tp")) * n, \
        "a tp shard must be the rank's contiguous block, in rank order"
    placements = [Shard(dim)] if replicas == 1 else [Shard(dim), Replicate()]
    return DTensor.from_local(p.data, mesh.tp_device_mesh(replicas), placements, run_check=False)


def optim_name(name: str, p, mesh) -> str:
    """The key stem of `p`'s optimizer pieces in a checkpoint written before session 13: its name,
    plus its shard under tensor parallelism."""
    return name if getattr(p, "tp_shard", None) is None else f"{name}/tp{shard_index(p, mesh.coord('tp'))}"


def check_tp_layout(meta: dict, mesh, has_state: bool, where, axis: str = "tp",
                    what: str = "tensor-parallel") -> None:
    """Weights reshard across `axis` (tp, or etp: `dcp_etp`); the AdamW state of weights cut along
    it in a checkpoint written before session 13 does not: refuse that mismatch clearly."""
    saved, here = int((meta.get("layout") or {}).get(axis, 1) or 1), getattr(mesh, axis)
    if has_state and saved != here:
        raise ckpt.CheckpointError(
            f"checkpoint {where} was saved at parallel.{axis}={saved} with optimizer state, this run has "
            f"parallel.{axis}={here}: the AdamW state of {what} weights does not reshard across {axis}; "
            f"resume with parallel.{axis}={saved} (the weights alone reshard: tools/convert_checkpoint.py "
            f"reads them at any size)")
