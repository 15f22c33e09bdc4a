"""verl's router replay fields drive the megatron_fp4 engine (verl's protocol, its own code paths):
``engine_config.router_replay = EngineRouterReplayConfig(mode="R2" | "R3")`` and the batch's
``enable_routing_replay``; R2's forward-only pass records ``routed_experts`` (nested, one route per
input position), the update replays them; R3 replays the rollout's ``routed_experts`` (one row short,
as vLLM returns them) through verl's `align_r3_router_replay_data` / `build_r3_replay_mask`."""
import asyncio
import copy
from functools import partial

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPActorConfig
from verl.workers.config.engine import EngineRouterReplayConfig
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding

from megatron_fp4.verl import MegatronFP4Rollout
from megatron_fp4.rollout import RolloutEngine
from megatron_fp4.rollout.engine import left_pad
from tests.integration.test_verl_paths import TOK, hf_dir, rollout_batch, verl_engine  # noqa: F401 - fixture

ACTOR = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=4,
                        use_dynamic_bsz=False, rollout_n=1)


def _routes_used(engine, run):
    """Run `run()`; the routes each MoE layer used: [B, L, num_moe_layers, k] of the one micro-batch."""
    calls = {i: [] for i, layer in enumerate(engine.model.layers) if layer.is_moe}
    hooks = [engine.model.layers[i].mlp.router.register_forward_hook(
        lambda _m, _a, out, i=i: calls[i].append(out[2].detach().clone())) for i in calls]
    try:
        result = run()
    finally:
        for h in hooks:
            h.remove()
    return result, torch.stack([calls[i][0] for i in sorted(calls)], dim=1)


def _batch(engine, b=None):
    b = rollout_batch(engine, ["12+7=", "3*4=", "5+5=", "9*9="]) if b is None else b
    b["old_log_probs"] = torch.zeros(b["responses"].shape)
    b["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand_as(b["old_log_probs"]).clone()
    td = left_right_2_no_padding(TensorDict(dict(b.items()), batch_size=b.batch_size))
    tu.assign_non_tensor(td, enable_routing_replay=True, global_batch_size=4)
    return td


def _flat(nested) -> torch.Tensor:
    return torch.cat(list(nested.unbind()))  # [total tokens, layers, k]


def _real(td, used) -> torch.Tensor:
    """The routes used (router calls: [tokens, k] per layer, stacked [tokens, M, k]) at the real tokens:
    a no-padding batch runs packed (its sequences back to back), a padded one [B*L]."""
    lengths = td["input_ids"].offsets().diff().tolist()
    if used.shape[0] == sum(lengths):
        return used
    B = len(lengths)
    used = used.view(B, -1, *used.shape[1:])  # [B*L, M, k] -> [B, L, M, k]
    return torch.cat([used[i, :n] for i, n in enumerate(lengths)])


def test_r2_records_in_compute_log_prob_and_replays_in_the_update(hf_dir):  # noqa: F811
    engine = verl_engine(hf_dir[0], micro_batch_size_per_gpu=4, router_replay=EngineRouterReplayConfig(mode="R2"))
    assert engine.cfg.rl.router_replay == "r2"
    td = _batch(engine)
    with engine.eval_mode():
        out, live = _routes_used(engine, lambda: engine.infer_batch(td)["model_output"])
    recorded = _flat(out["routed_experts"])
    last = td["input_ids"].offsets()[1:] - 1  # each sequence's final position: recorded as -1 (live)
    keep = torch.ones(recorded.shape[0], dtype=torch.bool)
    keep[last] = False
    assert bool((recorded[~keep] == -1).all()) and torch.equal(recorded[keep], _real(td, live)[keep])
    td["routed_experts"] = out["routed_experts"]
    with torch.no_grad():  # as after a first minibatch step: the routers moved
        for moe in engine.model.moe_layers():
            moe.router.weight.mul_(-1.0)
    with engine.train_mode():
        _, used = _routes_used(engine, lambda: engine.train_batch(td, partial(ppo_loss, ACTOR)))
    assert torch.equal(_real(td, used)[keep], recorded[keep])
    tu.assign_non_tensor(td, enable_routing_replay=False)  # replay off: the moved routers pick others
    with engine.train_mode():
        _, live_now = _routes_used(engine, lambda: engine.train_batch(td, partial(ppo_loss, ACTOR)))
    assert not torch.equal(_real(td, live_now)[keep], recorded[keep])


def test_r3_replays_the_rollouts_routed_experts(hf_dir):  # noqa: F811
    engine = verl_engine(hf_dir[0], micro_batch_size_per_gpu=4, router_replay=EngineRouterReplayConfig(mode="R3"))
    assert engine.cfg.rl.router_replay == "r3"
    td = _batch(engine)
    g = torch.Generator().manual_seed(0)
    E, k, M = engine.cfg.model.num_experts, engine.cfg.model.top_k, len(engine.model.moe_layers())
    lengths = td["input_ids"].offsets().diff().tolist()
    rollout = [torch.stack([torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)])
                            for _ in range(n - 1)]) for n in lengths]  # vLLM: none for the final token
    td["routed_experts"] = torch.nested.as_nested_tensor(rollout, layout=torch.jagged)
    with engine.eval_mode():
        replayed, used_eval = _routes_used(engine, lambda: engine.infer_batch(td)["model_output"]["log_probs"])
    with engine.train_mode():
        _, used = _routes_used(engine, lambda: engine.train_batch(td, partial(ppo_loss, ACTOR)))
    want = torch.cat(rollout)
    keep = torch.ones(sum(lengths), dtype=torch.bool)
    keep[td["input_ids"].offsets()[1:] - 1] = False  # the final row routes live (verl's mask)
    assert torch.equal(_real(td, used_eval)[keep], want) and torch.equal(_real(td, used)[keep], want)
    tu.assign_non_tensor(td, enable_routing_replay=False)
    with engine.eval_mode():
        live, used_live = _routes_used(engine, lambda: engine.infer_batch(td)["model_output"]["log_probs"])
    assert not torch.equal(_real(td, used_live)[keep], want)
    assert not torch.equal(torch.cat(list(live.unbind())), torch.cat(list(replayed.unbind())))


