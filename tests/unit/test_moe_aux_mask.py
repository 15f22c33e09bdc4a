"""The MoE auxiliary losses (load balancing, z-loss) count only real tokens: a padded batch gives the
aux loss of its real tokens (HF's `load_balancing_loss_func(attention_mask=)` as the independent
reference) and a padding token's embedding gets no gradient at all (its forward output is discarded).

How the project's balance loss maps to HF's: HF's ``E·Σ_j Σ_e frac(slot j on e)·P_e`` sums the k slots'
fractions, ours is ``E·Σ_e counts_e/(N·k)·P_e`` per layer, so ours = HF(one layer's logits) / k.
"""
from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from megatron_fp4.config import Config
from megatron_fp4.model.moe import MoELayer
from megatron_fp4.model.transformer import build_model, lm_loss
from megatron_fp4.rollout.engine import positions_from_mask

PAD = 31  # a token id the real tokens never use (vocab 32): its embedding row is the pads' alone


def _model(dtype=torch.float64, z=1e-3):
    cfg = Config()
    cfg.model.num_layers, cfg.model.router_z_loss_coef = 2, z
    cfg.fp4.scope = "none"  # FP4 scales span rows (global amax): pads would then really change real tokens
    model = build_model(cfg, seed=3).to(dtype)
    model.train()
    model.set_record_stats(True)
    return model


def _batch(lengths=(7, 4, 9), total=12, seed=0):
    """Left-padded rows of random real tokens (ids < PAD) and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, PAD, (n,), generator=g) for n in lengths]
    tokens = torch.full((len(seqs), total), PAD)
    mask = torch.zeros(len(seqs), total, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, total - len(s):], mask[i, total - len(s):] = s, 1
    return seqs, tokens, mask


def _router_logits(model, fn):
    """fn() with every MoE router's logits recorded, per layer."""
    seen: dict = {}
    hooks = [m.router.register_forward_hook(lambda mod, a, out, i=i: seen.setdefault(i, []).append(out[0].detach()))
             for i, m in enumerate(model.moe_layers())]
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_padded_aux_loss_equals_real_tokens_hf_reference():
    model = _model()
    seqs, tokens, mask = _batch()
    k, E = model.cfg.top_k, model.cfg.num_experts
    padded = _router_logits(model, lambda: model(tokens, positions_from_mask(mask), mask))
    ours = [m.stats[-1]["aux_loss"] for m in model.moe_layers()]
    z_ours = [m.stats[-1]["z_loss"] for m in model.moe_layers()]
    logged = [m.stats[-1]["counts"] for m in model.moe_layers()]
    # the same real tokens, each sequence unpadded on its own
    alone = _router_logits(model, lambda: [model(s[None]) for s in seqs])
    for i in range(len(model.moe_layers())):
        real = torch.cat([lg.reshape(-1, E) for lg in alone[i]])
        ref = load_balancing_loss_func((real,), E, k) / k
        ref_masked = load_balancing_loss_func((padded[i][0],), E, k, mask) / k
        # HF takes the token fractions in fp32 (2 ulp: 2.4e-7 relative) against fp64 probabilities
        # that differ between the padded and the unpadded forward by fp64 rounding only
        tol = 1e-6 * float(ref)
        assert abs(float(ours[i]) - float(ref)) <= tol, (i, float(ours[i]), float(ref))
        assert abs(float(ours[i]) - float(ref_masked)) <= tol
        z_ref = torch.logsumexp(real, -1).pow(2).mean()
        assert abs(float(z_ours[i]) - float(z_ref)) <= 1e-12 * float(z_ref)
        counts = torch.bincount(real.softmax(-1).topk(k, -1).indices.reshape(-1), minlength=E)
        assert torch.equal(logged[i], counts)  # logged counts: real tokens only


@pytest.mark.parametrize("coef", [(0.01, 0.0), (0.0, 1e-3)])
def test_pad_embedding_gets_no_gradient(coef):
    """Neither the balance loss nor the z-loss reaches a padding token (old code: ~1e-3 gradient)."""
    model = _model(torch.float32)
    for m in model.moe_layers():
        m.aux_loss_coef, m.z_loss_coef = coef
    _, tokens, mask = _batch()
    logits = model(tokens, positions_from_mask(mask), mask).logits
    real = mask.bool()
    labels = torch.where(real[:, 1:] & real[:, :-1], tokens[:, 1:], -100)  # predicted from real tokens only
    lm_loss(logits[:, :-1], labels).backward()
    grad = model.embed_tokens.weight.grad
    assert grad[tokens[0, -1]].abs().max() > 0  # real tokens do get gradient
    assert torch.count_nonzero(grad[PAD]) == 0, grad[PAD].abs().max()


def test_all_ones_mask_matches_no_mask():
    """The masked formula with every token real equals the unmasked one, within the unmasked path's
    fp32 token fractions (``counts.float()``, 2^-24 relative each: <= 6e-8 of the loss) and fp64
    rounding of a mean taken as sum/n."""
    layer = MoELayer(16, 8, 2, 8, None, aux_loss_coef=0.01, z_loss_coef=1e-3).double().train()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 8, generator=g, dtype=torch.float64)
    probs = logits.softmax(-1)
    idx = probs.topk(2, -1).indices
    b0, z0, c0 = layer.aux_losses(logits, probs, idx)
    b1, z1, c1 = layer.aux_losses(logits, probs, idx, torch.ones(40, dtype=torch.bool))
    assert torch.equal(c0, c1)
    assert abs(float(b0 - b1)) <= 1e-7 * float(b0) and abs(float(z0 - z1)) <= 1e-14 * float(z0)
    b2, z2, _ = layer.aux_losses(logits, probs, idx, torch.zeros(40, dtype=torch.bool))
    assert float(b2) == 0.0 and float(z2) == 0.0  # no real token: no loss, no NaN
