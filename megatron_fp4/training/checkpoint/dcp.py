"""Sharded checkpoints of the parallel trainer with torch.distributed.checkpoint (DCP), reshardable.

Same directory layout and atomicity as `training/checkpoint/directory.py` (temp dir, rename, ``latest``;
``meta.json`` with ``kind: "dcp"``). What DCP stores, all by *global* names, so a checkpoint loads
into any pp / dp (and ZeRO stage) layout:

- ``model/<param name>``: the full parameter (replicated across dp; DCP writes it once). Expert
  weights under expert parallelism are stored per global expert, ``model/<name>/expert<e>``
  (they reshard across ep: an ep 1 rank reads every expert's key, an ep rank of an ep 1
  checkpoint the whole tensor into a temporary and keeps its experts);
  tensor-parallel shards as DTensor chunks of the global weight (`checkpoint/dcp_tp.py`: they reshard across tp),
  expert-tensor-parallel ones too, w13 as its gate and up halves (`checkpoint/dcp_etp.py`: they reshard across etp);
- ``optim/...``: each rank's ZeRO ranges of every parameter's AdamW state (fp32 master and
  moments), keyed by the *global* parameter so that any layout's ranks find their own ranges in
  them (`checkpoint/dcp_optim.py`; tp / etp-cut weights' as chunks of a global 2-D tensor,
  `checkpoint/dcp_state.py`). Nothing is gathered on save;
- ``rng/<rank>``: each rank's torch RNG state (restored where the rank exists in the new layout).

Step, sampler position (counted in global samples) and the Adam step count live in meta.json,
with the sha256 of every file (each rank hashes and fsyncs a share of them on save and checks the
same share on load; the verdict is all-reduced, so every rank accepts or skips a step together).
DCP's `.metadata` is only ever read through `dcp_metadata.SafeFileSystemReader` (no plain pickle).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from megatron_fp4.parallel.wire import broadcast_json
from megatron_fp4.training.checkpoint import directory as ckpt
from megatron_fp4.training.checkpoint import files
from megatron_fp4.training.checkpoint import dcp_etp, dcp_optim, dcp_state
from megatron_fp4.training.checkpoint.dcp_checks import check_declared_bytes, check_declared_shapes
from megatron_fp4.training.checkpoint.dcp_metadata import METADATA_FILE, SafeFileSystemReader
from megatron_fp4.training.checkpoint.dcp_tp import check_tp_layout, tp_entry, tp_replicas_needed



def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier(group) -> None:
    if _is_dist():
        dist.barrier(group=group)


def _rank() -> int:
    return dist.get_rank() if _is_dist() else 0


def _world() -> int:
    return dist.get_world_size() if _is_dist() else 1


def _from_rank0(obj, group, device):
    """Rank 0's `obj` (JSON) on every rank of `group` (the mesh's world group: `parallel.wire`)."""
    return broadcast_json(obj, 0, group, device) if _is_dist() else obj


def _shared_checksums(step_dir: Path, group, device) -> dict:
    """sha256 of every file DCP wrote (rank 0 lists them; each rank hashes and fsyncs its share)."""
    names = _from_rank0(files.data_files(step_dir) if _rank() == 0 else None, group, device)
    digests = torch.zeros(len(names), 32, dtype=torch.int64, device=device)
    for i in range(_rank(), len(names), _world()):
        digests[i] = torch.tensor(list(bytes.fromhex(files.file_digest(step_dir / names[i], sync=True))))
    if _is_dist():
        dist.all_reduce(digests, group=group)  # each row is filled by exactly one rank
    return {name: bytes(d.tolist()).hex() for name, d in zip(names, digests.cpu())}


def _verify_shared(step_dir: Path, meta: dict, group, device) -> None:
    """Each rank checks its share of the files against meta.json; all raise if any share fails."""
    sums = ckpt.expected_files(step_dir, meta)
    names = sorted(sums)
    bad = torch.zeros(len(names), dtype=torch.int64, device=device)
    for i in range(_rank(), len(names), _world()):
        bad[i] = int(bool(files.check_files(step_dir, sums, [names[i]])))
    if _is_dist():
        dist.all_reduce(bad, group=group)
    failed = [name for name, b in zip(names, bad.cpu().tolist()) if b]
    if failed:
        raise ckpt.CorruptCheckpointError(f"{step_dir}: {failed} missing or failing their sha256 check "
                                          f"(damaged or truncated)")


def _model_entries(model, mesh, saved: Optional[dict] = None, copies: Optional[list] = None) -> dict:
    """DCP key -> tensor of every weight; on load (`saved`: the checkpoint's key -> metadata) expert
    weights take the form the checkpoint has (per global expert or whole, whatever the ep), etp
    weights and experts of a whole tensor get temporaries, and `copies` the copies of their slices,
    to run after the read."""
    info = dcp_optim.expert_info(model)
    for replicas in tp_replicas_needed(model.cfg, mesh.tp):  # collective: every rank, same order
        mesh.tp_device_mesh(replicas)
    out = {}
    for name, p in model.named_parameters():
        per_expert = id(p) in info and (mesh.ep > 1 if saved is None else _saved_per_expert(name, saved))
        if per_expert:
            offset, _ = info[id(p)]
            pieces = [(f"model/{name}/expert{offset + e}", p.data[e], 1) for e in range(p.shape[0])]
        elif id(p) in info and mesh.ep > 1 and getattr(p, "etp_shard", None) is None:
            out[f"model/{name}"] = _expert_slice_from_whole(p, info[id(p)][0], model.cfg.num_experts, copies)
            continue
        else:
            pieces = [(f"model/{name}", p.data, 0)]
        for key, t, lead in pieces:
            if not dcp_etp.handles(name, p, key, saved):
                out[key] = t if lead else tp_entry(p, mesh)
            elif saved is None:
                out.update(dcp_etp.save_entries(name, p, key, t, lead, mesh))
            else:
                out.update(dcp_etp.load_entries(name, p, key, t, lead, mesh, saved, copies))
    for name, b in model.named_buffers():  # aux-loss-free balancing's router bias (replicated, like the router)
        if name.endswith(".mlp.router.expert_bias"):
            out[f"model/{name}"] = b
    return out


def _saved_per_expert(name: str, saved: dict) -> bool:
    """Whether the checkpoint stores expert weight `name` per global expert (saved under ep > 1)."""
    return f"model/{name}/expert0" in saved or f"model/{name}/expert0/gate" in saved


def _expert_slice_from_whole(p, offset: int, num_experts: int, copies: list) -> torch.Tensor:
    """An expert weight this ep rank holds experts ``offset..`` of, from a checkpoint saved at ep 1
    (one tensor of every expert): read into a temporary of the global shape (a checkpoint of
    another shape is refused by `check_declared_shapes` before the read), the rank's experts copied
    into `p` after it."""
    whole = torch.empty((num_experts, *p.shape[1:]), dtype=p.dtype)
    copies.append(lambda: p.data.copy_(whole[offset:offset + p.shape[0]]))
    return whole


def save(root: str | Path, trainer) -> Path:
    """Collective: every rank writes its shard of step `trainer.step` under `root`, atomically."""
    root, device, group = Path(root), trainer.mesh.device, trainer.mesh.group("world")
    final = root / ckpt.step_dir_name(trainer.step)
    tmp_name = ""
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if ckpt.begin_save(root, final):  # else an intact step of that number is kept, never replaced
            tmp_name = files.temp_name(final.name)
            (root / tmp_name).mkdir()
    tmp_name = _from_rank0(tmp_name, group, device)
    if not tmp_name:
        return final
    tmp = root / tmp_name
    _barrier(group)
    fresh = not trainer.optimizer.buffers or trainer.optimizer.adam_state(0)["step"] == 0  # masters == params
    state = {**_model_entries(trainer.model, trainer.mesh), **({} if fresh else dcp_optim.optim_entries(trainer)),
             f"rng/{_rank()}": torch.get_rng_state()}
    try:
        dcp.save(state, storage_writer=_Writer(str(tmp)), planner=dcp_state.SavePlanner(),
                 no_dist=not _is_dist())
    except (Exception, CheckpointException) as err:  # every rank gets DCP's verdict of the write
        raise _save_failed(root, tmp, trainer.step, err, sync=True, group=group) from None
    _barrier(group)
    sums = _shared_checksums(tmp, group, device)
    problem = ""
    if _rank() == 0:
        p = trainer.cfg.parallel
        meta = {"format_version": ckpt.FORMAT_VERSION, "step": trainer.step, "kind": "dcp",
                "adam_step": trainer.optimizer.adam_state(0)["step"] if trainer.optimizer.buffers else 0.0,
                "sampler": trainer.sampler.state_dict() if trainer.sampler else None,
                "layout": {"pp": trainer.mesh.pp, "dp": trainer.mesh.dp, "ep": trainer.mesh.ep, "tp": trainer.mesh.tp,
                           "etp": trainer.mesh.etp, "cp": trainer.mesh.cp,
                           "virtual_stages": p.virtual_stages, "zero_stage": p.zero_stage},
                "config": trainer.cfg.to_dict()}
        try:
            ckpt.write_meta(tmp, meta, sums)
            ckpt.commit_step_dir(tmp, final, root, trainer.cfg.checkpoint.keep_last)
        except OSError as err:
            problem = str(_save_failed(root, tmp, trainer.step, err, sync=False))
    problem = _from_rank0(problem, group, device)  # every rank raises, or none does (no rank waits forever)
    if problem:
        raise ckpt.CheckpointError(problem)
    return final


class _Writer(FileSystemWriter):
    """DCP's file writer, reporting a failed write as the OSError behind it: torch.save turns one
    into a RuntimeError whose context (the errno) would not survive DCP's gather to the other ranks."""

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception as err:
            cause = ckpt.os_error_in(err)
            if cause is None:
                raise
            raise OSError(cause.errno, cause.strerror) from None


def _save_failed(root: Path, tmp: Path, step: int, err: BaseException, sync: bool, group=None) -> Exception:
    """A save that failed writing: rank 0 removes the temp dir; an OSError behind it (a full disk)
    becomes the one-line CheckpointError naming the intact step, anything else is raised as is."""
    cause = next(iter(getattr(err, "failures", {}).values()), err)  # DCP: rank -> exception (or with traceback)
    cause = cause[0] if isinstance(cause, tuple) else cause
    if sync:
        _barrier(group)  # every rank is done with the temp dir before rank 0 removes it
    if _rank() == 0:
        files.remove(tmp)
    if sync:
        _barrier(group)  # and no rank returns while the temp dir is still there
    os_error = ckpt.os_error_in(cause) if isinstance(cause, BaseException) else None
    return ckpt.save_failed(root, step, os_error) if os_error is not None else err


def _read_shards(state: dict, step_dir: Path, no_dist: bool) -> None:
    """dcp.load into `state` through the safe reader; a failure to read a shard is a damaged step."""
    try:
        with torch.no_grad():
            dcp.load(state, storage_reader=SafeFileSystemReader(str(step_dir)), planner=dcp_state.LoadPlanner(),
                     no_dist=no_dist)
    except ckpt.CheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # DCP wraps per-rank failures (a truncated shard...)
        cause = next(iter(getattr(err, "failures", {}).values()), err)  # rank -> (exception, traceback)
        cause = cause[0] if isinstance(cause, tuple) else cause
        raise ckpt.CorruptCheckpointError(f"{step_dir}: reading the shards failed ({type(cause).__name__}: "
                                          f"{ckpt.first_line(cause)}); the checkpoint is damaged or truncated") from None


def load(path: str | Path, trainer) -> dict:
    """Collective: restore model, ZeRO shards, RNG, step and sampler from a dcp checkpoint (for a
    root, the newest step that every rank finds intact)."""
    return ckpt.with_fallback(path, lambda step_dir: _load_step(step_dir, trainer))


def _load_step(step_dir: Path, trainer) -> dict:
    meta = ckpt.read_meta(step_dir)
    ckpt.check_compatible(meta, trainer.cfg.model, step_dir)
    if meta.get("kind") != "dcp":
        raise ckpt.CheckpointError(ckpt.not_dcp_message(step_dir, meta.get("kind")))
    ckpt.require_listed(step_dir, meta, [METADATA_FILE])
    group = trainer.mesh.group("world")
    _verify_shared(step_dir, meta, group, trainer.mesh.device)
    metadata = SafeFileSystemReader(str(step_dir)).read_metadata()
    check_declared_bytes(metadata, step_dir)  # before allocating the saved pieces
    has_state = meta.get("adam_step", 0) > 0
    legacy = has_state and dcp_optim.legacy_cut_state(metadata)
    if legacy:  # pieces of the local shards (before session 13): only at the tp / etp they were saved with
        check_tp_layout(meta, trainer.mesh, has_state, step_dir)
        dcp_etp.check_etp_layout(meta, trainer.mesh, has_state, step_dir)
    copies: list = []
    request = _model_entries(trainer.model, trainer.mesh, metadata.state_dict_metadata, copies)
    missing = [k for k in request if k not in metadata.state_dict_metadata]
    if missing:
        raise ckpt.CheckpointError(f"{step_dir} lacks {len(missing)} parameter(s), e.g. {missing[:3]}; it was "
                                   f"written for a different model")
    check_declared_shapes({k: metadata.state_dict_metadata[k] for k in request},
                          {k: tuple(t.shape) for k, t in request.items()}, step_dir)
    rng_key = f"rng/{_rank()}"
    if rng_key in metadata.state_dict_metadata:
        request[rng_key] = torch.empty_like(torch.get_rng_state())
    reads = dcp_optim.plan_reads(trainer, metadata, request, has_state, legacy, step_dir)
    _read_shards(request, step_dir, no_dist=not _is_dist())
    with torch.no_grad():
        for copy in copies:  # etp slices out of the global tensors read
            copy()
    if rng_key in request:
        torch.set_rng_state(request[rng_key])
    dcp_optim.apply_reads(trainer, request, reads, metadata, has_state, meta.get("adam_step", 0), step_dir)
    trainer.step = meta["step"]
    if trainer.sampler is not None and meta.get("sampler") is not None:
        trainer.sampler.load_state_dict(meta["sampler"])
    _barrier(group)
    return meta


def load_full_model_state(path: str | Path) -> dict:
    """The full (unsharded) model state dict of a DCP checkpoint, in one process, no process group.
    Expert weights saved per global expert are stacked back."""
    return ckpt.with_fallback(path, lambda step_dir: read_full_model_state(step_dir, ckpt.read_meta(step_dir)))


def read_full_model_state(step_dir: Path, meta: dict, expected: Optional[dict] = None) -> dict:
    """`load_full_model_state` of one step directory with its meta (used by tools/convert_checkpoint.py).
    `expected` (name -> shape of the full model, e.g. built on the meta device from meta.json's
    config): every tensor `.metadata` declares is checked against it before anything is allocated."""
    ckpt.require_listed(step_dir, meta, [METADATA_FILE])
    ckpt.verify_files(step_dir, meta)
    metadata = SafeFileSystemReader(str(step_dir)).read_metadata()
    declared = {key: md for key, md in metadata.state_dict_metadata.items() if key.startswith("model/")}
    if expected is not None:
        check_declared_shapes(declared, dcp_etp.key_shapes(declared, expected), step_dir)
    check_declared_bytes(metadata, step_dir, declared)
    state = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype) for key, md in declared.items()}
    _read_shards(state, step_dir, no_dist=True)
    full, experts = {}, {}
    for name, tensor in dcp_etp.merge_halves({key[len("model/"):]: t for key, t in state.items()}).items():
        m = re.match(r"^(?P<name>.+)/expert(?P<e>\d+)$", name)
        if m:
            experts.setdefault(m["name"], {})[int(m["e"])] = tensor
        else:
            full[name] = tensor
    for name, by_expert in experts.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ckpt.CheckpointError(f"{step_dir}: expert slices of {name} are incomplete "
                                       f"(have {sorted(by_expert)}); the checkpoint was not fully written")
        full[name] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return full
