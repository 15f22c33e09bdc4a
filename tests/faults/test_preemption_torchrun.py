"""Issue 17 row 3 under torchrun (2 gloo workers, through tools/launchers/train.sh).

SIGUSR1 to torchrun's agent (what Slurm's --signal or scancel delivers) is forwarded to every
worker (train.sh adds SIGUSR1 to torchrun's --signals-to-handle); the workers finish the step,
save it and exit with code 4; running the same command again resumes there (the launcher's
default checkpoint.load=auto) and ends with the uninterrupted run's losses, bit for bit. A signal
that reaches one rank only still stops both after the same step (the mesh-wide vote).
"""
import pytest

from tests.faults._launchers import exit_threads, train_sh

pytestmark = [pytest.mark.faults, pytest.mark.distributed]


def test_signal_to_torchrun_saves_exits_and_resumes_to_the_same_losses(tmp_path, tiny_reference):
    first, losses = train_sh(tmp_path, "job", fault="signal:0:4:SIGUSR1:agent")
    assert first.returncode != 0, first.stderr[-3000:]
    assert "preempted by SIGUSR1: stopped after step 5; saved checkpoint step 5" in first.stderr, first.stderr[-3000:]
    assert sorted(losses) == [0, 1, 2, 3, 4]
    assert (tmp_path / "job" / "step_00000005" / "meta.json").exists()
    again, losses = train_sh(tmp_path, "job")
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("resumed from") == 1 and "at step 5" in again.stderr  # rank 0 only
    assert losses == tiny_reference


def test_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    proc, losses = train_sh(tmp_path, "job", fault="signal:1:2:SIGTERM")  # rank 1 only, after step index 2
    assert "exitcode: 4" in proc.stderr, proc.stderr[-3000:]  # torchrun's summary of the workers' exit
    assert "preempted by a signal to rank 1: stopped after step 3" in proc.stderr  # printed by rank 0
    assert sorted(losses) == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / "job").glob("step_*")) == ["step_00000002", "step_00000003"]
    assert exit_threads(tmp_path, "job") == {0: 0, 1: 0}  # a preempted exit destroys its groups too
