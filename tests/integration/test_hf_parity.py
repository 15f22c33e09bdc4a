"""HF parity: our MoETransformer against the installed `transformers.Qwen3MoeForCausalLM`.

A tiny random HF model is built locally (nothing is downloaded), converted both ways, and the
logits compared. Tolerance: max|ours - hf| / max|hf| <= 1e-5 in fp32. Both sides do the same
operations on the same weights; what may differ is fp32 summation order (SDPA vs HF's attention
kernel, our ascending-expert-index combine vs HF's index_add over experts, grouped vs per-expert
GEMMs), i.e. a few ulps (~1e-7 relative) per op, amplified by a few layers to well under 1e-5.
On CPU with torch 2.13 / transformers 5.10 the measured error is exactly 0.
"""
import json

import pytest
import torch

import transformers  # the test extra installs it; models are built in memory / read from tmp dirs only

from megatron_fp4.config import FP4Config, ModelConfig  # noqa: E402
from megatron_fp4.integrations.hf import (build_model_from_hf, from_hf_state_dict, hf_config_from_ours,  # noqa: E402
                                          load_hf_checkpoint, ours_config_from_hf, save_hf_checkpoint,
                                          to_hf_state_dict)
from megatron_fp4.model import MoETransformer, init_weights  # noqa: E402

RTOL = 1e-5  # fp32 summation-order differences only, see the module docstring
TOKENS = torch.randint(0, 64, (3, 24), generator=torch.Generator().manual_seed(7))

# (a) one dense layer via mlp_only_layers, untied head, normalized top-k;
# (b) every other layer dense via decoder_sparse_step=2, tied embeddings, un-normalized top-k.
HF_CONFIGS = {
    "mlp_only_layers": dict(num_hidden_layers=4, mlp_only_layers=[1], norm_topk_prob=True, tie_word_embeddings=False),
    "sparse_step_tied": dict(num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=False,
                             tie_word_embeddings=True),
}


def tiny_hf_model(seed: int = 0, **overrides):
    """Random fp32 Qwen3MoeForCausalLM: hidden 64, GQA 4 q / 2 kv heads of 16, 8 experts top-2."""
    kwargs = dict(vocab_size=64, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  moe_intermediate_size=32, intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=128)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kwargs)).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms away from 1 and a peaked router, so every tensor's mapping matters
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
    return model


def hf_logits(hf_model, tokens=TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(input_ids=tokens).logits


def our_logits(model, tokens=TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(tokens).logits


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def ours_from_hf(hf_model, fp4_cfg: FP4Config) -> MoETransformer:
    model = MoETransformer(ours_config_from_hf(hf_model.config), fp4_cfg)
    from_hf_state_dict(model, hf_model.state_dict())
    return model


@pytest.mark.parametrize("variant", sorted(HF_CONFIGS))
def test_hf_to_ours_logits_match(variant):
    hf = tiny_hf_model(**HF_CONFIGS[variant])
    model = ours_from_hf(hf, FP4Config(scope="none"))
    assert [layer.is_moe for layer in model.layers] == [type(l.mlp).__name__ == "Qwen3MoeSparseMoeBlock"
                                                        for l in hf.model.layers]
    err = rel_err(our_logits(model), hf_logits(hf))
    assert err <= RTOL, f"{variant}: max relative logits error {err:.3e} > {RTOL}"


@pytest.mark.parametrize("scope", ["experts", "experts+attention"])
def test_fp4_scope_in_bf16_mode_matches_hf(scope):
    """FP4 linears in mode bf16 are exactly F.linear, so the FP4-scoped model keeps HF parity."""
    hf = tiny_hf_model(**HF_CONFIGS["mlp_only_layers"])
    model = ours_from_hf(hf, FP4Config(scope=scope, train_mode="bf16", rollout_mode="bf16"))
    assert model.fp4_mode == "bf16"
    err = rel_err(our_logits(model), hf_logits(hf))
    assert err <= RTOL, f"scope={scope}: max relative logits error {err:.3e} > {RTOL}"


def test_hf_save_pretrained_checkpoint_loads_into_ours(tmp_path):
    """transformers' own writer (per-expert "checkpoint" layout + its config.json) read by ours."""
    hf = tiny_hf_model(seed=1, **HF_CONFIGS["mlp_only_layers"])
    hf.save_pretrained(tmp_path)
    _, sd = load_hf_checkpoint(tmp_path)
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in sd  # the Hub layout, as transformers writes it
    model = build_model_from_hf(tmp_path, FP4Config(scope="none"))
    err = rel_err(our_logits(model), hf_logits(hf))
    assert err <= RTOL, f"max relative logits error {err:.3e} > {RTOL}"


def tiny_ours(tie: bool = False, seed: int = 3) -> MoETransformer:
    cfg = ModelConfig(vocab_size=64, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_seq_len=128, rope_theta=1e6, num_experts=8, top_k=2, moe_ffn_hidden_size=32,
                      dense_layers=[0], dense_ffn_hidden_size=96, tie_embeddings=tie, init_std=0.1)
    model = MoETransformer(cfg, FP4Config(scope="none"))
    init_weights(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_ours_to_hf_state_dict_round_trip(tie):
    """ours -> HF (fused layout, the installed module's state_dict) -> strict HF load -> same logits."""
    model = tiny_ours(tie)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**hf_config_from_ours(model.cfg))).eval()
    sd = {k: v.clone() for k, v in to_hf_state_dict(model, layout="fused").items()}
    if tie:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    hf.load_state_dict(sd, strict=True)
    err = rel_err(hf_logits(hf), our_logits(model))
    assert err <= RTOL, f"tie={tie}: max relative logits error {err:.3e} > {RTOL}"


@pytest.mark.parametrize("tie", [False, True])
def test_save_hf_checkpoint_loads_in_transformers(tmp_path, tie):
    """Our safetensors + config.json, read by Qwen3MoeForCausalLM.from_pretrained (its per-expert
    → fused converter checks our gate/up order), gives the same logits."""
    model = tiny_ours(tie)
    out = save_hf_checkpoint(model, model.cfg, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary directory left behind
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings == tie
    err = rel_err(hf_logits(hf), our_logits(model))
    assert err <= RTOL, f"tie={tie}: max relative logits error {err:.3e} > {RTOL}"


def test_safetensors_round_trip_is_bitwise(tmp_path):
    model = tiny_ours()
    out = save_hf_checkpoint(model, model.cfg, tmp_path / "ckpt")
    cfg, sd = load_hf_checkpoint(out)
    assert cfg == model.cfg
    assert json.loads((out / "config.json").read_text())["num_experts"] == 8
    assert set(sd) == set(to_hf_state_dict(model))
    loaded = build_model_from_hf(out, FP4Config(scope="none"))
    theirs = loaded.state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(theirs[name], t), name
    assert torch.equal(our_logits(loaded), our_logits(model))


def test_bf16_export_loads_into_fp32_model(tmp_path):
    model = tiny_ours()
    out = save_hf_checkpoint(model, model.cfg, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = build_model_from_hf(out, FP4Config(scope="none"))
    w13 = loaded.layers[1].mlp.experts.w13
    assert w13.dtype == torch.float32
    assert torch.equal(w13, model.layers[1].mlp.experts.w13.detach().bfloat16().float())
