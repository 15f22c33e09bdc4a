"""GRPO on a sharded trainer with a separate rollout process equals the single-process GRPO step.

Sharded: 4 gloo trainer processes at pp2 × dp2 with ep2 (`Trainer(cfg, mesh)`), the rollout engine
in a process of its own started by trainer rank 0 (`rl.RemoteRollout`: token-authenticated
channels, weights gathered by `ShardedWeightPublisher` under HF names, generations back as JSON +
tensors and broadcast to every trainer rank). Reference: one process, `InProcessRollout`. Both run
the same library calls (`rl.build_rl_batch`, `rl.ppo_updates` with the `PolicyLoss`, KL to the
frozen initial policy), float64 (``dtype: fp64``), FP4 MoEResQ experts.

- same rollouts, bitwise: every layout starts from the single-process weights by construction, the
  publisher only moves their bytes, and both engines run the same kernels on the same shapes with
  one thread;
- old/reference log-probs, losses and the weights after the update: within ``FP64_REL`` (only the
  order of fp64 sums differs between layouts; tests/numerics.py); the trainer-side routing
  (gathered from every stage) picks the same experts;
- the rollout process serves what the trainer holds after the update: the SHA-256 of each of its
  weights under HF names equals that of the trainer's shard owning it (bitwise), and the next
  rollout ran on the published version.
"""
import hashlib
import random

import pytest
import torch

from tests.distributed.launch import run_distributed
from tests.distributed.test_parallel_training import tiny_cfg
from tests.numerics import FP64_REL, rel, single_thread

NUM_PROMPTS, GROUP, MICRO = 4, 4, 2
LOSS = dict(clip_eps=0.2, tis_cap=2.0, kl_coef=0.1)


def cfg_for(**parallel):
    cfg = tiny_cfg(fp4=True, **parallel)
    cfg.optimizer.lr, cfg.optimizer.weight_decay = 1e-3, 0.0
    return cfg


def prompts_and_params():
    from megatron_fp4.rollout import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(1, 32) for _ in range(3 + i % 3)] for i in range(NUM_PROMPTS)]
    prompts = [p for p in prompts for _ in range(GROUP)]
    params = [SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=(3,), seed=1000 + i)
              for i in range(len(prompts))]
    return prompts, params


def token_reward(response_ids) -> float:
    """Deterministic and varied inside a group (a random model answers nothing right)."""
    return float(sum(response_ids) % 3) / 2


def grpo_step(trainer, rollout) -> dict:
    """Publish v0, roll out, one PPO pass (2 minibatches), publish v1, roll out again on v1."""
    from megatron_fp4.rl import PolicyScorer, build_rl_batch, ppo_updates
    from megatron_fp4.rl.algo.policy_loss import PolicyLoss

    scorer = PolicyScorer(trainer, MICRO, keep_reference=True)
    rollout.publish(0).wait_loaded()
    prompts, params = prompts_and_params()
    gen = rollout.generate(prompts, params, return_routing=True, min_version=0)
    rewards = torch.tensor([token_reward(r) for r in gen.response_ids])
    batch = build_rl_batch(gen, rewards, GROUP, scorer, pad_id=0)
    result = ppo_updates(trainer, batch, PolicyLoss(**LOSS), MICRO, ppo_epochs=1, minibatches=2,
                         rng=random.Random(1))
    handle = rollout.publish(1)
    handle.wait_loaded()
    again = rollout.generate(prompts[:2], params[:2], min_version=1)
    return dict(response_ids=gen.response_ids, log_probs=gen.log_probs, version=gen.version, rewards=rewards,
                old=batch["old_log_probs"], ref=batch["ref_log_probs"], routing=batch["train_routing"],
                again_version=again.version,
                result={k: v for k, v in result.items() if k != "tokens_per_s"})


