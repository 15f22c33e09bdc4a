"""One verl GRPO step with the megatron_fp4 engine and rollout, on CPU, through verl's own worker code.

    VERL_PLATFORM=cpu PYTHONPATH=$PWD python examples/verl/cpu_step.py [--model-path DIR] [--steps N] [--out F]

verl's trainer (`RayPPOTrainer.fit`) needs Ray and its rollout servers (the agent loop talks to
server actors), so this runs the narrowest verl-driven flow that works without them, in one process:

  * verl's config tree (`ppo_trainer.yaml`, composed by hydra) with the overrides a verl user writes:
    `actor_rollout_ref.actor.strategy=megatron_fp4`, `actor_rollout_ref.rollout.name=megatron_fp4`;
  * verl's hybrid worker `ActorRolloutRefWorker(role="actor_rollout")`: its `init_model` builds the
    actor's `TrainingWorker` (our engine through `EngineRegistry`), the rollout through verl's rollout
    registry and the checkpoint engine through `CheckpointEngineRegistry`;
  * generation by the worker's rollout (`generate_sequences`: what verl's server would serve),
    rule-based rewards, verl's `compute_grpo_outcome_advantage`;
  * verl's trainer code for old log-probs and the update (`RayPPOTrainer._compute_old_log_prob` /
    `_update_actor`, called with this worker standing in for the Ray worker group), then the
    worker's `update_weights` (actor -> rollout, `checkpoint_engine.backend`: naive).

Without `--model-path` a tiny Qwen3-MoE (random weights) is written to a temporary directory.
Prints one JSON line of metrics per step.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

PROMPTS = ["12+7=", "3*4=", "100-99=", "5+5="]


def overrides(model_path: str, batch_size: int, n: int, response_length: int) -> list[str]:
    """The hydra overrides of verl's ppo_trainer config for this engine on CPU."""
    rollout = "actor_rollout_ref.rollout"
    actor = "actor_rollout_ref.actor"
    return [
        f"actor_rollout_ref.model.path={model_path}", "+actor_rollout_ref.model.load_tokenizer=False",
        f"{actor}.strategy=megatron_fp4", f"{rollout}.name=megatron_fp4",
        f"{actor}.fsdp_config.dtype=float32",  # the engine reads dtype from verl's engine config
        f"{actor}.ppo_mini_batch_size={batch_size}", f"{actor}.ppo_micro_batch_size_per_gpu=2",
        f"{actor}.use_dynamic_bsz=False", f"{actor}.optim.lr=1e-3",
        f"{rollout}.log_prob_micro_batch_size_per_gpu=2", f"{rollout}.n={n}",
        f"{rollout}.response_length={response_length}", f"{rollout}.prompt_length=16",
        f"{rollout}.tensor_model_parallel_size=1", f"{rollout}.checkpoint_engine.backend=naive", f"{rollout}.free_cache_engine=False",
        "algorithm.adv_estimator=grpo",
    ]


def verl_config(model_path: str, batch_size: int = 4, n: int = 2, response_length: int = 6):
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides(model_path, batch_size, n, response_length))


def _tiny_checkpoint(out_dir: Path) -> str:
    from megatron_fp4.config import Config
    from megatron_fp4.integrations.hf import save_hf_checkpoint
    from megatron_fp4.model import build_model
    from megatron_fp4.parallel.mesh import shutdown_process_groups
    from megatron_fp4.training.data import ArithmeticTokenizer

    cfg = Config()
    cfg.model.vocab_size, cfg.model.num_layers = ArithmeticTokenizer().vocab_size, 2
    return str(save_hf_checkpoint(build_model(cfg, seed=0), cfg, out_dir / "qwen3_moe_tiny"))


def _init_process_group() -> None:
    """verl's workers expect torch.distributed up (under Ray verl starts it with NCCL+gloo; on CPU the
    default group must be gloo, which verl then leaves as it is)."""
    import torch.distributed as dist

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def build_worker(config):
    from verl.workers.engine_workers import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker(config=config.actor_rollout_ref, role="actor_rollout")
    worker.init_model()
    return worker


