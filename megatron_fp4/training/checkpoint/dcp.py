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
- ``optim/<param name>/<master|exp_avg|exp_avg_sq>/<offset>``: the part of a whole (uncut)
  parameter's (flattened, fp32) AdamW state a rank holds, starting at element ``offset`` of the
  *global* parameter. Each rank writes only its own ZeRO shard — nothing is gathered on save — and
  on load each rank reads the saved pieces overlapping its new shard and copies the overlaps. Plain
  1-D tensors under unique keys;
- ``optim/<param name>/<kind>`` of a tp / etp-cut parameter: one global 2-D tensor (the weight
  folded at its cut dim), each rank's ZeRO ranges of its shard written as rectangles of it (DCP
  chunks, `checkpoint/dcp_state.py`), read back by any layout's rectangles, or row by row by a
  layout that cuts a weight saved whole; a whole weight reads a cut one's rectangles likewise;
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
from megatron_fp4.training.checkpoint import dcp_etp, dcp_state
from megatron_fp4.training.checkpoint.dcp_checks import check_declared_bytes, check_declared_shapes
from megatron_fp4.training.checkpoint.dcp_metadata import METADATA_FILE, SafeFileSystemReader
from megatron_fp4.training.checkpoint.dcp_tp import check_tp_layout, optim_name, tp_entry, tp_replicas_needed

KINDS = ("master", "exp_avg", "exp_avg_sq")
_OPTIM_KEY = re.compile(r"^optim/(?P<name>.+)/(?P<kind>master|exp_avg|exp_avg_sq)/(?P<offset>\d+)$")


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


def _expert_info(model) -> dict:
    """id(param) -> (expert_offset, num_local_experts) for expert weights."""
    info = {}
    for moe in model.moe_layers():
        experts = moe.experts
        for p in experts.parameters():
            info[id(p)] = (experts.expert_offset, p.shape[0])
    return info


