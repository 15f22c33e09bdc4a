"""The overlapped loop (``--max-staleness 1``) on a sharded trainer: 2 gloo trainer processes under
torchrun at pp=2, the rollout engine in a process of its own (`rl.RemoteRollout`: rank 0 asks for
the next batch on the rollout's thread, the batch is broadcast to both ranks on the main thread),
against the single-process trainer with the same rollout process (``--rollout engine-process``).

Holds by construction (checked exactly): both sample batches 0, 1, 2 with versions 0, 0, 1, and the
version-0 batches 0 and 1 are the same completions (the same weights reach the same engine: the
publisher only moves bytes). Step 0 starts from the same weights on the same batch: its loss
agrees to ``FP64_REL`` (float64; only the order of sums differs between layouts, tests/numerics.py).
Later steps are not compared numerically: after the first updates the two layouts' weights differ
by what Adam's first steps make of last-bit gradient differences, at staleness 0 as well.

Resume (dp=2): a run killed with a batch in flight and resumed from its checkpoint (`rl.resume`)
equals the run never stopped, bit for bit (the same layout on both sides)."""
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.distributed.launch import free_port
from tests.numerics import FP64_REL

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests" / "integration" / "async_grpo_job.py"


def job(out: Path, *launcher_and_flags: str, kill_at=None) -> list:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if kill_at is not None:
        env["ASYNC_GRPO_JOB_KILL_AT_STEP"] = str(kill_at)
    done = subprocess.run([*launcher_and_flags[:-1], str(JOB), str(out), *launcher_and_flags[-1].split()], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    if kill_at is not None:
        assert done.returncode != 0 and f"killed in step {kill_at}" in done.stderr, done.stderr[-3000:]
        return []
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def torchrun() -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]


def test_dp2_trainer_resumes_with_batches_in_flight(tmp_path):
    """dp=2 under torchrun, k = 1, checkpoints every 2 steps: killed in step 2's update (batch 3 in
    flight), resumed from the checkpoint after step 1 (batch 2 saved in flight): steps 2 and 3 train
    the same (batch, version)s with the same losses (float.hex) as the run never stopped."""
    flags = ("--steps 4 --kl-coef 0 --checkpoint-every 2 --set parallel.dp=2 --set parallel.timeout_s=120 "
             "--set checkpoint.dir=")
    whole = job(tmp_path / "whole.json", *torchrun(), flags + str(tmp_path / "whole"))
    job(tmp_path / "killed.json", *torchrun(), flags + str(tmp_path / "killed"), kill_at=2)
    resumed = job(tmp_path / "resumed.json", *torchrun(), flags + str(tmp_path / "killed") + " --resume")
    assert [s["version"] for s in whole] == [0, 0, 1, 2]
    assert [s["step"] for s in resumed] == [2, 3]
    assert resumed == whole[2:]  # losses (float.hex), completions, versions


def test_pp2_trainer_overlaps_like_the_single_process_one(tmp_path):
    sharded = job(tmp_path / "pp2.json", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                  "--master-port", str(free_port()), "--set parallel.pp=2")
    single = job(tmp_path / "single.json", sys.executable, "--rollout engine-process")
    assert [s["version"] for s in sharded] == [s["version"] for s in single] == [0, 0, 1]
    assert [s["completions"] for s in sharded[:2]] == [s["completions"] for s in single[:2]]
    loss0 = float.fromhex(sharded[0]["loss"]), float.fromhex(single[0]["loss"])
    assert loss0[1] != 0 and abs(loss0[0] - loss0[1]) <= FP64_REL * abs(loss0[1]), loss0
