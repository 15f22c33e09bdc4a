"""The documented command (docs/verl.md): one GRPO step driven by verl's own worker and trainer code
on CPU (`ActorRolloutRefWorker.init_model` building our engine, rollout and checkpoint engine from
verl's config tree; `RayPPOTrainer._compute_old_log_prob` / `_update_actor`; the worker's
`update_weights`). Run as a user runs it: `examples/verl/cpu_step.py` in a fresh process with
VERL_PLATFORM=cpu."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cachetools  # noqa: F401 - verl's ray_trainer imports it; the test extra installs both: fail, never skip
import verl  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "examples" / "verl"


def _env(**extra) -> dict:
    """This environment with the repository first on PYTHONPATH (the script imports this checkout's
    megatron_fp4, as `PYTHONPATH=$PWD python examples/verl/cpu_step.py` does)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def test_cpu_step_runs_verls_worker_and_trainer_code(tmp_path):
    out = tmp_path / "metrics.json"
    env = _env(VERL_PLATFORM="cpu", OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, str(HARNESS / "cpu_step.py"), "--steps", "2",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = json.loads(out.read_text())
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["rollout_weight_version"] == s["step"] and s["rollout_weights_equal_actor"]
        # verl's default scheduler is constant (its min_lr_ratio=0 must not decay the lr to 0)
        assert s["actor/lr"] == pytest.approx(1e-3, rel=1e-6)
        assert s["actor/grad_norm"] > 0 and "actor/pg_loss" in s
        # same weights, same numerics (MoEResQ on both sides), batch-invariant scoring: the rollout's
        # log-probs are the trainer's bit for bit
        assert s["rollout_vs_train_logprob_max_abs_diff"] == 0.0


def test_cpu_step_asks_for_the_platform_switch():
    from verl.utils.device import get_device_name

    sys.path.insert(0, str(HARNESS))
    from cpu_step import require_cpu_platform

    if get_device_name() != "cpu":
        with pytest.raises(SystemExit, match="VERL_PLATFORM=cpu"):  # verl fell back to (or found) CUDA here
            require_cpu_platform()
        return
    # this process already runs on verl's cpu platform (VERL_PLATFORM=cpu in the environment): ask a
    # fresh process without it
    env = {k: v for k, v in _env().items() if k != "VERL_PLATFORM"}
    proc = subprocess.run([sys.executable, "-c", "from cpu_step import require_cpu_platform; require_cpu_platform()"],
                          cwd=HARNESS, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "VERL_PLATFORM=cpu" in proc.stderr, (proc.returncode, proc.stderr[-2000:])


def test_verl_imports_the_adapters_itself_from_its_environment_switch():
    """VERL_USE_EXTERNAL_MODULES (docs/verl.md): `import verl` registers everything, in any process
    that inherits the environment (Ray workers), before verl's engine modules resolve the platform."""
    code = ("from verl.utils.device import get_device_name\n"
            "from verl.workers.engine.base import EngineRegistry\n"
            "from verl.workers.rollout.base import get_rollout_class\n"
            "from verl.workers.rollout.replica import get_rollout_replica_class\n"
            "from verl.checkpoint_engine.base import CheckpointEngineRegistry\n"
            "print(get_device_name(), EngineRegistry.get_engine_cls('language_model', 'megatron_fp4').__name__,\n"
            "      get_rollout_class('megatron_fp4', 'async').__name__, get_rollout_replica_class('megatron_fp4').__name__,\n"
            "      CheckpointEngineRegistry.get('megatron_fp4').__name__)\n")
    env = _env(VERL_PLATFORM="cpu", VERL_USE_EXTERNAL_MODULES="megatron_fp4.verl")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["cpu", "MegatronFP4Engine", "MegatronFP4Rollout", "MegatronFP4Replica",
                                   "MegatronFP4CheckpointEngine"]
