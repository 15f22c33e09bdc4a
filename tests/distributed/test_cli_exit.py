"""How a torchrun job of the CLI ends: every rank destroys its process groups before the
interpreter's teardown (`parallel.mesh.shutdown_process_groups` says why: otherwise a gloo worker
thread can abort the rank, rarely, with "terminate called without an active exception"), also when
the run stops on a user error. Trained and preempted exits: test_tp_trainer_cli,
tests/faults/test_preemption_torchrun."""
from __future__ import annotations

import pytest

from tests.faults._launchers import exit_threads, train_sh

pytestmark = pytest.mark.distributed


def test_a_user_error_after_the_groups_exist_exits_2_with_them_destroyed(tmp_path):
    missing = tmp_path / "no_such_checkpoint"
    proc, losses = train_sh(tmp_path, "job", extra=[f"checkpoint.load={missing}"], nproc=2)
    assert proc.returncode != 0 and "exitcode: 2" in proc.stderr, proc.stderr[-3000:]
    assert "checkpoint error" in proc.stderr and losses == {}
    assert exit_threads(tmp_path, "job") == {0: 0, 1: 0}
