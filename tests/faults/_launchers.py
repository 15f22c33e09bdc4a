"""Run `tools/launchers/train.sh` on a tiny job for the launcher fault tests and read its losses."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN_SH = REPO / "tools" / "launchers" / "train.sh"
# A tiny job: 2 layers, 8 steps, a checkpoint every 2 steps; the same in every run compared.
TINY = ["model.num_layers=2", "schedule.seq_len=32", "schedule.global_batch_size=8", "schedule.micro_batch_size=4",
        "schedule.train_steps=8", "schedule.warmup_steps=0", "checkpoint.save_interval=2", "checkpoint.keep_last=0",
        "logging.progress=false", "logging.tensorboard_dir=null", "parallel.timeout_s=60"]


def train_sh(workdir: Path, name: str, torchrun_args=(), extra=(), fault: str = "", nproc: int = 2,
             timeout_s: float = 240) -> tuple[subprocess.CompletedProcess, dict]:
    """Run train.sh NPROC [torchrun_args --] TINY+extra with the fault-injecting entry point.
    Returns (the finished process, {step: loss as float.hex} of the last stage)."""
    log = workdir / f"{name}.losses"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "TRAIN_MODULE": "tests.faults._launch_worker", "LOSS_LOG": str(log), "FAULT": fault,
           "EXIT_THREADS_LOG": str(workdir / f"{name}.exit_threads"), "OMP_NUM_THREADS": "1"}
    sets = [a for kv in [*TINY, f"checkpoint.dir={workdir / name}", *extra] for a in ("--set", kv)]
    argv = ["bash", str(TRAIN_SH), str(nproc), *([*torchrun_args, "--"] if torchrun_args else []), *sets]
    # Own session: on a timeout (a hung restart) torchrun *and* its workers are killed, not orphaned.
    with subprocess.Popen(argv, env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as child:
        try:
            out, err = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            out, err = child.communicate()
            raise AssertionError(f"{name}: no result within {timeout_s:.0f}s (hung?):\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(argv, child.returncode, out, err), read_losses(log)


def exit_threads(workdir: Path, name: str) -> dict:
    """{rank: gloo worker threads it still had at exit} of run `name` (every attempt that got to
    the end appends; `_launch_worker` records them)."""
    path = workdir / f"{name}.exit_threads"
    return {int(rank): int(n) for rank, n in (line.split() for line in path.read_text().splitlines())} \
        if path.exists() else {}


def read_losses(path: Path) -> dict:
    """{step: loss hex}; a step run twice (recomputed after a resume) must have the same bits."""
    losses: dict = {}
    for line in path.read_text().splitlines() if path.exists() else ():
        step, value = line.split()
        assert losses.setdefault(int(step), value) == value, f"step {step} recomputed as {value}, was {losses[int(step)]}"
    return losses


def reference_losses(workdir: Path) -> dict:
    """The uninterrupted run of the tiny job (what every interrupted run must end with)."""
    proc, losses = train_sh(workdir, "reference")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(losses) == list(range(8))
    return losses