def test_r3_replays_the_projects_rollout_routes_through_verls_padding(hf_dir):  # noqa: F811
    """The megatron_fp4 rollout (a perturbed copy: other numerics, other experts) returns
    ``routed_experts`` in verl's layout; verl's `left_right_2_no_padding` carries them to the engine."""
    from verl import DataProto

    engine = verl_engine(hf_dir[0], micro_batch_size_per_gpu=4, router_replay=EngineRouterReplayConfig(mode="R3"))
    model = copy.deepcopy(engine.model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for moe in model.moe_layers():
            w = moe.router.weight
            w.add_(0.5 * w.std() * torch.randn(w.shape, generator=g))
    rollout = MegatronFP4Rollout(engine=RolloutEngine(model), stop_token_ids=(TOK.eos_id,))
    asyncio.run(rollout.resume(["weights"]))
    ids, mask = left_pad([TOK.encode(t, add_eos=False) for t in ["12+7=", "3*4=", "5+5=", "9*9="]], TOK.pad_id)
    proto = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask},
                                meta_info={"response_length": 5, "seeds": list(range(4)), "return_routing": True})
    td = _batch(engine, rollout.generate_sequences(proto).batch)
    want = _flat(td["routed_experts"])
    at = (want >= 0).all(-1).all(-1)
    assert int(at.sum()) == int(td["response_mask"].sum())  # one route per generated token
    with engine.train_mode():
        _, used = _routes_used(engine, lambda: engine.train_batch(td, partial(ppo_loss, ACTOR)))
    assert torch.equal(_real(td, used)[at], want[at])
    tu.assign_non_tensor(td, enable_routing_replay=False)
    with engine.eval_mode():
        _, live = _routes_used(engine, lambda: engine.infer_batch(td))
    assert not torch.equal(_real(td, live)[at], want[at])  # the rollout's experts differ from the trainer's


def test_replay_on_a_padded_batch_or_without_routes_fails_clearly(hf_dir):  # noqa: F811
    import pytest

    engine = verl_engine(hf_dir[0], micro_batch_size_per_gpu=4, router_replay=EngineRouterReplayConfig(mode="R3"))
    b = rollout_batch(engine, ["12+7=", "3*4=", "5+5=", "9*9="])
    padded = TensorDict(dict(b.items()), batch_size=b.batch_size)
    tu.assign_non_tensor(padded, enable_routing_replay=True)
    with engine.eval_mode(), pytest.raises(ValueError, match="no-padding"):
        engine.infer_batch(padded)
    td = left_right_2_no_padding(TensorDict(dict(b.items()), batch_size=b.batch_size))
    tu.assign_non_tensor(td, enable_routing_replay=True)
    with engine.eval_mode(), pytest.raises(ValueError, match="no routed_experts"):
        engine.infer_batch(td)
