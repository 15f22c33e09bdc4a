"""The checkpoint directory format shared by every layout: atomic, checksummed, loaded as data only.

Layout (the tensors are written by `checkpoint/dcp.py` with torch.distributed.checkpoint, DCP, at
every size: one process is a mesh of size 1)::

    <dir>/step_00000100/.metadata, *.distcp  DCP's files: model, AdamW shards, RNG (by global names)
    <dir>/step_00000100/meta.json            step, kind, format version, config, sha256 of every other file
    <dir>/latest                             name of the newest complete step directory (a hint)

The crash-safety rules (temp dir + fsync + one rename, never replacing a complete step, stale temp
cleanup, `checkpoint.keep_last` retention) live in `checkpoint/files.py`. Loading a root directory
(`checkpoint.load=auto` or the `checkpoint.dir`) takes the newest step that is complete and passes
its checksums, warning about every step it skips; an explicitly named step directory must be
intact.

Checkpoints of the former single-process format (``kind`` "single"/"weights", one ``state.pt``)
are no longer written or resumed; `tools/convert_checkpoint.py` still reads them (`inspect`,
`to-hf`, `upgrade` to DCP) through `load_legacy_step`: ``torch.load(weights_only=True)``, tensors
and plain Python values only, nothing in a checkpoint file is executed.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Callable, Optional, TypeVar

import torch

from megatron_fp4.training.checkpoint import files

FORMAT_VERSION = 1
STATE_FILE, META_FILE, LATEST_FILE, CONFIG_FILE = "state.pt", "meta.json", "latest", "config.yaml"
LEGACY_KINDS = ("single", "weights")  # the former one-file format: read by the converter only

# Model fields that must match between a checkpoint and the config resuming from it.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts",
                "top_k", "moe_ffn_hidden_size", "num_shared_experts", "shared_expert_ffn_hidden_size",
                "dense_layers", "dense_ffn_hidden_size", "tie_embeddings")
T = TypeVar("T")
_FILE_NAME, _SHA256 = re.compile(r"[^/\\\x00]{1,255}"), re.compile(r"[0-9a-f]{64}")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the path and what to do."""


