"""Expert-tensor-parallel shards in DCP checkpoints (`checkpoint/dcp.py`).

Under ``parallel.etp`` an etp rank holds slice ``i`` of every expert's ffn dim
(`GroupedExperts.shard_ffn`, ``param.etp_shard = (dim, index)``): of w2 [E, H, F] a contiguous
block of columns, of w13 [E, 2F, H] (gate rows, then up rows) two blocks — its gate rows and its
up rows. So w13 is stored as its two logical halves, ``model/<name>/gate`` and ``model/<name>/up``
(each [E, F, H], per global expert under ep ``model/<name>/expert<e>/gate``), and each half, like
w2 under its usual key, as a DTensor chunk of the global tensor over the etp (= tp) axis. DCP
records the chunks' global offsets, so the weights reshard across etp (etp2 → etp1 and back, and
`read_full_model_state` concatenates the halves back into w13 for HF conversion); a checkpoint
with a whole w13 (saved at etp 1) loads into etp ranks too (`load_entries`: reads into
temporaries, copied into the parameters after the read).

The AdamW state of an etp shard reshards as tp's (`checkpoint/dcp_state.py`: w13's gate and up rows
are two column blocks of its 2-D fold); in a checkpoint written before session 13 it is keyed by
the shard (``optim/<name>/etp<i>/...``) and loads only at the etp size it was saved with
(`check_etp_layout`).
"""
from __future__ import annotations

import torch

from megatron_fp4.training.checkpoint import directory as ckpt
from megatron_fp4.training.checkpoint.dcp_checks import model_key_shapes
from megatron_fp4.training.checkpoint.dcp_tp import check_tp_layout

HALVES = ("gate", "up")


def _is_w13(name: str, p) -> bool:
    return name.rsplit(".", 1)[-1] == "w13" and p.dim() == 3  # GroupedExperts' stacked [E, 2F, H]


def _ffn_dim(name: str, p, lead: int) -> int:
    """The ffn dim of `p` (or of one expert's slice, `lead` = 1): w13's rows, w2's columns."""
    shard = getattr(p, "etp_shard", None)
    return (shard[0] if shard is not None else (1 if _is_w13(name, p) else 2)) - lead


def handles(name: str, p, key: str, saved: dict | None) -> bool:
    """Whether `p`'s entry `key` is this module's: an etp shard, or (on load, `saved` = the
    checkpoint's key -> metadata) a whole w13 whose checkpoint holds gate / up halves."""
    if getattr(p, "etp_shard", None) is not None:
        return True
    return saved is not None and _is_w13(name, p) and f"{key}/gate" in saved


def _chunk(x: torch.Tensor, d: int, mesh):
    """`x` as this rank's chunk (dim `d`) of a global tensor over the etp axis (= the tp axis)."""
    from torch.distributed.tensor import DTensor, Shard

    assert mesh.etp == mesh.tp, "the etp group is the tp group"
    return DTensor.from_local(x.contiguous(), mesh.tp_device_mesh(1), [Shard(d)], run_check=False)


def save_entries(name: str, p, key: str, t: torch.Tensor, lead: int, mesh) -> dict:
    """`t` (`p` or one expert of it) as DTensor chunks of the global tensor(s) over the etp axis."""
    dim, index = p.etp_shard
    d = dim - lead
    f = t.shape[d] // (2 if _is_w13(name, p) else 1)
    assert int(index[0]) == mesh.coord("tp") * f, "an etp shard must be the tp rank's slice, in rank order"
    if _is_w13(name, p):
        return {f"{key}/{half}": _chunk(t.narrow(d, i * f, f), d, mesh) for i, half in enumerate(HALVES)}
    return {key: _chunk(t, d, mesh)}


def load_entries(name: str, p, key: str, t: torch.Tensor, lead: int, mesh, saved: dict, copies: list) -> dict:
    """What to read for `t` (`p` or one expert of it), and in `copies` the copy of it into `t`, run
    after the read: an etp shard reads its own chunks (w13: of the halves); the other two cases
    read whole global tensors into temporaries — a whole w13 (saved at etp 1) that an etp rank
    slices, and the halves of a w13 this rank holds whole (etp 1)."""
    d, w13 = _ffn_dim(name, p, lead), _is_w13(name, p)
    sharded, halves = getattr(p, "etp_shard", None) is not None, w13 and f"{key}/gate" in saved
    keys = [f"{key}/{half}" for half in HALVES] if halves else [key]
    if sharded and (halves or not w13):
        out = {k: _chunk(torch.empty_like(x), d, mesh) for k, x in zip(keys, t.chunk(len(keys), d))}
        copies.append(lambda: t.copy_(torch.cat([out[k].to_local() for k in keys], d)))
        return out
    shape = list(t.shape)
    shape[d] = shape[d] * mesh.etp if sharded else shape[d] // len(keys)
    out = {k: torch.empty(shape, dtype=t.dtype) for k in keys}
    index = p.etp_shard[1] if sharded else None

    def copy():
        whole = torch.cat([out[k] for k in keys], d)
        t.copy_(whole if index is None else whole.index_select(d, index))
    copies.append(copy)
    return out


def merge_halves(full: dict) -> dict:
    """`read_full_model_state`'s tensors with every ``<name>/gate`` + ``<name>/up`` pair
    concatenated back into ``<name>`` (w13's rows: gate, then up)."""
    out = {}
    for name, tensor in full.items():
        stem, _, half = name.rpartition("/")
        if half not in HALVES:
            out[name] = tensor
        elif half == "gate":
            if f"{stem}/up" not in full:
                raise ckpt.CheckpointError(f"checkpoint holds {name} without {stem}/up; it was not fully written")
            out[stem] = torch.cat([tensor, full[f"{stem}/up"]], -2)
        elif f"{stem}/gate" not in full:
            raise ckpt.CheckpointError(f"checkpoint holds {name} without {stem}/gate; it was not fully written")
    return out


def key_shapes(keys, full: dict) -> dict:
    """`model_key_shapes` with w13's halves: a ``.../gate`` or ``.../up`` key has the shape of its
    w13 (or of one expert of it) with half the rows."""
    out = {}
    for key in keys:
        stem, _, half = key.rpartition("/")
        if half in HALVES:
            shape = model_key_shapes([stem], full)[stem]
            out[key] = None if shape is None else (*shape[:-2], shape[-2] // 2, shape[-1])
        else:
            out.update(model_key_shapes([key], full))
    return out


def optim_name(name: str, p, mesh, stem: str) -> str:
    """`stem` (the key stem of `p`'s optimizer pieces before session 13), plus its etp shard when it has one."""
    return stem if getattr(p, "etp_shard", None) is None else f"{stem}/etp{mesh.coord('tp')}"


def check_etp_layout(meta: dict, mesh, has_state: bool, where) -> None:
    """Weights reshard across etp; the AdamW state of etp shards in a checkpoint written before
    session 13 does not: refuse that mismatch."""
    check_tp_layout(meta, mesh, has_state, where, "etp", "expert-tensor-parallel")