def _global_offset(param, info: dict) -> int:
    """Element offset of this rank's copy of `param` inside the global (all experts) parameter."""
    offset, local = info.get(id(param), (0, None))
    return offset * (param.numel() // local) if local else 0


def _model_entries(model, mesh, saved: Optional[dict] = None, copies: Optional[list] = None) -> dict:
    """DCP key -> tensor of every weight; on load (`saved`: the checkpoint's key -> metadata) expert
    weights take the form the checkpoint has (per global expert or whole, whatever the ep), etp
    weights and experts of a whole tensor get temporaries, and `copies` the copies of their slices,
    to run after the read."""
    info = _expert_info(model)
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


def _optim_entries(trainer) -> dict:
    """This rank's owned pieces of every parameter's AdamW state (disjoint across ranks, also under
    ZeRO-0 where every rank holds everything): of a whole weight flat pieces of the global one, of a
    tp / etp cut weight rectangles of its global 2-D state tensor (`dcp_state`)."""
    opt, info = trainer.optimizer, _expert_info(trainer.model)
    out = {}
    for k, buf in enumerate(opt.buffers):
        state = opt.adam_state(k)
        for i, lo, hi, _ in buf.pieces(buf.owned):
            start, name = _state_index(buf, buf.offsets[i] + lo), buf.names[i]
            f = _fold(buf.params[i], trainer, info)
            for kind in KINDS:
                if f is None:
                    piece = state[kind][start:start + hi - lo]
                    out[f"optim/{name}/{kind}/{_global_offset(buf.params[i], info) + lo}"] = piece.clone()
                    continue
                chunks = out.setdefault(f"optim/{name}/{kind}", dcp_state.StateChunks(f.shape, state[kind].dtype))
                for offsets, size, pos in dcp_state.rectangles(f, lo, hi):
                    chunks.add(offsets, dcp_state.region(state[kind], f, size, pos, start - lo).clone())
    return out


def _fold(p, trainer, info: dict):
    return dcp_state.fold(p, trainer.mesh, info.get(id(p)), trainer.model.cfg.num_experts)


def _optim_stem(name: str, p, mesh) -> str:
    return dcp_etp.optim_name(name, p, mesh, optim_name(name, p, mesh))


def _state_index(buf, buffer_pos: int) -> int:
    """Position in the flat state (master/moments) of buffer element `buffer_pos`."""
    pos = 0
    for lo, hi in buf.state_ranges:
        if lo <= buffer_pos < hi:
            return pos + buffer_pos - lo
        pos += hi - lo
    raise AssertionError(f"buffer element {buffer_pos} is not in this rank's state")


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
    state = {**_model_entries(trainer.model, trainer.mesh), **({} if fresh else _optim_entries(trainer)),
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


def _saved_pieces(metadata) -> dict:
    """(name, kind) -> sorted [(offset, numel, key)] of the optimizer pieces in a checkpoint."""
    pieces: dict = {}
    for key, md in metadata.state_dict_metadata.items():
        m = _OPTIM_KEY.match(key)
        if m:
            pieces.setdefault((m["name"], m["kind"]), []).append((int(m["offset"]), md.size.numel(), key))
    for v in pieces.values():
        v.sort()
    return pieces


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
    saved = _saved_pieces(metadata)
    has_state = meta.get("adam_step", 0) > 0
    legacy = has_state and _legacy_cut_state(metadata)
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
    opt, info = trainer.optimizer, _expert_info(trainer.model)
    plans = []  # (buffer k, kind, dst in flat state, key, src in saved piece, numel)
    folds = _state_folds(trainer, info, metadata, step_dir) if has_state and not legacy else {}
    rects = []  # (buffer k, kind, fold, size, local position, state base, global offsets, key)
    for k, buf in enumerate(opt.buffers):
        dtype = buf.data.dtype if buf.data.dtype == torch.float64 else torch.float32
        for i, lo, hi, state_pos in buf.pieces():
            f, two_d = folds.get(buf.names[i]), f"optim/{buf.names[i]}/master" in metadata.state_dict_metadata
            for kind in KINDS if f is not None and two_d else ():  # rectangles of the global 2-D state
                key = f"optim/{buf.names[i]}/{kind}"
                chunks = request.setdefault(key, dcp_state.StateChunks(f.shape, dtype))
                for offsets, size, pos in dcp_state.rectangles(f, lo, hi):
                    chunks.add(offsets, torch.empty(size, dtype=dtype))
                    rects.append((k, kind, f, size, pos, state_pos - lo, offsets, key))
            if f is not None and two_d:
                continue
            name = _optim_stem(buf.names[i], buf.params[i], trainer.mesh) if legacy else buf.names[i]
            goff = _global_offset(buf.params[i], info)
            # flat ranges [global start, local start, numel): the piece, or each row of a cut one's rectangles
            spans = ([(goff + lo, lo, hi - lo)] if f is None else
                     [((r + j) * f.shape[1] + c, pos + j * f.local_cols, n)
                      for (r, c), (rows, n), pos in dcp_state.rectangles(f, lo, hi) for j in range(rows)])
            for kind in KINDS if has_state else ():
                for off, numel, key in saved.get((name, kind), []):
                    for g, local, n in spans:
                        a, b = max(g, off), min(g + n, off + numel)
                        if a < b:
                            if key not in request:
                                request[key] = torch.empty(numel, dtype=dtype)
                            plans.append((k, kind, state_pos - lo + local + a - g, key, a - off, b - a))
    _read_shards(request, step_dir, no_dist=not _is_dist())
    with torch.no_grad():
        for copy in copies:  # etp slices out of the global tensors read
            copy()
    if rng_key in request:
        torch.set_rng_state(request[rng_key])
    for k, buf in enumerate(opt.buffers):
        current = opt.adam_state(k)
        flats = {kind: torch.zeros_like(current["master"]) for kind in KINDS}
        if not has_state:  # masters start from the loaded params
            flats["master"] = buf.gather_ranges(buf.data, buf.state_ranges).to(current["master"].dtype).clone()
        filled = torch.zeros(flats["master"].numel(), dtype=torch.int32)
        for kk, kind, dst, key, src, n in plans:
            if kk == k:
                flats[kind][dst:dst + n] = request[key][src:src + n]
                if kind == "master":
                    filled[dst:dst + n] += 1
        for kk, kind, f, size, pos, base, offsets, key in rects:
            if kk == k:
                dcp_state.region(flats[kind], f, size, pos, base).copy_(request[key].chunks[torch.Size(offsets)])
                if kind == "master":  # how many saved chunks cover each element (`_check_filled`: exactly one)
                    dcp_state.count_coverage(dcp_state.region(filled, f, size, pos, base), offsets,
                                             metadata.state_dict_metadata[key])
        if has_state:
            _check_filled(buf, filled, step_dir)
        opt.set_adam_state(k, flats["master"], flats["exp_avg"], flats["exp_avg_sq"], meta.get("adam_step", 0))
    trainer.step = meta["step"]
    if trainer.sampler is not None and meta.get("sampler") is not None:
        trainer.sampler.load_state_dict(meta["sampler"])
    _barrier(group)
    return meta


def _check_filled(buf, filled: torch.Tensor, where) -> None:
    """Every real (non-padding) element of this rank's state must come from exactly one saved piece."""
    need = torch.zeros_like(filled)
    for _, plo, phi, state_pos in buf.pieces():
        need[state_pos:state_pos + phi - plo] = 1
    if not torch.equal(filled, need):
        raise ckpt.CheckpointError(f"{where}: the saved optimizer state does not cover this rank's shard "
                                   f"({int((filled != need).sum())} elements differ); the checkpoint is incomplete")


def _legacy_cut_state(metadata) -> bool:
    """Whether the checkpoint keeps cut weights' AdamW state as pieces of the local shards
    (``optim/<name>/tp<i>/...``, ``.../etp<i>/...``: written before session 13)."""
    return any(re.match(r"^optim/.+/e?tp\d+/(master|exp_avg|exp_avg_sq)/\d+$", key)
               for key in metadata.state_dict_metadata)


def _state_folds(trainer, info: dict, metadata, step_dir: Path) -> dict:
    """name -> `dcp_state.Fold` of every weight whose AdamW state is read as rectangles of a 2-D
    state tensor: a weight the checkpoint stores so (saved cut), or one this layout cuts. The
    declared shapes (and chunks) are checked against the weight's before anything is allocated; a
    problem on any rank is a CheckpointError on every rank (none is left waiting in the read)."""
    folds, problems, declared = {}, [], metadata.state_dict_metadata
    for buf in trainer.optimizer.buffers:
        for name, p in zip(buf.names, buf.params):
            f = _fold(p, trainer, info)
            keys = [f"optim/{name}/{kind}" for kind in KINDS]
            if not any(key in declared for key in keys):
                if f is not None:  # saved whole (flat pieces of the global tensor): read row by row
                    folds[name] = f
                continue
            expert = info.get(id(p))
            shape = (trainer.model.cfg.num_experts, *p.shape[1:]) if expert else tuple(p.shape)
            shapes = [f.shape] if f is not None else dcp_state.folds_of(shape)
            for key in keys:
                problem = (f"{key} is missing" if key not in declared else
                           dcp_state.check_declared(declared[key], key, shapes))
                problems += [problem] if problem else []
            if f is None and not problems:
                f = dcp_state.whole(tuple(declared[keys[0]].size), _global_offset(p, info))
            folds[name] = f
    bad = torch.tensor([len(problems)], dtype=torch.int64, device=trainer.mesh.device)
    if _is_dist():
        dist.all_reduce(bad, group=trainer.mesh.group("world"))
    if int(bad) and problems:
        raise ckpt.CheckpointError(f"checkpoint {step_dir} does not hold this model's optimizer state "
                                   f"({len(problems)} problem(s), e.g. {'; '.join(problems[:2])}); it was "
                                   f"written for a different model or its .metadata is damaged")
    if int(bad):
        raise ckpt.CheckpointError(f"checkpoint {step_dir}: another rank found its optimizer state not matching "
                                   f"this model (see that rank's error)")
    return folds


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