class CorruptCheckpointError(CheckpointError):
    """A step directory that is incomplete or damaged (loading a root falls back past it)."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# Files in a directory that mark it as a checkpoint (ours or DCP's): an export never replaces it.
_CHECKPOINT_MARKERS = (META_FILE, LATEST_FILE, STATE_FILE, ".metadata")


def check_not_input(out, inputs, flag: str = "the output") -> None:
    """Refuse an output path that is one of `inputs`, holds one of them or lies inside one: writing
    or replacing it would destroy or corrupt what is being read."""
    out_path = Path(os.path.realpath(out))
    for source in inputs:
        src = Path(os.path.realpath(source))
        if out_path == src or out_path in src.parents or src in out_path.parents:
            relation = ("is" if out_path == src else "contains" if out_path in src.parents else "is inside")
            raise ValueError(f"{flag} {str(out)!r} {relation} the input {str(source)!r}; a tool never writes over "
                             f"its own input: choose an output directory outside it")


def replace_dir(src: Path, dst: Path, inputs=()) -> None:
    """Put the completely written directory `src` at `dst` (an export the user asked to overwrite).
    An existing `dst` is first renamed aside. Only an export is replaced: `dst` may not be or touch
    one of `inputs` (what the export was made from) and may not hold a subdirectory or a checkpoint
    file (an export is flat files), so a mistyped path (the run directory, a home directory) is
    refused instead of deleted. Step directories never go through here: see `commit_step_dir`."""
    check_not_input(dst, inputs)
    old = None
    if dst.exists() or dst.is_symlink():
        check_replaceable_export(dst)
        old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def check_replaceable_export(dst) -> None:
    """Refuse replacing `dst` unless it is a directory of plain files none of which marks a checkpoint."""
    dst = Path(dst)
    if dst.is_symlink() or not dst.is_dir():
        raise ValueError(f"{str(dst)!r} exists and is not a directory; an export replaces only a former export: "
                         f"remove it yourself or choose another output directory")
    for entry in dst.iterdir():
        if entry.is_dir() or entry.is_symlink() or entry.name in _CHECKPOINT_MARKERS or entry.suffix == ".distcp":
            what = "a checkpoint file" if entry.is_file() and not entry.is_symlink() else "a subdirectory or link"
            raise ValueError(f"{str(dst)!r} holds {entry.name!r} ({what}), so it is not a former export; "
                             f"overwriting replaces only a directory of exported files: remove it yourself "
                             f"or choose another output directory")


# -- meta.json ------------------------------------------------------------------------------------
def _meta_digest(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_meta(step_dir: Path, meta: dict, sums: dict) -> None:
    """Write meta.json with the sha256 of every data file (`sums`) and of itself, durably."""
    meta = json.loads(json.dumps({**meta, "files": sums}, default=str))
    meta["meta_sha256"] = _meta_digest(meta)
    files.write_durable_text(step_dir / META_FILE, json.dumps(meta, indent=2) + "\n")


def read_meta(step_dir: Path) -> dict:
    path = Path(step_dir) / META_FILE
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing: the step directory is incomplete") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({err}): the file is damaged or truncated") from None
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(f"{path} holds a JSON {type(meta).__name__}, not an object: it is damaged")
    if "meta_sha256" in meta and meta["meta_sha256"] != _meta_digest(meta):
        raise CorruptCheckpointError(f"{path} fails its sha256 check: the file is damaged")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path.parent}: checkpoint format {meta.get('format_version')!r} is not supported "
                              f"(this version reads {FORMAT_VERSION})")
    _check_meta_fields(path, meta)
    return meta


def _check_meta_fields(path: Path, meta: dict) -> None:
    """The fields loaders use must have their types (an edited meta.json can pass its own sha256)."""
    config = meta.get("config")
    problem = None
    if config is not None and not isinstance(config, dict):
        problem = f"'config' is a JSON {type(config).__name__}, not an object"
    elif isinstance(config, dict) and not isinstance(config.get("model", {}), dict):
        problem = f"'config.model' is a JSON {type(config['model']).__name__}, not an object"
    elif "step" in meta and (isinstance(meta["step"], bool) or not isinstance(meta["step"], int) or meta["step"] < 0):
        problem = f"'step' is {str(meta['step'])[:40]!r}, not a non-negative integer"
    if problem:
        raise CorruptCheckpointError(f"{path}: {problem}; the file is damaged or was edited (restore it, or use "
                                     f"another step)")


def expected_files(step_dir: Path, meta: dict) -> dict:
    """name -> sha256 recorded in meta.json ({} for checkpoints of older versions, with a warning)."""
    sums = meta.get("files")
    if sums is None:
        warnings.warn(f"{step_dir} was written without checksums (an older version); its files are not verified",
                      stacklevel=3)
        return {}
    if not isinstance(sums, dict):
        raise CorruptCheckpointError(f"{step_dir}/{META_FILE}: 'files' is not a mapping; the file is damaged")
    for name, digest in sums.items():
        if not _FILE_NAME.fullmatch(name) or name in (".", ".."):
            raise CorruptCheckpointError(f"{step_dir}/{META_FILE}: 'files' lists {name[:80]!r}, not a file name in "
                                         f"the step directory; the file is damaged or was edited")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise CorruptCheckpointError(f"{step_dir}/{META_FILE}: the checksum of {name} is {str(digest)[:80]!r}, "
                                         f"not a sha256 (64 hex digits); the file is damaged or was edited")
    return sums


def require_listed(step_dir: Path, meta: dict, names) -> None:
    """A checksummed step must list (and so verify) each of `names`, the files its loader reads."""
    sums = meta.get("files")
    missing = [name for name in names if sums is not None and name not in sums]
    if missing:
        raise CorruptCheckpointError(f"{step_dir}/{META_FILE}: 'files' has no checksum of {missing}, which the "
                                     f"loader reads; the file is damaged or was edited")


def verify_files(step_dir: Path, meta: dict, names=None) -> None:
    """Raise CorruptCheckpointError unless each of `names` (default: all listed) matches its sha256."""
    sums = expected_files(step_dir, meta)
    problems = files.check_files(step_dir, sums, sorted(sums) if names is None else names)
    if problems:
        raise CorruptCheckpointError(f"{step_dir}: " + "; ".join(problems))


def step_problem(step_dir: Path) -> Optional[str]:
    """Why `step_dir` is not an intact checkpoint, or None when it is."""
    try:
        verify_files(step_dir, read_meta(step_dir))
    except CheckpointError as err:
        return str(err)
    return None


# -- saving ---------------------------------------------------------------------------------------
def keep_last_of(config: dict) -> int:
    return int((config.get("checkpoint") or {}).get("keep_last", 0) or 0)


def begin_save(root: Path, final: Path) -> bool:
    """Clean stale temp entries; False (with a warning) when `final` already holds an intact
    checkpoint, which is never overwritten (e.g. a finished job run again with load=auto)."""
    files.clean_stale(root)
    if final.exists() and step_problem(final) is None:
        warnings.warn(f"{final} already holds a complete checkpoint; kept it and did not write this "
                      f"step again (use a new checkpoint.dir to keep both runs)", stacklevel=3)
        return False
    return True


def commit_step_dir(tmp_dir: Path, final_dir: Path, root: Path, keep_last: int = 0) -> None:
    """Rename a completely written (and fsynced) temp dir into place, point `latest` at it and
    apply retention. A damaged step dir in the way is set aside first, never replaced in place."""
    files.fsync_dir(tmp_dir)
    if final_dir.exists():
        files.remove_step_dir(final_dir)
    os.replace(tmp_dir, final_dir)
    files.fsync_dir(root)
    files.write_durable_text(root / LATEST_FILE, final_dir.name + "\n")
    files.prune(root, keep_last, keep=final_dir)


def os_error_in(err: BaseException) -> Optional[OSError]:
    """The OSError behind `err`: itself, or one it was raised while handling (torch.save reports a
    failed write as a RuntimeError raised while closing the archive, with the OSError as context)."""
    seen = 0
    while err is not None and seen < 16:
        if isinstance(err, OSError):
            return err
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def save_failed(root: Path, step: int, err: OSError) -> CheckpointError:
    """The one-line error of a save that could not be written (the temp dir is already removed):
    what happened and which step the directory still holds intact."""
    what = "disk full" if err.errno in (errno.ENOSPC, errno.EDQUOT) else f"{err.strerror or err} ({type(err).__name__})"
    intact = next((d for _, d in files.step_dirs(root) if (d / META_FILE).exists()), None)
    if intact is not None and intact.name == step_dir_name(step):
        held = f"step {step} itself was written completely ({intact}), only its '{LATEST_FILE}' hint is stale"
    elif intact is not None:
        held = f"step {files.step_of(intact.name)} is intact ({intact})"
    else:
        held = "no earlier step is saved there"
    return CheckpointError(f"{what} while saving step {step} to {root}; {held}. Free space (or choose another "
                           f"checkpoint.dir) and resume with --set checkpoint.load=auto")


# -- finding and loading --------------------------------------------------------------------------
def step_candidates(path: str | Path) -> list[Path]:
    """The step directories to try for `path`, best first: `path` itself when it is a step dir,
    else the complete step dirs of the root `path`, newest first. [] when `path` holds no trace of
    a checkpoint; CheckpointError when it does but none is complete."""
    path = Path(path)
    if (path / META_FILE).exists():
        return [path]
    if files.step_of(path.name) is not None and path.is_dir():
        raise CorruptCheckpointError(f"{path} has no {META_FILE}: the step directory is incomplete; pass a "
                                     f"complete step_* directory or the checkpoint.dir holding them")
    try:
        files.recover_old_copies(path)
    except OSError:
        pass  # a read-only checkpoint dir: the copies stay hidden, the other steps still load
    steps = files.step_dirs(path)
    complete = [d for _, d in steps if (d / META_FILE).exists()]
    latest = path / LATEST_FILE
    named = latest.read_text(errors="replace").strip() if latest.is_file() else None
    if complete and named != complete[0].name:
        what = {None: "is missing", "": "is empty"}.get(named, f"names {named!r}, not the newest complete step")
        warnings.warn(f"{latest} {what}; using {complete[0]}", stacklevel=3)
    if not complete and (steps or named is not None):
        raise CheckpointError(f"{path} holds no complete checkpoint ({LATEST_FILE} names {named!r}; step dirs "
                              f"without {META_FILE}: {[d.name for _, d in steps]}); refusing to start over in it: "
                              f"pass a complete checkpoint or a new checkpoint.dir")
    return complete


def _candidates_or_raise(path: str | Path) -> list[Path]:
    found = step_candidates(path)
    if not found:
        raise CheckpointError(f"{path} is not a megatron-fp4 checkpoint (no {META_FILE}, no {LATEST_FILE}, no "
                              f"step_* directories); pass a step_* directory or the checkpoint.dir that holds them")
    return found


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory, or a root holding step directories → the step directory to try first."""
    return _candidates_or_raise(path)[0]


