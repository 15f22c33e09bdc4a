"""Router replay (R2, R3) trains pp2 × ep2 (4 gloo processes: pp2, dp2 = edp1 × ep2; both expert
dispatchers; 1F1B and the interleaved zero-bubble schedule) like the single process: the same RL
batch built by `build_rl_batch(router_replay=)` (scored through the pipeline schedule, routes
captured on each stage and summed over the mesh), then PPO updates through the pipeline with the
replayed routes as the micro-batches' ``routing_in``.

The rollout's routes are random (distinct ids per token): R3 must replay whatever the rollout chose,
not what the trainer would pick. float64: old and reference log-probs, losses, metrics and the
parameters after every step within ``FP64_REL`` of the single process (tests/numerics.py: only the
order of fp64 sums differs between layouts); the routes used are equal ids.
"""
import pytest
import torch

from tests.distributed.conftest import layout_results
from tests.distributed.test_parallel_training import layout_cfg
from tests.distributed.test_parallel_training_ep import SPEC
from tests.numerics import FP64_REL, rel, single_thread

STEPS = 2
GCMOE = dict(expert_dispatcher="gcmoe", gcmoe_chunk_tokens=8, gcmoe_ring_slots=2)
ZB = dict(virtual_stages=2, schedule="interleaved_zero_bubble")  # split input/weight backward
LAYOUTS = {"r2_alltoall": ("r2", SPEC), "r3_alltoall": ("r3", SPEC), "r3_gcmoe": ("r3", dict(SPEC, **GCMOE)),
           "r2_zero_bubble": ("r2", dict(SPEC, **ZB))}
KEYS = ("loss", "grad_norm", "pg_loss", "kl", "clipfrac")


class _Generation:
    """A `GenerationOutput`'s fields `build_rl_batch` reads: 8 prompts of 4-7 tokens, responses of
    2-5 tokens, random log-probs and random routes [L, num_moe_layers, k] (distinct ids per token)."""

    def __init__(self, cfg):
        g = torch.Generator().manual_seed(0)
        V, E, k, M = cfg.model.vocab_size, cfg.model.num_experts, cfg.model.top_k, cfg.model.num_layers
        self.prompt_ids = [torch.randint(1, V, (4 + b % 4,), generator=g).tolist() for b in range(8)]
        self.response_ids = [torch.randint(1, V, (2 + (3 * b) % 4,), generator=g).tolist() for b in range(8)]
        self.log_probs = [-torch.rand(len(r), generator=g, dtype=torch.float64) for r in self.response_ids]
        self.routing = [torch.stack([torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
                                     for _ in r]) for r in self.response_ids]


def _rl_run(trainer, mode: str) -> dict:
    from megatron_fp4.rl import PolicyScorer, build_rl_batch, policy_update
    from megatron_fp4.rl.algo.grpo import switch_to_rl
    from megatron_fp4.rl.algo.policy_loss import PolicyLoss

    switch_to_rl(trainer, lr=1e-3, weight_decay=0.0, aux_coef=1.0)
    gen = _Generation(trainer.cfg)
    scorer = PolicyScorer(trainer, micro_batch_size=2, keep_reference=True)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    batch = build_rl_batch(gen, rewards, 2, scorer, 0, router_replay=mode)
    loss = PolicyLoss(clip_eps=0.2, tis_cap=2.0, kl_coef=0.1)
    results = [policy_update(trainer, batch, loss, micro_batch_size=2) for _ in range(STEPS)]
    offsets = {}  # expert params: offset of this rank's block in the full [E, ...] tensor
    for moe in trainer.model.moe_layers():
        for pname in ("w13", "w2"):
            p = getattr(moe.experts, pname)
            name = [n for n, q in trainer.model.named_parameters() if q is p][0]
            offsets[name] = getattr(moe.experts, "expert_offset", 0)
    return dict(batch={k: batch[k] for k in ("old_log_probs", "ref_log_probs", "train_routing", "replay_routing")},
                results=[{k: r[k] for k in KEYS} for r in results], offsets=offsets,
                params={n: p.detach().clone() for n, p in trainer.model.named_parameters()},
                dispatchers={type(m.dispatcher).__name__ for m in trainer.model.moe_layers()})


def _layouts(rank, world_size, layouts):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    out = {}
    for name, (mode, spec) in layouts.items():
        cfg = layout_cfg(spec)
        trainer = Trainer(cfg, ParallelMesh.build(cfg.parallel.pp, world_size // cfg.parallel.pp,
                                                          cfg.parallel.ep), build_data=False)
        out[name] = _rl_run(trainer, mode)
        trainer.optimizer.remove_hooks()
    return out


@pytest.fixture(scope="module")
def reference():
    from megatron_fp4.training.trainer import Trainer

    out = {}
    for mode in ("r2", "r3"):
        with single_thread():
            out[mode] = _rl_run(Trainer(layout_cfg({}), build_data=False), mode)
    return out


results = layout_results(_layouts, 4, LAYOUTS, timeout_s=600)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_router_replay_pp2_ep2_matches_single_process(reference, results, name):
    mode = LAYOUTS[name][0]
    want = reference[mode]
    replay = want["batch"]["replay_routing"]
    if mode == "r3":  # the rollout's random routes, not the ones the trainer picks (R2 records those)
        at = replay[:, :-1] >= 0
        own = reference["r2"]["batch"]["train_routing"][:, 1:]
        assert at.any() and not torch.equal(own[at], replay[:, :-1][at])
        assert torch.equal(want["batch"]["train_routing"][:, 1:][at], replay[:, :-1][at])
    seen = set()
    for rank, res in enumerate(results):
        got = res[name]
        assert got["dispatchers"] == {"GCMoEDispatcher" if "gcmoe" in name else "AllToAllDispatcher"}
        for key in ("train_routing", "replay_routing"):
            assert torch.equal(got["batch"][key], want["batch"][key]), (name, rank, key)
        for key in ("old_log_probs", "ref_log_probs"):
            assert rel(got["batch"][key], want["batch"][key]) <= FP64_REL, (name, rank, key)
        for g_step, w_step in zip(got["results"], want["results"]):
            for key in KEYS:
                assert abs(g_step[key] - w_step[key]) <= FP64_REL * abs(w_step[key]), (name, rank, key)
        for pname, value in got["params"].items():
            ref = want["params"][pname]
            if pname in got["offsets"]:
                ref = ref[got["offsets"][pname]:got["offsets"][pname] + value.shape[0]]
            assert rel(value, ref) <= FP64_REL, (name, rank, pname)
            seen.add(pname)
    assert seen == set(want["params"]), set(want["params"]) - seen
