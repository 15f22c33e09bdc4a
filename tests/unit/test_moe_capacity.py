"""The MoE layer with expert capacity (model.moe_capacity_factor) against a per-expert float64 loop,
and its refusals. The reference is independent of the dispatcher path: for every token it adds
w · expert_e(x) over the slots `capacity_keep` keeps (its own test checks the drop order against a
per-expert Python reference), in float64, so the layer (float64 here too) must agree within
FP64_REL of the output's scale (tests/numerics.py)."""
import pytest
import torch
import torch.nn.functional as F

from megatron_fp4.config import Config, ConfigError
from megatron_fp4.fp4 import Recipe
from megatron_fp4.model.capacity import capacity_keep, expert_capacity
from megatron_fp4.model.moe import MoELayer, init_moe_params
from megatron_fp4.model.transformer import build_model
from megatron_fp4.rollout import RolloutEngine
from tests.numerics import FP64_REL

H, FFN, E, K = 16, 16, 4, 2


def layer(capacity_factor=None, policy="probs"):
    m = MoELayer(H, E, K, FFN, Recipe(mode="bf16"), capacity_factor=capacity_factor, drop_policy=policy)
    init_moe_params(m, 0.5, 0.3, torch.Generator().manual_seed(0))
    return m.double()


def reference(m, x, factor, policy):
    _, _, idx, w = m.router(x)
    keep = capacity_keep(idx, w, E, expert_capacity(x.shape[0], K, E, factor), policy)
    out = torch.zeros_like(x)
    w13, w2 = m.experts.w13.detach(), m.experts.w2.detach()
    for t in range(x.shape[0]):
        for j in range(K):
            if keep[t, j]:
                e = int(idx[t, j])
                gate, up = (x[t] @ w13[e].t()).chunk(2)
                out[t] += w[t, j] * ((F.silu(gate) * up) @ w2[e].t())
    return out, keep


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_like_the_reference(policy):
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    m = layer(0.75, policy).eval()
    got = m(x)
    want, keep = reference(m, x, 0.75, policy)
    assert not bool(keep.all()), "the factor must drop pairs, or the test checks nothing"
    assert float((got - want).abs().max()) <= FP64_REL * float(want.abs().max())
    # gradients flow through the kept pairs (router and experts)
    m.train()
    m(x).square().sum().backward()
    assert float(m.router.weight.grad.abs().sum()) > 0 and float(m.experts.w2.grad.abs().sum()) > 0


def test_large_capacity_equals_no_capacity_bitwise():
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    # capacity T·k/E·(E/k) = T: every pair fits, so nothing is dropped and the bits are the plain path's
    assert torch.equal(layer(E / K).eval()(x), layer(None).eval()(x))


def test_capacity_config_checked_and_refused_for_rollout():
    cfg = Config()
    cfg.model.moe_capacity_factor = 0.0
    with pytest.raises(ConfigError, match="model.moe_capacity_factor"):
        cfg.validate()
    cfg.model.moe_capacity_factor, cfg.model.moe_token_drop_policy = 1.25, "random"
    with pytest.raises(ConfigError, match="model.moe_token_drop_policy"):
        cfg.validate()
    cfg.model.moe_token_drop_policy, cfg.model.num_layers = "position", 2
    model = build_model(cfg.validate(), seed=0)
    assert all(moe.capacity_factor == 1.25 for moe in model.moe_layers())
    with pytest.raises(ValueError, match="moe_capacity_factor=null for RL"):
        RolloutEngine(model)
