"""verl's own PPO trainer (`main_ppo.run_ppo`, `RayPPOTrainer.fit`, a local Ray on CPU) for 2 steps with
the megatron_fp4 engine as the actor and verl's vLLM rollout (`rollout.name=vllm`, its async server)
serving with the megatron_fp4 plugin (MoEResQ FP4 experts): `python
examples/verl/ppo_vllm.py`, run as a user runs it.

Checked: every sync (before the first rollout and after each update) leaves the weights vLLM serves
(read back from its parameters) equal to the actor's, SHA-256 per tensor; the updates changed the
weights (a sync check over unchanged weights would prove nothing); and vLLM's rollout log-probs
equal the actor's old log-probs bitwise at every token: the actor computes at the numerics level the
plugin serves the checkpoint at (`verl/construct.checkpoint_numerics_level`,
`integrations/vllm/sidecar.served_level`: `batch`, the export's default), so the logits are the same
bits on both sides, and at `batch` both log-softmaxes are ATen's row-local kernel
(test_vllm_exact). Measured: 0 on every token of both steps (when the plugin served `batch` exports at
`exact`: max 4.8e-7; before the actor followed the served level, an input near an FP4 rounding
boundary flipped codes on half of a step's tokens, max 3.9e-4 on another CPU).

Needs vLLM, verl and verl's trainer dependencies in one environment: the vLLM venv that
tools/vllm_env.sh builds (verl installed there without its dependencies). Skips with the reason
elsewhere (the main environment has verl but not vLLM). Slow: vLLM's start and Ray take minutes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl is not installed: pip install -e '.[verl]' (main environment) or run "
                    "tools/vllm_env.sh (the vLLM venv gets verl without its dependencies)")
ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "examples" / "verl"
sys.path.insert(0, str(HARNESS))

from ppo_vllm import CHECKS, main, missing_for_ppo, ray_runtime_env  # noqa: E402
from megatron_fp4.rl.tasks.rewards import digit_match_score as compute_score  # noqa: E402

MISSING = missing_for_ppo()


def test_rule_reward():
    assert compute_score("arith", "the answer is 5", "5") == 1.0
    assert compute_score("arith", "54", "5") == pytest.approx(0.1)
    assert compute_score("arith", "ab!!", "5") == pytest.approx(0.05)


def test_refuses_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--steps", "0"])
    assert e.value.code == 2 and "--steps must be >= 1" in capsys.readouterr().err
    (tmp_path / "old").write_text("x")
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path)])
    assert e.value.code == 2 and "must be a new or empty directory" in capsys.readouterr().err


def test_ray_workers_import_the_harness_modules():
    """Ray's workers import `ppo_checks` and vLLM's `vllm_extension` by name: the job's runtime env puts
    their folder first on PYTHONPATH and keeps what the driver had (megatron_fp4 may come from there)."""
    path = ray_runtime_env({"PYTHONPATH": "/src:/other"})["env_vars"]["PYTHONPATH"].split(os.pathsep)
    assert path == [str(HARNESS), "/src", "/other"]
    assert ray_runtime_env({})["env_vars"]["PYTHONPATH"] == str(HARNESS)
    code = "import ppo_checks, vllm_extension; print(ppo_checks.CheckedTaskRunner.__module__)"
    env = {**os.environ, **ray_runtime_env()["env_vars"]}
    r = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True, timeout=300)
    if MISSING:  # vllm_extension needs vLLM: without it, the harness folder is still found
        assert "No module named 'ppo_checks'" not in r.stderr, r.stderr[-2000:]
        return
    assert r.returncode == 0 and r.stdout.split()[-1] == "ppo_checks", r.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(1500)  # ~4 min on an idle 2-core box; Ray + vLLM + verl start slowly under load
@pytest.mark.skipif(bool(MISSING), reason=MISSING or "ok")
def test_verl_ppo_with_vllm_rollout(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    r = subprocess.run([sys.executable, str(HARNESS / "ppo_vllm.py"), "--steps", "2",
                        "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / CHECKS).read_text().splitlines()]
    syncs = [x for x in records if x["kind"] == "sync"]
    steps = [x for x in records if x["kind"] == "step"]
    assert [x["global_steps"] for x in steps] == [1, 2]
    assert len(syncs) == 3 and all(x["equal"] and x["servers"] == 1 and x["tensors"] > 0 for x in syncs), syncs
    assert len({x["weights_sha256"] for x in syncs}) == 3, "the updates did not change the weights"
    for x in steps:
        diffs = x["abs_logprob_diffs"]
        assert len(diffs) == x["tokens"] > 0, x
        assert max(diffs) == 0.0, x
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["all_synced_equal"] and summary["steps"] == 2