def with_fallback(path: str | Path, load_one: Callable[[Path], T]) -> T:
    """`load_one(step_dir)` on the best step of `path`. For a root, a step that turns out damaged
    (CorruptCheckpointError) is skipped with a warning and the previous complete one is tried."""
    found = _candidates_or_raise(path)
    if found == [Path(path)]:
        return load_one(found[0])
    problems = []
    for step_dir in found:
        try:
            return load_one(step_dir)
        except CorruptCheckpointError as err:
            problems.append(str(err))
            warnings.warn(f"skipping damaged checkpoint: {err}; trying the previous complete step", stacklevel=2)
    raise CorruptCheckpointError(f"no intact checkpoint in {path}: " + " | ".join(problems))


def check_compatible(meta: dict, model_cfg, where: Path) -> None:
    """Refuse to load a checkpoint of a differently shaped model, naming every differing field."""
    saved = (meta.get("config") or {}).get("model") or {}  # types checked by read_meta
    diffs = [f"model.{k}: checkpoint {saved.get(k)!r} vs config {getattr(model_cfg, k)!r}"
             for k in SHAPE_FIELDS if k in saved and saved[k] != getattr(model_cfg, k)]
    if diffs:
        raise CheckpointError(f"checkpoint {where} was written for a different model; " + "; ".join(diffs)
                              + ". Use the config it was trained with (see its meta.json)")


