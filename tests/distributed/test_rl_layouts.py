"""The GRPO/PPO policy loss (clipped surrogate, truncated IS, k3 KL to a reference) trains every
layout like the single process: the same RL batch, handed to `Trainer.train_step_with_loss` with a
`PolicyLoss`, through the pipeline schedule (loss on the last stage, the micro-batch dict as its
target) at pp2 (1F1B and interleaved zero-bubble) and through ZeRO at dp2 (each dp rank its half of
the micro-batches).

float64 (``dtype: fp64``): losses, metrics, the first step's gradients and the parameters after
every step within ``FP64_REL`` of the single process (the bound is derived in tests/numerics.py:
only the order of fp64 sums differs between layouts). The batch is left-padded with prompts of
different lengths, so positions and the padding mask must reach every stage, and its sequence
length differs from ``schedule.seq_len``, so the pipeline rebuilds its static buffers for it.
"""
import pytest
import torch

from tests.distributed.launch import run_distributed
from tests.distributed.test_parallel_training import tiny_cfg
from tests.numerics import FP64_REL, rel

STEPS = 2
LAYOUTS = {
    "pp2_1f1b": dict(pp=2, schedule="1f1b"),
    "pp2_zero_bubble": dict(pp=2, virtual_stages=2, schedule="interleaved_zero_bubble"),
    "dp2_zero1": dict(zero_stage=1),
}
LOSS = dict(clip_eps=0.2, tis_cap=2.0, kl_coef=0.1)


def rl_cfg(**parallel):
    cfg = tiny_cfg(**parallel)
    cfg.optimizer.lr = 1e-3
    return cfg


def rl_batch(model) -> dict:
    """8 left-padded prompt+response rows of length 12, old log-probs near the current policy's
    (ratios inside and outside the clip range), rollout log-probs off by noise (some TIS weights
    capped), a frozen 'reference' shifted from old."""
    from megatron_fp4.rollout import compute_log_probs

    g = torch.Generator().manual_seed(0)
    B, T, P = 8, 12, 7
    V = model.cfg.vocab_size
    tokens = torch.randint(1, V, (B, T), generator=g)
    attention_mask = torch.ones(B, T, dtype=torch.long)
    for b in range(B):
        attention_mask[b, :b % 4] = 0  # prompts of 7, 6, 5, 4 real tokens
        tokens[b, :b % 4] = 0
    response_mask = torch.zeros(B, T, dtype=torch.long)
    response_mask[:, P:] = 1
    response_mask[1, T - 2:] = 0  # a shorter response
    with torch.no_grad():
        cur = compute_log_probs(model, tokens, attention_mask, response_mask).log_probs.double()
    old = (cur + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)) * response_mask
    rollout = (old + 0.8 * torch.randn(B, T, generator=g, dtype=torch.float64)) * response_mask
    ref = (old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)) * response_mask
    return {"input_ids": tokens, "attention_mask": attention_mask, "response_mask": response_mask,
            "old_log_probs": old, "rollout_log_probs": rollout, "ref_log_probs": ref,
            "advantages": torch.randn(B, generator=g, dtype=torch.float64)}


def micro_batches(batch: dict, size: int = 2) -> list[dict]:
    B = batch["input_ids"].shape[0]
    return [{k: v[s:s + size] for k, v in batch.items()} for s in range(0, B, size)]


def run_steps(trainer, mbs: list[dict]) -> dict:
    """First step's gradients (forward_backward only), then STEPS optimizer steps from the start."""
    from megatron_fp4.rl.algo.policy_loss import PolicyLoss

    loss = PolicyLoss(**LOSS)
    trainer.model.train()
    trainer.optimizer.zero_grad()
    trainer.forward_backward(mbs, loss)
    trainer.optimizer.finish_grad_sync()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.optimizer.zero_grad()
    results = [trainer.train_step_with_loss(mbs, loss) for _ in range(STEPS)]
    return dict(results=[{k: v for k, v in r.items() if k != "tokens_per_s"} for r in results], grads=grads,
                params={n: p.detach().clone() for n, p in trainer.model.named_parameters()})


def _layouts(rank, world_size, batch):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    out = {}
    for name, spec in LAYOUTS.items():
        cfg = rl_cfg(**spec)
        mesh = ParallelMesh.build(cfg.parallel.pp, world_size // cfg.parallel.pp, 1)
        trainer = Trainer(cfg, mesh, build_data=False)
        mbs = micro_batches(batch)
        if mesh.dp > 1:  # each dp rank its contiguous share of the micro-batches
            share = len(mbs) // mesh.dp
            mbs = mbs[mesh.coord("dp") * share:(mesh.coord("dp") + 1) * share]
        out[name] = run_steps(trainer, mbs)
        trainer.optimizer.remove_hooks()
    return out


@pytest.fixture(scope="module")
def reference():
    from megatron_fp4.training.trainer import Trainer

    trainer = Trainer(rl_cfg(), build_data=False)
    batch = rl_batch(trainer.model)
    return batch, run_steps(trainer, micro_batches(batch))


@pytest.fixture(scope="module")
def results(reference):
    return run_distributed(_layouts, 2, (reference[0],), timeout_s=600)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_policy_loss_layout_matches_single_process(reference, results, name):
    _, want = reference
    assert any(abs(g).sum() > 0 for g in want["grads"].values())
    assert 0 < want["results"][0]["clipfrac"] < 1 and 0 < want["results"][0]["tis_weight_mean"] < 2
    seen = set()
    for rank, res in enumerate(results):
        got = res[name]
        for g_step, w_step in zip(got["results"], want["results"]):
            assert set(g_step) == set(w_step), (name, rank, set(g_step) ^ set(w_step))
            assert not g_step["skipped"]
            for key in ("loss", "grad_norm", "pg_loss", "kl", "clipfrac", "tis_weight_mean"):
                assert abs(g_step[key] - w_step[key]) <= FP64_REL * abs(w_step[key]), (name, rank, key)
        for pname, grad in got["grads"].items():
            assert rel(grad, want["grads"][pname]) <= FP64_REL, (name, rank, pname)
        for pname, value in got["params"].items():
            seen.add(pname)
            assert rel(value, want["params"][pname]) <= FP64_REL, (name, rank, pname)
    assert seen == set(want["params"]), (name, set(want["params"]) - seen)
