"""Forward-only scoring and GRPO through `Trainer.forward_rows` on 2 gloo processes equal the single process.

- ``tp2`` (sequence parallel) and ``tp2_no_sp``: 2 GRPO steps (score old and reference log-probs with
  `PolicyScorer`, build the batch with `build_rl_batch`, one `policy_update`), each step on a fresh
  random generation; ``pp2`` (1F1B) and ``pp2_interleaved`` (2 chunks a rank): one such step.
- float64 (tests/numerics.py ``FP64_REL``: only the order of fp64 sums differs): old and reference
  log-probs, every step's loss and metrics, and (tp) every parameter after the steps, a cut weight
  against the same slice of the single process's; the routes the trainer picked are equal ids.
- every rank returns the same bits for the scores (each row written by one rank, summed over the mesh).
- ``pp2_exact`` (float32, ``numerics.invariance: exact``): the old and reference log-probs are the single
  process's bits (a row's bits depend on the row only, whatever the layout).
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import layout_results
from tests.distributed.test_tp_trainer import layout_cfg
from tests.numerics import FP64_REL, rel, single_thread

pytestmark = pytest.mark.distributed

LAYOUTS = {"tp2": (dict(tp=2), 2), "tp2_no_sp": (dict(tp=2, sequence_parallel=False), 2),
           "pp2": (dict(pp=2), 1), "pp2_interleaved": (dict(pp=2, virtual_stages=2, schedule="interleaved_1f1b", layers=4), 1),
           # fp32 at numerics.invariance=exact: the scores are the single process's bits (not at tp: the
           # cut linears' partial sums are rounded before the tp group adds them; exact FP4 on a slice is refused)
           "pp2_exact": (dict(pp=2, exact=True), 1)}
KEYS = ("loss", "grad_norm", "pg_loss", "kl", "clipfrac")
ROWS, GROUP = 8, 2


class _Generation:
    """The `GenerationOutput` fields `build_rl_batch` reads: ROWS prompts of 3-6 tokens, responses of
    2-6 tokens (12 positions padded: sequence parallel splits them over tp), random rollout log-probs
    (no routes: the trainer routes live)."""

    def __init__(self, cfg, seed: int):
        g = torch.Generator().manual_seed(seed)
        V = cfg.model.vocab_size
        self.prompt_ids = [torch.randint(1, V, (3 + b % 4,), generator=g).tolist() for b in range(ROWS)]
        self.response_ids = [torch.randint(1, V, (2 + (3 * b) % 5,), generator=g).tolist() for b in range(ROWS)]
        self.log_probs = [-torch.rand(len(r), generator=g, dtype=torch.float64) for r in self.response_ids]
        self.routing = None


def grpo(trainer, steps: int) -> dict:
    from megatron_fp4.rl import PolicyScorer, build_rl_batch, policy_update, switch_to_rl
    from megatron_fp4.rl.algo.policy_loss import PolicyLoss

    switch_to_rl(trainer, lr=1e-3, weight_decay=0.0, aux_coef=0.0)
    scorer = PolicyScorer(trainer, micro_batch_size=2, keep_reference=True)
    loss = PolicyLoss(clip_eps=0.2, tis_cap=2.0, kl_coef=0.1)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    scores, results = [], []
    for s in range(steps):
        batch = build_rl_batch(_Generation(trainer.cfg, s), rewards, GROUP, scorer, pad_id=0)
        scores.append({k: batch[k] for k in ("old_log_probs", "ref_log_probs", "train_routing")})
        results.append({k: policy_update(trainer, batch, loss, micro_batch_size=2)[k] for k in KEYS})
    return dict(scores=scores, results=results)


def _params(trainer) -> dict:
    """name -> (this rank's value, its tp slice of the whole weight or None)."""
    out = {}
    for n, q in trainer.model.named_parameters():
        shard = getattr(q, "tp_shard", None)
        out[n] = (q.detach().clone(), shard)
    return out


def cfg_for(spec: dict):
    spec = dict(spec)
    exact = spec.pop("exact", False)
    cfg = layout_cfg(spec)
    if exact:
        cfg.dtype, cfg.numerics.invariance = "fp32", "exact"
    return cfg


def _layouts(rank, world_size, layouts):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    out = {}
    for name, (spec, steps) in layouts.items():
        cfg = cfg_for(spec)
        p = cfg.parallel
        trainer = Trainer(cfg, ParallelMesh.build(p.pp, world_size // (p.pp * p.tp), p.ep, tp=p.tp), build_data=False)
        out[name] = grpo(trainer, steps)
        out[name]["params"] = _params(trainer) if p.pp == 1 else None
        trainer.optimizer.remove_hooks()
    return out


def _reference(spec: dict, steps: int) -> dict:
    from megatron_fp4.training.trainer import Trainer

    cfg = cfg_for(spec)
    p = cfg.parallel
    p.pp, p.tp, p.virtual_stages, p.schedule = 1, 1, 1, "1f1b"
    with single_thread():
        trainer = Trainer(cfg, build_data=False)
        out = grpo(trainer, steps)
    out["params"] = {n: q.detach().clone() for n, q in trainer.model.named_parameters()}
    return out


results = layout_results(_layouts, 2, LAYOUTS, timeout_s=600)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_scoring_and_grpo_match_single_process(results, name):
    spec, steps = LAYOUTS[name]
    want = _reference(spec, steps)
    for rank, res in enumerate(results):
        got = res[name]
        assert len(got["scores"]) == steps
        for g, w in zip(got["scores"], want["scores"]):
            for key in ("old_log_probs", "ref_log_probs"):
                if spec.get("exact"):
                    assert torch.equal(g[key], w[key]), (name, rank, key, rel(g[key], w[key]))
                assert rel(g[key], w[key]) <= FP64_REL, (name, rank, key, rel(g[key], w[key]))
            assert torch.equal(g["train_routing"], w["train_routing"]), (name, rank)
        for g, w in zip(got["scores"], results[0][name]["scores"]):  # the same bits on every rank
            assert all(torch.equal(g[k], w[k]) for k in g), (name, rank)
        assert len(got["results"]) == len(want["results"]) == steps
        if spec.get("exact"):
            continue  # the fp32 update: tests/distributed/test_tp_trainer*.py, test_parallel_training.py
        for g, w in zip(got["results"], want["results"]):
            for key in KEYS:
                assert abs(g[key] - w[key]) <= FP64_REL * abs(w[key]), (name, rank, key, g[key], w[key])
        if got["params"] is None:
            continue
        assert set(got["params"]) == set(want["params"])
        for pname, (value, shard) in got["params"].items():
            ref = want["params"][pname] if shard is None else want["params"][pname].index_select(*shard)
            assert rel(value, ref) <= FP64_REL, (name, rank, pname, rel(value, ref))
    assert want["results"][0]["pg_loss"] != 0.0  # the update moved the policy (advantages not all 0)
