"""The file-level rules that make a checkpoint directory crash-safe (used by checkpoint.py and
checkpoint/dcp.py; one writer per checkpoint directory).

- A ``step_*`` directory appears only by one rename of a complete temp directory whose files and
  directory entry were fsynced first, so every ``step_*`` holding ``meta.json`` is complete; the
  sha256 of each file, kept in ``meta.json``, proves it was not damaged since.
- A complete ``step_*`` directory is never replaced in place: a damaged one is first renamed to a
  temp name and only then is the new one renamed in, so at every instant the loader finds either
  the old complete step or the new one (or, in between, the previous step, which it falls back to).
- ``latest`` is a hint written by temp file + fsync + rename; loaders check what it names.
- Temp entries are named ``.tmp-<what>-<host>-<pid>``. One whose owner is not a live process on
  this host other than the caller (a crashed save, an older run, another host's old rank 0) is
  stale and removed at the next save.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Iterable, Optional

TMP_PREFIX = ".tmp-"
_TMP_NAME = re.compile(r"^\.tmp-(?P<what>.+?)-(?P<host>[^/]+)-(?P<pid>\d+)$")
_STEP_NAME = re.compile(r"^step_(?P<step>\d{8,})$")
_OLD_COPY = re.compile(r"^\.(?P<name>step_\d{8,})\.old-[0-9a-f]+$")  # left by replace_dir before this module


def _host() -> str:
    return socket.gethostname().replace("/", "_") or "localhost"


def temp_name(what: str, pid: Optional[int] = None, host: Optional[str] = None) -> str:
    return f"{TMP_PREFIX}{what}-{host or _host()}-{os.getpid() if pid is None else pid}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def is_stale(name: str) -> bool:
    """A temp entry not owned by a live process on this host other than us (names of older
    versions, `.tmp-step_X-PID` and `.tmp-step_X`, carry no host and are always stale)."""
    m = _TMP_NAME.match(name)
    if m is None or m["host"] != _host():
        return True
    pid = int(m["pid"])
    return pid == os.getpid() or not _pid_alive(pid)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def clean_stale(root: Path) -> list[str]:
    """Remove stale temp entries in `root` and put back step copies an interrupted older save hid.
    Returns the names removed."""
    removed = []
    for entry in sorted(root.iterdir()) if root.is_dir() else ():
        if entry.name.startswith(TMP_PREFIX) and is_stale(entry.name):
            remove(entry)
            removed.append(entry.name)
    recover_old_copies(root)
    return removed


def recover_old_copies(root: Path) -> None:
    """Older versions replaced a step dir by renaming it to `.step_X.old-<hex>` first; a kill right
    then hid the good copy. Put such a copy back when the step dir itself is missing."""
    for entry in sorted(root.iterdir()) if root.is_dir() else ():
        m = _OLD_COPY.match(entry.name)
        if m and not (root / m["name"]).exists():
            os.replace(entry, root / m["name"])
            fsync_dir(root)


def step_of(name: str) -> Optional[int]:
    """The step of a `step_XXXXXXXX` name, else None."""
    m = _STEP_NAME.match(name)
    return int(m["step"]) if m else None


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step_*` directory in `root`, newest first."""
    found = []
    for entry in root.iterdir() if root.is_dir() else ():
        step = step_of(entry.name)
        if step is not None and entry.is_dir():
            found.append((step, entry))
    return sorted(found, reverse=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable_text(path: Path, text: str) -> None:
    """Replace `path` by `text` atomically and durably (temp file, fsync, rename, fsync dir)."""
    tmp = path.parent / temp_name(path.name)
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # e.g. a full disk: leave no temp file behind
        raise
    fsync_dir(path.parent)


def file_digest(path: Path, sync: bool = False) -> str:
    """sha256 of a file; with `sync`, also fsync it (our own freshly written files)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest()


def data_files(step_dir: Path, exclude: Iterable[str] = ()) -> list[str]:
    """Names of the regular files of a step directory (DCP's `.metadata` included), sorted."""
    skip = set(exclude)
    return sorted(p.name for p in step_dir.iterdir() if p.is_file() and p.name not in skip)


def check_files(step_dir: Path, expected: dict, names: Iterable[str]) -> list[str]:
    """Problems (one line each) of the files `names` against their expected sha256."""
    problems = []
    for name in names:
        path = step_dir / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif file_digest(path) != expected[name]:
            problems.append(f"{name} fails its sha256 check (damaged or truncated)")
    return problems


def remove_step_dir(path: Path) -> None:
    """Delete a step directory without ever leaving a half-deleted `step_*` behind: rename it to a
    temp name first (a crash then leaves a stale temp dir, cleaned at the next save)."""
    aside = path.parent / temp_name(f"del-{path.name}")
    os.replace(path, aside)
    fsync_dir(path.parent)
    remove(aside)


def prune(root: Path, keep_last: int, keep: Path) -> list[Path]:
    """Keep `keep` (the step just saved) and the `keep_last - 1` newest steps before it; delete the
    older ones (keep_last 0 keeps all). Steps newer than `keep` (a run that went further from an
    older point, or a damaged step that was skipped) are not counted and not touched."""
    if keep_last <= 0:
        return []
    older = [path for step, path in step_dirs(root) if step < step_of(keep.name)]
    for path in older[keep_last - 1:]:
        remove_step_dir(path)
    return older[keep_last - 1:]
