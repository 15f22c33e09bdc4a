"""MoE routing options (issue 26): aux-loss-free balancing (DeepSeek-V3's per-expert router bias,
selection only, updated outside the gradient) and the sequence-wise balance loss."""
from __future__ import annotations

import copy

import pytest
import torch

from megatron_fp4.config import Config, ConfigError
from megatron_fp4.config.validate import validate_config
from megatron_fp4.fp4 import Recipe
from megatron_fp4.model.moe import MoELayer, Router, seq_balance_loss, update_expert_bias
from megatron_fp4.rollout import InProcessTransport, RolloutEngine, WeightPublisher, WeightReceiver
from megatron_fp4.training.trainer import Trainer

RATE = 1e-3


def test_bias_changes_selection_not_combine_weights():
    E, k = 8, 2
    router = Router(16, E, k, norm_topk_prob=True, expert_bias=True).double()
    g = torch.Generator().manual_seed(0)
    router.weight.data = torch.randn(E, 16, generator=g, dtype=torch.float64) * 0.3
    x = torch.randn(64, 16, generator=g, dtype=torch.float64)
    bias = torch.randn(E, generator=g, dtype=torch.float64) * 0.1
    router.expert_bias.copy_(bias)
    _, probs, idx, w = router(x)
    # float64 reference of the formula, row by row
    p = torch.softmax(x @ router.weight.t(), -1)
    for t in range(x.shape[0]):
        chosen = sorted(range(E), key=lambda e: -(p[t, e] + bias[e]).item())[:k]
        assert sorted(idx[t].tolist()) == sorted(chosen)
        ref = {e: (p[t, e] / sum(p[t, c] for c in chosen)).item() for e in chosen}
        for e, we in zip(idx[t].tolist(), w[t].tolist()):
            assert abs(we - ref[e]) <= 4e-16 * 4
    assert not torch.equal(idx.sort(-1).values, p.topk(k, -1).indices.sort(-1).values)  # the bias did select
    torch.testing.assert_close(probs, p, rtol=0, atol=1e-15)  # the aux-loss probabilities: unbiased


def test_bias_update_rule_hand_computed():
    layer = MoELayer(8, 4, 2, 8, None, bias_update_rate=0.1)
    layer.tokens_per_expert.copy_(torch.tensor([5.0, 1.0, 3.0, 3.0]))  # mean 3
    layer.router.expert_bias.copy_(torch.tensor([0.0, 0.5, -0.2, 0.0]))
    update_expert_bias(layer)
    assert layer.router.expert_bias.tolist() == pytest.approx([-0.1, 0.6, -0.2, 0.0], abs=1e-7)
    assert layer.tokens_per_expert.sum() == 0  # counts restart
    layer.tokens_per_expert.copy_(torch.tensor([9.0, 0.0, 0.0, 0.0]))
    update_expert_bias(layer, applied=False)  # a skipped step: the counts restart, the bias stays
    assert layer.router.expert_bias.tolist() == pytest.approx([-0.1, 0.6, -0.2, 0.0], abs=1e-7)
    assert layer.tokens_per_expert.sum() == 0


def test_load_counts_real_tokens_of_training_forwards():
    layer = MoELayer(8, 4, 2, 8, Recipe(mode="bf16"), bias_update_rate=0.1)
    g = torch.Generator().manual_seed(1)
    layer.router.weight.data.normal_(0, 0.5, generator=g)
    layer.experts.w13.data.normal_(0, 0.1, generator=g)
    layer.experts.w2.data.normal_(0, 0.1, generator=g)
    x = torch.randn(2, 5, 8, generator=g)
    valid = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    layer.train()
    layer(x, None, None, valid)
    idx = layer.router(x.reshape(-1, 8))[2][valid.reshape(-1)]
    assert layer.tokens_per_expert.tolist() == torch.bincount(idx.reshape(-1), minlength=4).double().tolist()
    layer.eval()
    layer(x)  # rollout / eval forwards do not count
    assert layer.tokens_per_expert.sum() == 14


