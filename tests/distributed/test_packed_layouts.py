"""Packed RL micro-batches (``rl.max_tokens_per_micro_batch``) on pp2 (1F1B: every micro-batch padded
at the end to one shape, at least pp of them) and ep2 (dp2 = ep2: each rank packs its own share,
the shares' micro-batch counts equalised) on 2 gloo processes equal the single process packing the
same batch: old and reference log-probs scored in packed micro-batches, then two packed policy
updates. float64 (tests/numerics.py ``FP64_REL``: only the order of fp64 sums differs: other
micro-batches, the dp mean of token-weighted losses): log-probs, losses, metrics and the parameters
(an expert block against the same experts of the single process); the routes are equal ids.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import layout_results
from tests.distributed.test_parallel_training import tiny_cfg
from tests.numerics import FP64_REL, rel, single_thread

pytestmark = pytest.mark.distributed

BUDGET = 20
STEPS = 2
LAYOUTS = {"pp2": dict(pp=2), "ep2": dict(ep=2, zero_stage=1)}
KEYS = ("loss", "grad_norm", "pg_loss", "kl", "clipfrac")


class _Generation:
    """8 prompts of 3-8 tokens, responses of 1-9 tokens, random rollout log-probs (routes live)."""

    def __init__(self, cfg):
        g = torch.Generator().manual_seed(7)
        V = cfg.model.vocab_size
        self.prompt_ids = [torch.randint(1, V, (3 + (5 * b) % 6,), generator=g).tolist() for b in range(8)]
        self.response_ids = [torch.randint(1, V, (1 + (7 * b) % 9,), generator=g).tolist() for b in range(8)]
        self.log_probs = [-torch.rand(len(r), generator=g, dtype=torch.float64) for r in self.response_ids]
        self.routing = None


def _run(trainer) -> dict:
    from megatron_fp4.rl import PolicyScorer, build_rl_batch, policy_update, switch_to_rl
    from megatron_fp4.rl.algo.policy_loss import PolicyLoss

    switch_to_rl(trainer, lr=1e-3, weight_decay=0.0, aux_coef=0.0)
    scorer = PolicyScorer(trainer, micro_batch_size=2, keep_reference=True, max_tokens=BUDGET)
    batch = build_rl_batch(_Generation(trainer.cfg), torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]), 2,
                           scorer, 0)
    loss = PolicyLoss(clip_eps=0.2, tis_cap=2.0, kl_coef=0.1)
    results = [policy_update(trainer, batch, loss, micro_batch_size=2, max_tokens=BUDGET) for _ in range(STEPS)]
    offsets = {}
    for moe in trainer.model.moe_layers():
        for pname in ("w13", "w2"):
            p = getattr(moe.experts, pname)
            offsets[[n for n, q in trainer.model.named_parameters() if q is p][0]] = moe.experts.expert_offset
    return dict(scores={k: batch[k] for k in ("old_log_probs", "ref_log_probs", "train_routing")},
                results=[{k: r[k] for k in KEYS} for r in results], offsets=offsets,
                params={n: p.detach().clone() for n, p in trainer.model.named_parameters()})


def _layouts(rank, world_size, layouts):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    out = {}
    for name, spec in layouts.items():
        cfg = tiny_cfg(**spec)
        p = cfg.parallel
        trainer = Trainer(cfg, ParallelMesh.build(p.pp, world_size // p.pp, p.ep), build_data=False)
        out[name] = _run(trainer)
        trainer.optimizer.remove_hooks()
    return out


results = layout_results(_layouts, 2, LAYOUTS, timeout_s=600)


@pytest.fixture(scope="module")
def reference():
    from megatron_fp4.training.trainer import Trainer

    with single_thread():
        return _run(Trainer(tiny_cfg(), build_data=False))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_rl_layouts_match_single_process(results, reference, name):
    want = reference
    assert want["results"][0]["pg_loss"] != 0.0
    for rank, res in enumerate(results):
        got = res[name]
        for key in ("old_log_probs", "ref_log_probs"):
            assert rel(got["scores"][key], want["scores"][key]) <= FP64_REL, (name, rank, key)
            assert torch.equal(got["scores"][key], results[0][name]["scores"][key])  # every rank the same bits
        assert torch.equal(got["scores"]["train_routing"], want["scores"]["train_routing"]), (name, rank)
        for g, w in zip(got["results"], want["results"]):
            for key in KEYS:
                # clipfrac: a float32 mean of 0/1 flags per micro-batch (`is_correction.policy_loss`),
                # each rounded to 2^-24 relative before the fp64 token weights combine them
                tol = 4 * 2.0 ** -24 if key == "clipfrac" else FP64_REL * abs(w[key])
                assert abs(g[key] - w[key]) <= tol, (name, rank, key, g[key], w[key])
        for pname, value in got["params"].items():
            ref = want["params"][pname]
            if pname in got["offsets"]:
                ref = ref[got["offsets"][pname]:got["offsets"][pname] + value.shape[0]]
            assert rel(value, ref) <= FP64_REL, (name, rank, pname, rel(value, ref))
