"""The tp2×pp2×ep2 command of docs/usage.md and docs/parallel.md (8 processes, `--set parallel.tp=2
--set parallel.pp=2 --set parallel.ep=2`, dp = 2; here through `tools/launchers/train.sh 8`) trains at
tiny size: every step's loss reaches the last stage's log, the loss falls, and a checkpoint is
written. (Its numerics against the single process: ``test_tp_trainer.py``'s ``tp2_pp2_ep2``.)"""
from __future__ import annotations

import pytest

from tests.faults._launchers import train_sh

pytestmark = pytest.mark.distributed

STEPS = 4
# micro-batches of 2: dp 2 leaves 2 per step, the pp=2 that 1F1B needs
TP2_PP2_EP2 = ["parallel.tp=2", "parallel.pp=2", "parallel.ep=2", f"schedule.train_steps={STEPS}",
               "schedule.micro_batch_size=2"]


def test_cli_tp2_pp2_ep2_trains(tmp_path):
    proc, losses = train_sh(tmp_path, "run", extra=TP2_PP2_EP2, nproc=8, timeout_s=480)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(losses) == list(range(STEPS)), losses
    first, last = float.fromhex(losses[0]), float.fromhex(losses[STEPS - 1])
    assert last < first, (first, last)
    assert any((tmp_path / "run").glob("step_*")) or (tmp_path / "run" / "latest").exists()