def _rewards(batch, tokenizer) -> "torch.Tensor":
    """1 for a right answer (the arithmetic task's own checker on the decoded response), else 0.1 × the
    fraction of digits in it: a random model almost never answers right, and a group whose rewards are
    all equal has zero GRPO advantage (no update to show)."""
    import torch

    from megatron_fp4.training.data.arithmetic import check_answer

    scores = torch.zeros(batch["responses"].shape, dtype=torch.float32)
    for i in range(scores.shape[0]):
        mask = batch["attention_mask"][i, :batch["prompts"].shape[1]].bool()
        prompt = tokenizer.decode(batch["prompts"][i][mask].tolist())
        length = int(batch["response_mask"][i].sum())
        response = tokenizer.decode(batch["responses"][i, :length].tolist())
        digits = sum(c.isdigit() for c in response) / max(1, len(response))
        scores[i, max(length - 1, 0)] = 1.0 if check_answer(prompt, response) else 0.1 * digits
    return scores


def grpo_step(worker, config, step: int, tokenizer) -> dict:
    import numpy as np
    import torch
    from verl import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from megatron_fp4.rollout.engine import left_pad

    n = config.actor_rollout_ref.rollout.n
    texts = [p for p in PROMPTS for _ in range(n)]
    ids, mask = left_pad([tokenizer.encode(t, add_eos=False) for t in texts], tokenizer.pad_id)
    prompts = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask},
                                  meta_info={"eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id,
                                             "seeds": [step * len(texts) + i for i in range(len(texts))]})
    batch = worker.rollout.generate_sequences(prompts)
    scores = _rewards(batch.batch, tokenizer)
    batch.batch["token_level_scores"] = batch.batch["token_level_rewards"] = scores
    advantages, returns = compute_grpo_outcome_advantage(scores, batch.batch["response_mask"],
                                                         np.repeat(np.arange(len(PROMPTS)), n))
    batch.batch["advantages"], batch.batch["returns"] = advantages, returns
    batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(-1).tolist()

    # verl's trainer methods, with this (local) worker in the place of the Ray worker group
    trainer = SimpleNamespace(config=config, actor_rollout_wg=worker, distillation_config=None)
    old, _ = RayPPOTrainer._compute_old_log_prob(trainer, batch)
    batch = batch.union(old)
    metrics = RayPPOTrainer._update_actor(trainer, batch).meta_info["metrics"]
    asyncio.run(worker.update_weights(global_steps=step + 1))
    rollout_lp = batch.batch["rollout_log_probs"][batch.batch["response_mask"].bool()]
    train_lp = batch.batch["old_log_probs"][batch.batch["response_mask"].bool()]
    actor_sd, rollout_sd = worker.actor.engine.model.state_dict(), worker.rollout.engine.model.state_dict()
    return {"step": step + 1, "reward_mean": float(scores.sum(-1).mean()),
            "rollout_vs_train_logprob_max_abs_diff": float((rollout_lp - train_lp).abs().max()),
            "rollout_weight_version": worker.rollout.engine.version,
            "rollout_weights_equal_actor": all(torch.equal(actor_sd[k], rollout_sd[k]) for k in actor_sd),
            **{k: _number(v) for k, v in metrics.items() if _number(v) is not None}}


def _number(value):
    """A verl metric as one float: `Metric`s by their own aggregation, lists by their mean."""
    from verl.utils.metric import Metric

    if isinstance(value, Metric):
        return float(value.aggregate())
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
        return float(sum(value) / len(value))
    return float(value) if isinstance(value, (int, float)) else None


def require_cpu_platform() -> None:
    import megatron_fp4.verl  # noqa: F401  registers platform, engine, rollout, checkpoint engine
    from verl.utils.device import get_device_name

    if get_device_name() != "cpu":
        raise SystemExit(f"verl resolved its platform to {get_device_name()!r}; run with VERL_PLATFORM=cpu "
                         "(set before verl's engine modules are imported, i.e. in the environment)")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", help="a Qwen3-MoE HF checkpoint directory (default: a tiny random one)")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--out", help="write the metrics (a JSON list) here")
    args = parser.parse_args(argv)
    from megatron_fp4.parallel.mesh import shutdown_process_groups
    from megatron_fp4.training.data import ArithmeticTokenizer

    require_cpu_platform()

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model_path or _tiny_checkpoint(Path(tmp))
        _init_process_group()
        config = verl_config(path)
        worker = build_worker(config)
        tokenizer = ArithmeticTokenizer()
        results = []
        for step in range(args.steps):
            results.append(grpo_step(worker, config, step, tokenizer))
            print(json.dumps(results[-1], sort_keys=True), flush=True)
        del worker  # it holds the groups: freed first, then destroyed with every rank here (train.py's exit path)
        shutdown_process_groups()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
