"""Router replay (rl/algo/replay.py, `Router.forward(replay=)`, the model's ``routing_in``).

- Replaying the routes the model picked itself gives the same bits as routing live (forward and
  every gradient): `torch.topk`'s values are the probabilities at its ids, so gathering there is
  the same numbers (by construction, hence bitwise).
- Replaying other routes uses exactly them; the output and the router's gradient equal a float64
  reference of the formula out = Σ_j w_j·expert_{r_j}(x), w = softmax(x·Wᵀ)[r] / Σ softmax(x·Wᵀ)[r]
  (the live probabilities gathered at the replayed ids, renormalized), computed independently.
- Bad routes: one clear ValueError.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron_fp4.config import ConfigError, config_from_dict
from megatron_fp4.fp4 import Recipe
from megatron_fp4.model.moe import MoELayer, init_moe_params
from megatron_fp4.rl.algo.replay import check_mode, from_log_prob_alignment
from megatron_fp4.rollout import compute_log_probs
from tests.numerics import FP64_REL, rel
from tests.unit.test_rl_policy_loss import tiny_trainer


def _tokens(model, B=3, T=9):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, model.cfg.vocab_size, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :2] = 0  # a left-padded row
    return tokens, mask


def _loss_and_grads(model, tokens, mask, routing_in=None):
    model.zero_grad()
    out = compute_log_probs(model, tokens, mask, routing_in=routing_in)
    loss = (out.log_probs * torch.linspace(0.5, 1.5, tokens.shape[1])).sum()
    loss.backward()
    return out.log_probs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_replaying_own_routes_is_bitwise_live_routing():
    model = tiny_trainer().model.train()
    tokens, mask = _tokens(model)
    with torch.no_grad():
        own = compute_log_probs(model, tokens, mask, return_routing=True).routing
    routes = from_log_prob_alignment(own)  # the positions' own routes; the last position live
    lp_live, g_live = _loss_and_grads(model, tokens, mask)
    lp_rep, g_rep = _loss_and_grads(model, tokens, mask, routes)
    assert torch.equal(lp_live, lp_rep)
    assert set(g_live) == set(g_rep) and any(".router." in n for n in g_live)
    for n in g_live:
        assert torch.equal(g_live[n], g_rep[n]), n
    # ... and other routes do change the log-probs
    other = torch.where(routes >= 0, (routes + 1) % model.cfg.num_experts, routes)  # still k distinct ids
    lp_other, _ = _loss_and_grads(model, tokens, mask, other)
    assert not torch.equal(lp_live, lp_other)


def _moe(norm_topk_prob: bool):
    layer = MoELayer(8, 6, 2, 5, Recipe(mode="bf16"), norm_topk_prob=norm_topk_prob).double()
    init_moe_params(layer, 0.5, 0.5, torch.Generator().manual_seed(3))
    return layer.train()


def _reference(layer, x, replay):
    """float64, independent of the model code: live probs gathered at `replay`, experts as SwiGLU."""
    W = layer.router.weight.detach().clone().requires_grad_()
    probs = torch.softmax(x @ W.T, dim=-1)
    w = probs.gather(1, replay)
    if layer.router.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    w13, w2, ffn = layer.experts.w13.detach(), layer.experts.w2.detach(), layer.experts.ffn
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(replay.shape[1]):
            e = int(replay[t, j])
            h = w13[e] @ x[t]
            out[t] = out[t] + w[t, j] * (w2[e] @ (F.silu(h[:ffn]) * h[ffn:]))
    return out, W


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replayed_routes_are_used_and_router_gradient_matches_reference(norm_topk_prob):
    layer = _moe(norm_topk_prob)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 8, generator=g, dtype=torch.float64)
    live = []
    layer(x, routing_out=live)
    replay = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(7)])
    replay[2] = -1  # this token routes live
    used = []
    dy = torch.randn(7, 8, generator=g, dtype=torch.float64)
    layer.zero_grad()
    out = layer(x, routing_out=used, routing_in=replay)
    (out * dy).sum().backward()
    want_ids = torch.where(replay >= 0, replay, live[0])
    assert torch.equal(used[0], want_ids) and not torch.equal(used[0], live[0])
    ref_out, W = _reference(layer, x, want_ids)
    (ref_out * dy).sum().backward()
    assert rel(out.detach(), ref_out.detach()) <= FP64_REL
    assert W.grad.abs().sum() > 0 and rel(layer.router.weight.grad, W.grad) <= FP64_REL


def test_bad_routes_fail_with_one_clear_error():
    layer = _moe(True)
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="out of range for 6 experts"):
        layer(x, routing_in=torch.full((4, 2), 6))
    with pytest.raises(ValueError, match="must be distinct"):
        layer(x, routing_in=torch.tensor([[3, 3]] * 4))
    with pytest.raises(ValueError, match="all expert ids or all negative"):
        layer(x, routing_in=torch.tensor([[0, -1]] * 4))
    with pytest.raises(ValueError, match="must be one of"):
        check_mode("R3")
    with pytest.raises(ConfigError, match="rl.router_replay='R3' must be one of off"):
        config_from_dict({"rl": {"router_replay": "R3"}})
    assert config_from_dict({"rl": {"router_replay": "r2"}}).rl.router_replay == "r2"
    model = tiny_trainer().model
    tokens, mask = _tokens(model)
    with pytest.raises(ValueError, match="routing_in of shape"):
        compute_log_probs(model, tokens, mask, routing_in=torch.zeros(3, 9, 1, 2, dtype=torch.long))


@pytest.mark.parametrize("routes", [torch.tensor([[0.9, 1.9]] * 4), torch.full((4, 2), float("nan")),
                                    torch.tensor([[0, 1]] * 4, dtype=torch.float64),
                                    torch.ones(4, 2, dtype=torch.bool)])
def test_routes_that_are_not_integer_ids_are_refused(routes):
    """A float route was truncated ([0.9, 1.9] replayed as [0, 1]) and an all-NaN row routed live;
    even integral floats are refused (where they came from, a cast has already happened)."""
    layer = _moe(True)
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"routes of dtype {routes.dtype} must be integer expert ids"):
        layer(x, routing_in=routes)
    for dtype in (torch.int32, torch.int16, torch.uint8):  # any integer type is ids
        layer(x, routing_in=torch.tensor([[0, 1]] * 4, dtype=dtype))


def test_rollout_routes_refuse_float_routes():
    from types import SimpleNamespace

    from megatron_fp4.rl.algo.replay import rollout_routes
    batch = {"input_ids": torch.zeros(1, 5, dtype=torch.long), "prompt_len": 2}
    gen = SimpleNamespace(routing=[torch.tensor([[[0.9, 1.9]], [[2.0, 3.0]]])], response_ids=[[4, 5]])
    with pytest.raises(ValueError, match="rollout routes of request 0: routes of dtype torch.float32"):
        rollout_routes(gen, batch)
    gen.routing = [torch.tensor([[[0, 1]], [[2, 3]]], dtype=torch.int32)]
    assert rollout_routes(gen, batch)[0, 1:3].tolist() == [[[0, 1]], [[2, 3]]]


def test_verl_routed_experts_must_be_integer_ids():
    """verl hands routes over as a nested int16 tensor; a float one was cast with .to(long) (truncated)."""
    pytest.importorskip("verl")
    from megatron_fp4.verl.batches import replay_routes
    rows = [torch.tensor([[[0, 1]], [[2, 3]]]), torch.tensor([[[1, 2]]])]
    mb = {"input_ids": torch.zeros(2, 2, dtype=torch.long)}
    for dtype, ok in ((torch.int16, True), (torch.float32, False)):
        mb["routed_experts"] = torch.nested.as_nested_tensor([r.to(dtype) for r in rows], layout=torch.jagged)
        if ok:
            out = replay_routes(mb, "r2", (2, 2))
            assert out[0].tolist() == [[[0, 1]], [[2, 3]]] and out[1].tolist() == [[[1, 2]], [[-1, -1]]]
        else:
            with pytest.raises(ValueError, match="routed_experts: routes of dtype torch.float32 must be integer"):
                replay_routes(mb, "r2", (2, 2))
