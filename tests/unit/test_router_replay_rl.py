"""Router replay from the rollout to the trainer (R3) and within the trainer (R2).

The rollout engine runs a perturbed copy of the policy (its router weights moved by noise: numerics
that differ from the trainer's, as a real engine's do), so its experts differ from the trainer's.
With ``router_replay="r3"`` the trainer's old-log-prob pass and every update pass use the rollout's
experts at every replayed position (expert agreement exactly 1), without replay they differ. With
``"r2"`` the update passes use the experts of the trainer's own old-log-prob pass.
"""
import copy
import random

import pytest
import torch

from megatron_fp4.rl import PolicyScorer, build_rl_batch, consistency, policy_update
from megatron_fp4.rl.algo.policy_loss import PolicyLoss
from megatron_fp4.rollout import RolloutEngine, SamplingParams
from megatron_fp4.training.data import ArithmeticTokenizer, make_problem
from tests.unit.test_rl_policy_loss import tiny_trainer

TOK = ArithmeticTokenizer()


def _rollout(trainer, noise: float = 0.5):
    model = copy.deepcopy(trainer.model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for moe in model.moe_layers():
            w = moe.router.weight
            w.add_(noise * w.std() * torch.randn(w.shape, generator=g))
    engine = RolloutEngine(model, pad_id=TOK.pad_id)
    rng = random.Random(0)
    prompts = [TOK.encode(make_problem(rng, 9, "+")[0], add_eos=False) for _ in range(4)]
    return engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3), return_routing=True)


class _Recorder:
    """The experts each router uses, per forward call (the router's returned ids)."""

    def __init__(self, model):
        self.calls = {i: [] for i, layer in enumerate(model.layers) if layer.is_moe}
        self.hooks = [model.layers[i].mlp.router.register_forward_hook(self._hook(i)) for i in self.calls]

    def _hook(self, i):
        return lambda _m, _a, out: self.calls[i].append(out[2].detach().clone())

    def remove(self):
        for h in self.hooks:
            h.remove()


def _update_routes(trainer, batch):
    rec = _Recorder(trainer.model)
    try:
        policy_update(trainer, batch, PolicyLoss(clip_eps=0.2, tis_cap=2.0), micro_batch_size=4)
    finally:
        rec.remove()
    slots = trainer.model.moe_slots()
    # one micro-batch of the whole batch: call 0 of each layer, [B*T, k] -> [B, T, k]
    return torch.stack([rec.calls[i][0].view(*batch["input_ids"].shape, -1) for i in sorted(slots)], dim=2)


@pytest.fixture(scope="module")
def setup():
    trainer = tiny_trainer()
    return trainer, _rollout(trainer)


def _batch(trainer, gen, mode):
    scorer = PolicyScorer(trainer, micro_batch_size=4, keep_reference=True)
    return build_rl_batch(gen, torch.tensor([1.0, 0.0, 1.0, 0.0]), 2, scorer, TOK.pad_id, router_replay=mode)


def test_r3_trainer_uses_the_rollout_experts(setup):
    trainer, gen = setup
    off = _batch(trainer, gen, "off")
    assert "replay_routing" not in off
    assert consistency(gen, off)["expert_agreement"] < 0.9  # the perturbed engine routes differently
    r3 = _batch(trainer, gen, "r3")
    assert consistency(gen, r3)["expert_agreement"] == 1.0
    assert not torch.equal(off["old_log_probs"], r3["old_log_probs"])
    assert not torch.equal(off["ref_log_probs"], r3["ref_log_probs"])  # the reference replays too
    replay = r3["replay_routing"]
    P, n = r3["prompt_len"], sum(len(r) for r in gen.response_ids)
    assert int((replay[..., 0] >= 0).sum()) == n * replay.shape[2]
    assert torch.equal(replay[0, P - 1:P - 1 + len(gen.response_ids[0])], gen.routing[0])
    used = _update_routes(trainer, r3)
    at = replay >= 0
    assert torch.equal(used[at], replay[at])


def test_r2_update_uses_the_old_log_prob_pass_experts(setup):
    trainer, gen = setup
    r2 = _batch(trainer, gen, "r2")
    replay = r2["replay_routing"]
    # position t's route is the scorer's routing row t+1 (behind log_probs[t+1]); the last is live
    assert torch.equal(replay[:, :-1], r2["train_routing"][:, 1:]) and bool((replay[:, -1] == -1).all())
    # as after a first PPO minibatch step: the weights moved since the old-log-prob pass
    with torch.no_grad():
        for moe in trainer.model.moe_layers():
            moe.router.weight.mul_(-1.0)
    used = _update_routes(trainer, r2)
    assert torch.equal(used[:, :-1], replay[:, :-1])
    live = _update_routes(trainer, {k: v for k, v in r2.items() if k != "replay_routing"})
    assert not torch.equal(live[:, :-1], replay[:, :-1])


def test_r3_without_rollout_routes_fails_clearly(setup):
    trainer, gen = setup
    bare = copy.copy(gen)
    bare.routing = None
    with pytest.raises(ValueError, match="return_routing=True"):
        _batch(trainer, bare, "r3")
    with pytest.raises(ValueError, match="must be one of"):
        _batch(trainer, gen, "R3")