def check_state_fits(expected: dict, state, where: Path) -> None:
    """Refuse a model state dict whose tensor names or shapes differ from `expected` (the model's
    own state dict, or name -> shape), before anything is copied: its meta.json may claim another
    model than the one its tensors hold."""
    shapes = {k: tuple(v.shape) if hasattr(v, "shape") else tuple(v) for k, v in expected.items()}
    got = state if isinstance(state, dict) else {}
    missing = [k for k in shapes if k not in got]
    extra = [k for k in got if k not in shapes]
    wrong = [f"{k}: checkpoint {tuple(got[k].shape) if isinstance(got[k], torch.Tensor) else 'no tensor'} vs "
             f"model {shapes[k]}" for k in shapes
             if k in got and not (isinstance(got[k], torch.Tensor) and tuple(got[k].shape) == shapes[k])]
    if missing or extra or wrong:
        parts = ([f"missing {len(missing)} tensor(s), e.g. {missing[:3]}"] if missing else []) + \
                ([f"{len(extra)} unexpected, e.g. {extra[:3]}"] if extra else []) + wrong[:3]
        raise CheckpointError(f"checkpoint {where} was written for a different model ({'; '.join(parts)}). Use the "
                              f"config it was trained with (its config.yaml; meta.json's config may have been edited)")


def load_state_file(path: Path) -> dict:
    """`torch.load(weights_only=True)`: tensors and plain values only; a file holding anything else
    (e.g. a crafted pickle) is refused, never executed."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        lines = str(err).splitlines()
        reason = next((line for line in lines if "GLOBAL" in line), first_line(err))  # torch names the global
        raise CheckpointError(f"{path} holds objects other than tensors and plain values; refused to load it "
                              f"(nothing in a checkpoint is executed): {reason}") from None
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path} is missing: the step directory is incomplete") from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CorruptCheckpointError(f"{path} cannot be read ({type(err).__name__}: {first_line(err)}): "
                                     f"the file is damaged or truncated") from None


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_legacy_step(step_dir: Path) -> tuple[dict, dict]:
    """(state, meta) of one step directory of the former single-process format ("single" or
    "weights": one ``state.pt``), verified; only `tools/convert_checkpoint.py` reads these."""
    meta = read_meta(step_dir)
    if meta.get("kind") not in LEGACY_KINDS:
        raise CheckpointError(f"{step_dir} is a {meta.get('kind')!r} checkpoint, not one of the former single-file "
                              f"format ({' or '.join(LEGACY_KINDS)})")
    require_listed(step_dir, meta, [STATE_FILE])
    verify_files(step_dir, meta)
    return load_state_file(step_dir / STATE_FILE), meta


def not_dcp_message(step_dir: Path, kind) -> str:
    """Why a step directory that is not DCP cannot be resumed, and what to do."""
    if kind in LEGACY_KINDS:
        return (f"{step_dir} is a {kind!r} checkpoint of the former single-file format (state.pt), which the trainer "
                f"no longer loads; convert it once: python tools/convert_checkpoint.py upgrade {step_dir} NEW_DIR, "
                f"then load NEW_DIR")
    return f"{step_dir} is a {kind!r} checkpoint; the trainer loads DCP ('dcp') checkpoints"


def latest_step(root: str | Path) -> Optional[int]:
    """Step of the newest complete checkpoint under `root`; None when `root` holds none at all
    (a fresh start). Raises CheckpointError when there are traces of checkpoints but none complete."""
    found = step_candidates(root)
    if not found:
        return None
    step = files.step_of(found[0].name)
    return step if step is not None else read_meta(found[0])["step"]
