"""The AdamW state in DCP checkpoints (`checkpoint/dcp.py`): what each rank writes of its ZeRO ranges
and which saved pieces each rank reads back, at any layout.

- ``optim/<param name>/<master|exp_avg|exp_avg_sq>/<offset>``: the part of a whole (uncut)
  parameter's (flattened, fp32) AdamW state a rank holds, starting at element ``offset`` of the
  *global* parameter. Each rank writes only its own ZeRO shard — nothing is gathered on save — and
  on load each rank reads the saved pieces overlapping its new shard and copies the overlaps;
- ``optim/<param name>/<kind>`` of a tp / etp-cut parameter: one global 2-D tensor (the weight
  folded at its cut dim), each rank's ZeRO ranges of its shard written as rectangles of it (DCP
  chunks, `checkpoint/dcp_state.py`), read back by any layout's rectangles, or row by row by a
  layout that cuts a weight saved whole; a whole weight reads a cut one's rectangles likewise.

The Adam step count lives in meta.json. Every real element of a rank's state must come from
exactly one saved piece (`_check_filled`).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_fp4.training.checkpoint import dcp_etp, dcp_state
from megatron_fp4.training.checkpoint import directory as ckpt
from megatron_fp4.training.checkpoint.dcp_tp import optim_name

KINDS = ("master", "exp_avg", "exp_avg_sq")
_OPTIM_KEY = re.compile(r"^optim/(?P<name>.+)/(?P<kind>master|exp_avg|exp_avg_sq)/(?P<offset>\d+)$")


def expert_info(model) -> dict:
    """id(param) -> (expert_offset, num_local_experts) for expert weights."""
    info = {}
    for moe in model.moe_layers():
        experts = moe.experts
        for p in experts.parameters():
            info[id(p)] = (experts.expert_offset, p.shape[0])
    return info


def global_offset(param, info: dict) -> int:
    """Element offset of this rank's copy of `param` inside the global (all experts) parameter."""
    offset, local = info.get(id(param), (0, None))
    return offset * (param.numel() // local) if local else 0


def optim_entries(trainer) -> dict:
    """This rank's owned pieces of every parameter's AdamW state (disjoint across ranks, also under
    ZeRO-0 where every rank holds everything): of a whole weight flat pieces of the global one, of a
    tp / etp cut weight rectangles of its global 2-D state tensor (`dcp_state`)."""
    opt, info = trainer.optimizer, expert_info(trainer.model)
    out = {}
    for k, buf in enumerate(opt.buffers):
        state = opt.adam_state(k)
        for i, lo, hi, _ in buf.pieces(buf.owned):
            start, name = _state_index(buf, buf.offsets[i] + lo), buf.names[i]
            f = _fold(buf.params[i], trainer, info)
            for kind in KINDS:
                if f is None:
                    piece = state[kind][start:start + hi - lo]
                    out[f"optim/{name}/{kind}/{global_offset(buf.params[i], info) + lo}"] = piece.clone()
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


def saved_pieces(metadata) -> dict:
    """(name, kind) -> sorted [(offset, numel, key)] of the optimizer pieces in a checkpoint."""
    pieces: dict = {}
    for key, md in metadata.state_dict_metadata.items():
        m = _OPTIM_KEY.match(key)
        if m:
            pieces.setdefault((m["name"], m["kind"]), []).append((int(m["offset"]), md.size.numel(), key))
    for v in pieces.values():
        v.sort()
    return pieces


def legacy_cut_state(metadata) -> bool:
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
                f = dcp_state.whole(tuple(declared[keys[0]].size), global_offset(p, info))
            folds[name] = f
    bad = torch.tensor([len(problems)], dtype=torch.int64, device=trainer.mesh.device)
    if trainer.mesh.is_distributed:
        dist.all_reduce(bad, group=trainer.mesh.group("world"))
    if int(bad) and problems:
        raise ckpt.CheckpointError(f"checkpoint {step_dir} does not hold this model's optimizer state "
                                   f"({len(problems)} problem(s), e.g. {'; '.join(problems[:2])}); it was "
                                   f"written for a different model or its .metadata is damaged")
    if int(bad):
        raise ckpt.CheckpointError(f"checkpoint {step_dir}: another rank found its optimizer state not matching "
                                   f"this model (see that rank's error)")
    return folds


def plan_reads(trainer, metadata, request: dict, has_state: bool, legacy: bool, step_dir: Path) -> tuple:
    """Add to `request` (DCP key -> what to read) the saved optimizer state overlapping this rank's
    ZeRO ranges; returns what `apply_reads` copies out of it after the read. `legacy`: a checkpoint
    whose cut weights' state is keyed by shard (`legacy_cut_state`)."""
    saved = saved_pieces(metadata)
    opt, info = trainer.optimizer, expert_info(trainer.model)
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
            goff = global_offset(buf.params[i], info)
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
    return plans, rects


def apply_reads(trainer, request: dict, reads: tuple, metadata, has_state: bool, adam_step: float,
                step_dir: Path) -> None:
    """Set every buffer's AdamW state from what `plan_reads` requested (read by now); without saved
    state (a weights-only checkpoint) the masters start from the loaded params."""
    opt, (plans, rects) = trainer.optimizer, reads
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
        opt.set_adam_state(k, flats["master"], flats["exp_avg"], flats["exp_avg_sq"], adam_step)


def _check_filled(buf, filled: torch.Tensor, where) -> None:
    """Every real (non-padding) element of this rank's state must come from exactly one saved piece."""
    need = torch.zeros_like(filled)
    for _, plo, phi, state_pos in buf.pieces():
        need[state_pos:state_pos + phi - plo] = 1
    if not torch.equal(filled, need):
        raise ckpt.CheckpointError(f"{where}: the saved optimizer state does not cover this rank's shard "
                                   f"({int((filled != need).sum())} elements differ); the checkpoint is incomplete")