def test_seq_aux_loss_independent_formula():
    """DeepSeek-V3 eq. 17-20 per sequence, averaged over sequences, as plain Python loops in float64."""
    B, T, E, k = 3, 6, 5, 2
    g = torch.Generator().manual_seed(2)
    probs = torch.randn(B * T, E, generator=g, dtype=torch.float64).softmax(-1)
    idx = probs.topk(k, -1).indices
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[0, :2] = False
    valid[2, 4:] = False
    losses = []
    for b in range(B):
        rows = [b * T + t for t in range(T) if valid[b, t]]
        f = [E / (k * len(rows)) * sum(int(e in idx[r].tolist()) for r in rows) for e in range(E)]
        P = [sum(probs[r, e].item() for r in rows) / len(rows) for e in range(E)]
        losses.append(sum(fi * pi for fi, pi in zip(f, P)))
    ref = sum(losses) / B
    assert abs(float(seq_balance_loss(probs, idx, valid, B)) - ref) <= 1e-14 * ref
    # no mask: every token real; a sequence without real tokens is left out of the mean
    all_ref = seq_balance_loss(probs, idx, torch.ones(B, T, dtype=torch.bool), B)
    assert float(seq_balance_loss(probs, idx, None, B)) == pytest.approx(float(all_ref), rel=1e-14)
    valid[1] = False
    assert float(seq_balance_loss(probs, idx, valid, B)) == pytest.approx((losses[0] + losses[2]) / 2, rel=1e-14)


def _cfg(tmp_path, rate=RATE, aux="global"):
    cfg = Config()
    cfg.model.num_layers, cfg.model.vocab_size = 2, 64
    cfg.model.moe_router_bias_update_rate, cfg.model.moe_aux_loss_type = rate, aux
    s = cfg.schedule
    s.global_batch_size, s.micro_batch_size, s.seq_len = 4, 2, 16
    cfg.data.num_samples = 40
    cfg.logging.tensorboard_dir, cfg.logging.progress, cfg.checkpoint.dir = None, False, str(tmp_path)
    return cfg


def test_bias_trains_saves_loads_and_reaches_rollout(tmp_path):
    trainer = Trainer(_cfg(tmp_path))
    for _ in range(2):
        trainer.train_step()
    biases = [m.router.expert_bias.clone() for m in trainer.model.moe_layers()]
    steps = torch.stack(biases) / RATE  # two updates of ±rate or 0 each
    assert torch.allclose(steps, steps.round(), atol=1e-3) and steps.abs().max() > 0 and steps.abs().max() <= 2
    # checkpoint round trip
    path = trainer.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = Trainer(_cfg(tmp_path))
    resumed.load_checkpoint(path if isinstance(path, str) else str(tmp_path / "ckpt"))
    for m, b in zip(resumed.model.moe_layers(), biases):
        assert torch.equal(m.router.expert_bias, b)
    # weight sync to a rollout engine built from the same config: the same experts picked
    rollout = copy.deepcopy(trainer.model)
    for m in rollout.moe_layers():
        m.router.expert_bias.zero_()
    engine = RolloutEngine(rollout, mode="bf16")
    WeightPublisher(trainer.model, [InProcessTransport(WeightReceiver(engine))]).publish(1).wait_loaded(30)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
    trainer.model.eval()
    ours = trainer.model(tokens, return_routing=True).routing
    theirs = engine.model(tokens, return_routing=True).routing
    for a, b in zip(ours, theirs):
        assert torch.equal(a.sort(-1).values, b.sort(-1).values)
    unbiased = copy.deepcopy(trainer.model)
    for m in unbiased.moe_layers():
        m.router.expert_bias.zero_()
    assert any(not torch.equal(a.sort(-1).values, b.sort(-1).values)
               for a, b in zip(ours, unbiased(tokens, return_routing=True).routing))  # the bias matters here


def test_config_fields_validated(tmp_path):
    for field, value in (("moe_router_bias_update_rate", -1.0), ("moe_aux_loss_type", "tokens")):
        cfg = _cfg(tmp_path)
        setattr(cfg.model, field, value)
        with pytest.raises(ConfigError, match=f"model.{field}"):
            validate_config(cfg)


