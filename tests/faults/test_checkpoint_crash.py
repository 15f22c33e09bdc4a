"""A save killed at any point leaves a root that loads an intact step (row 5 of issue 10).

Every call a save (the trainer's DCP save, one process) makes that changes the disk (mkdir, DCP's
opening of a file to write, write_text, fsync, replace, rename, unlink, rmdir, rmtree) is a kill
point; for each k the k-th such call "kills" the process (raises a BaseException), so nothing after
it runs, as with kill -9. Then a restarted loader must find the previous step or the new one, intact, and
the next save must succeed and leave no temp entries. A second test SIGKILLs a real saving process
at arbitrary moments."""
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
from torch.distributed.checkpoint.filesystem import FileSystem

from tests.unit.test_checkpoint_safety import flip_bytes, loaded_step, save, shard

POINTS = [(os, "mkdir"), (os, "replace"), (os, "rename"), (os, "fsync"), (os, "unlink"), (os, "rmdir"),
          (shutil, "rmtree"), (FileSystem, "create_stream"), (pathlib.Path, "write_text")]


class Killed(BaseException):
    pass


def install_kill(monkeypatch, at: int) -> list:
    """Make the `at`-th disk-changing call (1-based; 0: none) kill the save; returns the call log."""
    log = []
    for owner, name in POINTS:
        real = getattr(owner, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            log.append(_name)
            if at and len(log) >= at:  # and every later call: a killed process runs no clean-up either
                raise Killed(f"killed at {_name} (call {at})")
            return _real(*args, **kwargs)
        monkeypatch.setattr(owner, name, wrapped)
    return log


def quiet_load(root) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return loaded_step(root)


def baseline(root, damage_last: bool = False):
    for step in (1, 2, 3):
        save(root, step, keep_last=2)
    if damage_last:
        flip_bytes(shard(root / "step_00000003"))
    return root


@pytest.mark.parametrize("case, step, allowed", [
    ("new step", 4, {3, 4}),                      # includes retention deleting step 2
    ("replace a damaged step", 3, {2, 3}),        # step 3 is damaged: set aside, then written anew
])
def test_a_save_killed_at_every_point_leaves_an_intact_step(tmp_path, monkeypatch, case, step, allowed):
    base = baseline(tmp_path / "base", damage_last=case != "new step")
    probe = tmp_path / "probe"
    shutil.copytree(base, probe)
    with monkeypatch.context() as m:
        calls = install_kill(m, at=0)
        save(probe, step, keep_last=2)
    assert {"mkdir", "create_stream", "fsync", "replace", "rename"} <= set(calls) and len(calls) >= 10, calls
    for k in range(1, len(calls) + 1):
        root = tmp_path / f"k{k}"
        shutil.copytree(base, root)
        with monkeypatch.context() as m:
            install_kill(m, at=k)
            with pytest.raises(Killed):
                save(root, step, keep_last=2)
        assert quiet_load(root) in allowed, (k, calls[k - 1], sorted(p.name for p in root.iterdir()))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            save(root, step, keep_last=2)  # the restarted job saves again (or finds it already saved)
        assert quiet_load(root) == step, k
        assert not list(root.glob(".tmp-*")) and not list(root.glob(".step_*")), (k, list(root.iterdir()))
        shutil.rmtree(root)


CHILD = textwrap.dedent("""
    import sys
    from tests.unit.test_checkpoint_safety import save
    from megatron_fp4.training.checkpoint import directory as ckpt
    root = sys.argv[1]
    step = (ckpt.latest_step(root) or 0) + 1
    print("start", step, flush=True)
    while True:
        save(root, step, keep_last=2)
        print("saved", step, flush=True)
        step += 1
""")


def test_sigkilled_saving_process_always_resumes_from_an_intact_step(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pathlib.Path(__file__).resolve().parents[2]),
                                                         os.environ.get("PYTHONPATH", "")])}
    root, last_saved = tmp_path / "ckpt", 0
    for cycle in range(4):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(root)], stdout=subprocess.PIPE, text=True,
                                 env=env, cwd=pathlib.Path(__file__).resolve().parents[2])
        saves_wanted = 3 + cycle  # kill at a different point of the save cycle each time
        for line in child.stdout:
            kind, number = line.split()
            if kind == "start":
                assert int(number) == last_saved + 1  # resumed right after the newest complete step
            else:
                last_saved = int(number)
                saves_wanted -= 1
                if saves_wanted == 0:
                    child.send_signal(signal.SIGKILL)
                    break
        child.wait()
        step = quiet_load(root)
        assert step >= last_saved, (step, last_saved)
        last_saved = step
