"""The main job's CLI under torchrun with tensor parallel (`tools/launchers/train.sh 4 --set
parallel.tp=2 --set parallel.pp=2`, the command of docs/parallel.md): it trains, and a second run
of the same job gives the same losses bit for bit (float.hex of every step): collectives run in a
fixed rank order, every layout's kernels are deterministic. Every rank ends with its process groups
destroyed: no gloo worker thread is left to run into the interpreter's teardown (the rare
"terminate called without an active exception" abort of a rank, `parallel.mesh.shutdown_process_groups`)."""
from __future__ import annotations

import pytest

from tests.faults._launchers import exit_threads, train_sh

pytestmark = pytest.mark.distributed

TP2_PP2 = ["parallel.tp=2", "parallel.pp=2"]


def test_cli_tp2_pp2_runs_twice_with_the_same_losses(tmp_path):
    runs = []
    for name in ("first", "second"):
        proc, losses = train_sh(tmp_path, name, extra=TP2_PP2, nproc=4, timeout_s=480)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert sorted(losses) == list(range(8)), losses
        assert exit_threads(tmp_path, name) == dict.fromkeys(range(4), 0)
        runs.append(losses)
    assert runs[0] == runs[1]
    first, last = float.fromhex(runs[0][0]), float.fromhex(runs[0][7])
    assert last < first, (first, last)  # it trains
    assert (tmp_path / "first" / "latest").exists() or any((tmp_path / "first").glob("step_*"))