def test_bias_hf_name_round_trip(tmp_path):
    """The bias travels under DeepSeek-V3's HF name (what HF-named weight sync and exports carry);
    a checkpoint without it (a Hub Qwen3) loads with the bias left at zero."""
    from megatron_fp4.integrations.hf import from_hf_state_dict, to_hf_state_dict
    from megatron_fp4.model.transformer import build_model

    cfg = _cfg(tmp_path)
    src, dst = build_model(cfg, seed=1), build_model(cfg, seed=2)
    for i, m in enumerate(src.moe_layers()):
        m.router.expert_bias.copy_(torch.arange(8.0) * (i + 1) * RATE)
    sd = to_hf_state_dict(src)
    assert torch.equal(sd["model.layers.1.mlp.gate.e_score_correction_bias"], src.moe_layers()[1].router.expert_bias)
    from_hf_state_dict(dst, sd)
    assert all(torch.equal(a.router.expert_bias, b.router.expert_bias) for a, b in zip(src.moe_layers(), dst.moe_layers()))
    fresh = build_model(cfg, seed=3)
    from_hf_state_dict(fresh, {k: v for k, v in sd.items() if "e_score_correction_bias" not in k})
    assert all(m.router.expert_bias.abs().sum() == 0 for m in fresh.moe_layers())
    assert torch.equal(fresh.moe_layers()[0].router.weight, src.moe_layers()[0].router.weight)


def _dp2_bias(rank, world_size, root, rate):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from tests.distributed.test_parallel_training import tiny_cfg

    cfg = tiny_cfg(zero_stage=1)
    cfg.model.moe_router_bias_update_rate = rate
    t = Trainer(cfg, ParallelMesh.build(1, world_size, 1))
    t.train_step(), t.train_step()
    bias = [m.router.expert_bias.clone() for m in t.model.moe_layers()]
    t.save_checkpoint(root)
    t.optimizer.remove_hooks()
    r = Trainer(cfg, ParallelMesh.build(1, world_size, 1))
    r.load_checkpoint(root)
    resumed = [m.router.expert_bias.clone() for m in r.model.moe_layers()]
    r.optimizer.remove_hooks()
    return bias, resumed


def test_dp2_bias_uses_global_load_and_survives_sharded_checkpoint(tmp_path):
    """dp2: the load is summed over the data-parallel ranks, so both replicas keep the single
    process's bias (same tokens in all); the DCP checkpoint carries it."""
    from tests.distributed.launch import run_distributed
    from tests.distributed.test_parallel_training import tiny_cfg

    rate = 1e-2
    cfg = tiny_cfg()
    cfg.model.moe_router_bias_update_rate = rate
    single = Trainer(cfg)
    single.train_step(), single.train_step()
    want = [m.router.expert_bias for m in single.model.moe_layers()]
    assert any(w.abs().sum() > 0 for w in want)
    for bias, resumed in run_distributed(_dp2_bias, 2, (str(tmp_path / "dcp"), rate)):
        for b, r, w in zip(bias, resumed, want):
            assert torch.equal(b, w) and torch.equal(r, w)


def test_seq_aux_type_is_the_layers_balance_loss():
    """moe_aux_loss_type='seq': the layer's logged (and back-propagated) balance loss is the per
    sequence one of its [B, T] batch, padding left out."""
    layer = MoELayer(8, 4, 2, 8, Recipe(mode="bf16"), aux_loss_coef=0.01, aux_loss_type="seq").double().train()
    g = torch.Generator().manual_seed(4)
    layer.router.weight.data.normal_(0, 0.5, generator=g)
    layer.experts.w13.data.normal_(0, 0.1, generator=g)
    layer.experts.w2.data.normal_(0, 0.1, generator=g)
    layer.record_stats = True
    x = torch.randn(2, 5, 8, generator=g, dtype=torch.float64)
    valid = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    layer(x, None, None, valid)
    _, probs, idx, _ = layer.router(x.reshape(-1, 8))
    want = seq_balance_loss(probs, idx, valid, 2).detach()
    glob = layer.aux_losses(probs.log(), probs, idx, valid)[0].detach()
    assert float(layer.stats[-1]["aux_loss"]) == float(want.detach()) and float(want) != pytest.approx(float(glob))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_counts_the_load_once(tmp_path, mode):
    """Activation recomputation re-runs the MoE forward in backward: the load is counted once."""
    from megatron_fp4.model.transformer import build_model, lm_loss

    loads = {}
    for m in ("none", mode):
        cfg = _cfg(tmp_path)
        cfg.fp4.scope = "none"
        cfg.model.recompute, cfg.model.recompute_modules = m, ["moe"]
        model = build_model(cfg, seed=1).train()
        tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(6))
        lm_loss(model(tokens).logits[:, :-1], tokens[:, 1:]).backward()
        loads[m] = [layer.tokens_per_expert.clone() for layer in model.moe_layers()]
    for a, b in zip(loads["none"], loads[mode]):
        assert a.sum() == 2 * 12 * 2 and torch.equal(a, b)