def _sharded(rank, world_size):
    from megatron_fp4.integrations.hf.sharded import local_hf_state_dict
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.rl import RemoteRollout, switch_to_rl
    from megatron_fp4.training.trainer import Trainer

    cfg = cfg_for(pp=2, ep=2)
    trainer = Trainer(cfg, ParallelMesh.build(2, 2, 2), build_data=False)
    switch_to_rl(trainer, cfg.optimizer.lr, 0.0, 0.0)
    rollout = RemoteRollout(trainer, pad_id=0, bucket_bytes=64 << 10, timeout_s=120)
    try:
        out = grpo_step(trainer, rollout)
        out["served"] = rollout.digests() if rank == 0 else None
        out["served_version"] = rollout.served_version()
    finally:
        rollout.close()
    out["weights"] = {n: t.detach().clone() for n, t in local_hf_state_dict(trainer.model).items()}
    out["exit_code"] = rollout.proc.returncode if rank == 0 else None
    trainer.optimizer.remove_hooks()
    return out


@pytest.fixture(scope="module")
def reference():
    from megatron_fp4.integrations.hf import to_hf_state_dict
    from megatron_fp4.rl import InProcessRollout, switch_to_rl
    from megatron_fp4.training.trainer import Trainer

    with single_thread():  # the distributed children and the rollout process run one thread
        cfg = cfg_for()
        trainer = Trainer(cfg, build_data=False)
        switch_to_rl(trainer, cfg.optimizer.lr, 0.0, 0.0)
        init = {n: t.detach().clone() for n, t in to_hf_state_dict(trainer.model).items()}
        rollout = InProcessRollout(trainer, pad_id=0, bucket_bytes=64 << 10)
        out = grpo_step(trainer, rollout)
        rollout.close()
    out["weights"] = {n: t.detach().clone() for n, t in to_hf_state_dict(trainer.model).items()}
    out["init"] = init
    return out


@pytest.fixture(scope="module")
def sharded():
    return run_distributed(_sharded, 4, timeout_s=300)


def test_same_rollouts(reference, sharded):
    assert len(set(map(len, reference["response_ids"]))) > 1  # some stopped early: ragged responses
    assert any(len(set(g)) > 1 for g in reference["rewards"].view(-1, GROUP).tolist())  # advantages not all 0
    for rank, got in enumerate(sharded):
        assert got["version"] == 0 and got["response_ids"] == reference["response_ids"], rank
        for a, b in zip(got["log_probs"], reference["log_probs"]):
            assert torch.equal(a, b), rank
        assert torch.equal(got["rewards"], reference["rewards"])


def test_first_update_matches_single_process(reference, sharded):
    want = reference["result"]
    assert want["num_updates"] == 2 and not want["skipped"]
    assert any(not torch.equal(reference["weights"][n], reference["init"][n]) for n in reference["init"])
    for rank, got in enumerate(sharded):
        for key in ("old", "ref"):
            assert rel(got[key], reference[key]) <= FP64_REL, (rank, key)
        # Routing gathered from both stages and both dp replicas: the same picks (a pick flips only where
        # two router probabilities are within ~1e-16; a misplaced row, layer or shift agrees ~1/28)
        assert got["routing"].shape == reference["routing"].shape
        agree = (got["routing"] == reference["routing"]).all(-1)[reference["old"] != 0]
        assert agree.double().mean() >= 0.99, rank
        for key in ("loss", "grad_norm", "kl", "pg_loss", "clipfrac"):
            assert abs(got["result"][key] - want[key]) <= FP64_REL * abs(want[key]), (rank, key)
    seen = set()
    for rank, got in enumerate(sharded):
        for name, value in got["weights"].items():
            seen.add(name)
            assert rel(value, reference["weights"][name]) <= FP64_REL, (rank, name)
    assert seen == set(reference["weights"])  # the shards cover the model (experts of both ep ranks)


def test_rollout_process_serves_the_published_update(sharded):
    served = sharded[0]["served"]
    assert served["version"] == 1 and all(r["served_version"] == 1 for r in sharded)
    assert all(r["again_version"] == 1 for r in sharded)  # the next rollout waited for the load
    trainer_weights = {}
    for r in sharded:
        trainer_weights.update(r["weights"])  # replicas are bitwise equal (the same update everywhere)
    assert set(served["digests"]) == set(trainer_weights)
    for name, t in trainer_weights.items():
        digest = hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        assert served["digests"][name] == digest, name
    assert sharded[0]["exit_code"] == 0
