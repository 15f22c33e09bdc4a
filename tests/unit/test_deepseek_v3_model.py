"""DeepSeek-V3 model pieces on their own (HF parity lives in tests/integration/test_deepseek_v3_parity.py):
the group-limited router against a brute-force reference, aux-loss-free balancing moving the router
bias (HF's ``e_score_correction_bias``) by the existing update, recompute = none bit for bit, one
trainer step deterministic, and what the family refuses (config and run time)."""
import pytest
import torch

from megatron_fp4.config import Config, ConfigError
from megatron_fp4.model import build_model, lm_loss
from megatron_fp4.model.deepseek_v3 import group_limited_topk
from megatron_fp4.model.moe import update_expert_bias


def cfg(**model):
    c = Config()
    m = c.model
    m.family, m.num_layers, m.vocab_size, m.num_kv_heads = "deepseek_v3", 3, 32, 4
    m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 16, 16, 8, 4, 12
    m.num_experts, m.top_k, m.moe_n_group, m.moe_topk_group = 8, 3, 4, 2
    m.num_shared_experts, m.shared_expert_ffn_hidden_size, m.dense_layers = 1, m.moe_ffn_hidden_size, [0]
    m.moe_routed_scaling_factor = 2.5
    c.numerics.invariance, c.fp4.compile = "standard", "off"
    for k, v in model.items():
        setattr(m, k, v)
    return c.validate()


def brute_force_topk(choice, top_k, n_group, topk_group):
    """Per token: the groups ranked by the sum of their two best scores, the best topk_group kept,
    then the top_k experts among them (python loops, sets)."""
    E = len(choice)
    size = E // n_group
    group_score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
    groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
    allowed = [e for g in groups for e in range(g * size, (g + 1) * size)]
    return set(sorted(allowed, key=lambda e: -choice[e])[:top_k])


@pytest.mark.parametrize("n_group,topk_group,top_k", [(4, 2, 3), (2, 1, 2), (8, 3, 3), (1, 1, 4)])
def test_group_limited_topk_against_brute_force(n_group, topk_group, top_k):
    choice = torch.rand(64, 16, generator=torch.Generator().manual_seed(n_group), dtype=torch.float64)
    got = group_limited_topk(choice, top_k, n_group, topk_group)
    for t in range(choice.shape[0]):
        assert set(got[t].tolist()) == brute_force_topk(choice[t].tolist(), top_k, n_group, topk_group), t


def test_router_weights_and_bias_for_selection_only():
    """Combine weights = the unbiased sigmoid scores at the chosen experts, renormalised, × the
    routed scaling factor; the bias changes which experts, not their weights' formula."""
    model = build_model(cfg(), seed=1)
    router = model.moe_layers()[0].router
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        router.expert_bias.copy_(torch.linspace(-1, 1, 8))
        logits, probs, idx, w = router(x)
    scores = torch.sigmoid(x @ router.weight.T)
    want = scores.gather(1, idx)
    torch.testing.assert_close(w, 2.5 * want / want.sum(-1, keepdim=True), rtol=1e-6, atol=0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(10), rtol=1e-6, atol=0)
    for t in range(10):
        assert set(idx[t].tolist()) == brute_force_topk((scores[t] + router.expert_bias).tolist(), 3, 4, 2)


def test_aux_loss_free_bias_moves_the_e_score_correction_bias():
    """With moe_router_bias_update_rate > 0 the existing update (DeepSeek-V3's rule) moves the
    router's bias by rate·sign(mean load − load), the load counted from this step's routes."""
    from megatron_fp4.integrations.hf import to_hf_state_dict

    model = build_model(cfg(moe_router_bias_update_rate=0.01), seed=1).train()
    tokens = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(1))
    routes = model(tokens, return_routing=True).routing
    wants = []
    for i, moe in enumerate(model.moe_layers()):
        counts = torch.bincount(routes[i + 1].reshape(-1), minlength=8).to(torch.float64)  # routes[0]: dense
        assert torch.equal(moe.tokens_per_expert, counts)
        wants.append(0.01 * torch.sign(counts.mean() - counts))
    update_expert_bias(model)
    for moe, want in zip(model.moe_layers(), wants):
        assert torch.equal(moe.router.expert_bias, want.float()) and want.abs().sum() > 0
    sd = to_hf_state_dict(model)
    assert torch.equal(sd["model.layers.1.mlp.gate.e_score_correction_bias"], model.layers[1].mlp.router.expert_bias)


def grads(c):
    model = build_model(c, seed=3).train()
    tokens = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(1))
    lm_loss(model(tokens[:, :-1]).logits, tokens[:, 1:]).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", [dict(recompute="full"),
                                  dict(recompute="selective", recompute_modules=["attention", "experts", "mlp", "moe"])])
def test_recompute_gives_the_gradients_of_none(mode):
    ref, got = grads(cfg()), grads(cfg(**mode))
    assert ref.keys() == got.keys() and all(g is not None for g in ref.values())
    assert all(torch.equal(ref[n], got[n]) for n in ref), [n for n in ref if not torch.equal(ref[n], got[n])]


def test_trainer_step_is_deterministic():
    """Same seed, same bits: one trainer step (FP4 MoEResQ experts, bias update on) twice."""
    from megatron_fp4.training.trainer import Trainer

    def step():
        c = cfg(moe_router_bias_update_rate=0.001)
        s = c.schedule
        s.global_batch_size, s.micro_batch_size, s.seq_len, s.train_steps, s.warmup_steps = 4, 2, 12, 1, 1
        c.data.num_samples, c.logging.tensorboard_dir, c.logging.progress = 50, None, False
        trainer = Trainer(c)
        loss = trainer.train_step()["loss"]
        return [float(loss).hex()] + [float(v).hex() for p in trainer.model.parameters() for v in p.detach().flatten()[:8]] \
            + [float(v).hex() for m in trainer.model.moe_layers() for v in m.router.expert_bias]

    assert step() == step()


@pytest.mark.parametrize("field,value,match", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": -1},
     "rope_scaling.mscale"),
    ("moe_n_group", 3, "moe_n_group"), ("moe_topk_group", 5, "moe_topk_group"), ("num_kv_heads", 2, "num_kv_heads"),
    ("kv_lora_rank", 0, "kv_lora_rank"), ("qk_rope_head_dim", 3, "qk_rope_head_dim"),
])
def test_config_refusals_name_the_field(field, value, match):
    c = cfg()
    if field == "numerics":
        c.numerics.invariance = value
    elif field in ("tp", "etp", "cp"):
        setattr(c.parallel, field, value)
    else:
        setattr(c.model, field, value)
    with pytest.raises(ConfigError, match=match):
        c.validate()


def test_latent_attention_fields_refused_for_other_families():
    c = Config()
    c.model.kv_lora_rank = 16
    with pytest.raises(ConfigError, match="model.kv_lora_rank.*deepseek_v3"):
        c.validate()
    c = Config()
    c.model.family, c.numerics.invariance = "gpt_oss", "standard"
    c.model.rope_scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 1.0}
    with pytest.raises(ConfigError, match="mscale"):
        c.validate()



def test_brute_force_reference_is_itself_checked():
    """The reference above on a hand-made case: group 1 (best two 0.9+0.8) and group 3 (0.95+0.1)
    win over group 0 (0.99+0.0) and group 2; top-3 within them."""
    choice = [0.99, 0.0, 0.9, 0.8, 0.3, 0.3, 0.95, 0.1]
    assert brute_force_topk(choice, 3, 4, 2) == {2, 3, 6}
