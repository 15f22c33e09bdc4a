"""A tiny overlapped GRPO run of examples/grpo_moeresq.py, for tests/integration/test_async_grpo_torchrun.py:

    torchrun --nproc-per-node 2 tests/integration/async_grpo_job.py OUT.json [example flags...]
    python tests/integration/async_grpo_job.py OUT.json --rollout engine-process [example flags...]

Rank 0 writes each step's loss (float.hex), reward, completions, sampling version and step as JSON.
ASYNC_GRPO_JOB_KILL_AT_STEP=n in the environment: the trainer dies in step n's update (a resume test)."""
import importlib.util
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# The arithmetic task, from scratch, on a 1-layer fp64 model (float64: layouts agree to FP64_REL).
FLAGS = ["--task", "arithmetic", "--sft-steps", "0", "--steps", "3", "--num-prompts", "2", "--group-size", "4",
         "--max-new-tokens", "3", "--eval-size", "4", "--eval-every", "0", "--max-staleness", "1", "--logdir", "",
         "--set", "model.num_layers=2", "--set", "model.hidden_size=32", "--set", "model.num_heads=2",
         "--set", "model.num_kv_heads=1", "--set", "model.moe_ffn_hidden_size=32", "--set", "model.num_experts=4",
         "--set", "dtype=fp64"]


def main(out: str, extra: list) -> None:
    spec = importlib.util.spec_from_file_location("grpo_moeresq", ROOT / "examples" / "grpo_moeresq.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    # rewards that vary inside every group from scratch (the completion's length), so every step updates
    ex.ArithmeticTask.reward = lambda self, item, completion: float(len(completion))
    kill_at = os.environ.get("ASYNC_GRPO_JOB_KILL_AT_STEP")  # the trainer dies in that step's update
    if kill_at is not None:
        from megatron_fp4.rl import loop
        real = loop.update_on

        def update_on(trainer, task, scorer, loss, settings, step, *a):
            if step == int(kill_at):
                raise SystemExit(f"killed in step {step}")
            return real(trainer, task, scorer, loss, settings, step, *a)
        loop.update_on = update_on
    history = ex.run(ex.parse_args(FLAGS + extra))
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out).write_text(json.dumps([{"loss": float.hex(h["loss"]), "reward": h["reward"],
                                          "completions": h["completions"], "version": h["rollout_version"],
                                          "step": h["step"]}
                                         for h in history]))
    from megatron_fp4.parallel.mesh import shutdown_process_groups

    shutdown_process_groups()  # parallel/mesh.py: why not at the interpreter's exit (a rare SIGABRT under load)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
