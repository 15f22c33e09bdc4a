"""DeepSeek-V3: our family (`model/deepseek_v3.py`) against the installed `transformers.DeepseekV3ForCausalLM`.

A tiny random HF model (nothing downloaded: 3 layers, the first dense, 8 routed experts in 4
groups of which 2 are kept, a shared expert, q low rank or a plain q_proj) is converted both ways
and the logits compared (also with YaRN and DeepSeek's mscale / mscale_all_dim terms).

Tolerances. fp32: max|ours - hf| / max|hf| <= 1e-5: the same operations on the same weights, what
differs is fp32 summation order (our ascending-expert combine vs HF's ``index_add``, SDPA kernels
called with different masks), a few ulps per op over 3 layers. fp64: <= 1e-10, the same comparison
at fp64 rounding; HF's ``DeepseekV3RMSNorm`` computes in fp32 whatever the model dtype while our
fp64 verification mode keeps fp64, so for that comparison the reference's norm runs the same
formula in the model dtype (`_fp64_reference_norm`), and so do its router logits (HF casts them to
fp32). RoPE is fp32 on both sides (HF's rotary forces it).
"""
import sys
import warnings

import pytest
import torch

import transformers

from megatron_fp4.config import FP4Config
from megatron_fp4.integrations.hf import (build_model_from_hf, ours_config_from_hf, save_hf_checkpoint,
                                          to_hf_state_dict)
from megatron_fp4.model import KVCache, deepseek_v3

from tests.integration.hf_family_parity import logits as family_logits
from tests.integration.hf_family_parity import (cli_round_trip_is_bitwise, norm_in_model_dtype, ours_from,
                                                random_hf, rel_err)
TOKENS = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(7))
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=8, beta_fast=32.0,
            beta_slow=1.0, mscale=0.7, mscale_all_dim=1.0)
VARIANTS = {
    "q_lora_norm_topk": dict(),
    "yarn_mscale": dict(rope_parameters=YARN, max_position_embeddings=64),
    "q_proj_tied_unnormalised": dict(q_lora_rank=None, tie_word_embeddings=True, norm_topk_prob=False,
                                     n_shared_experts=2, topk_group=3, routed_scaling_factor=1.5),
}


def tiny_hf(dtype=torch.float32, seed=0, **overrides):
    """Random DeepseekV3ForCausalLM: hidden 64, 4 heads (nope 8, rope 4, v 12), q/kv ranks 24/16,
    8 experts of 32 in 4 groups, top-3 within 2 groups, 1 shared expert, 3 layers (1 dense)."""
    kwargs = dict(vocab_size=64, hidden_size=64, intermediate_size=48, moe_intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                  routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, v_head_dim=12,
                  qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
                  norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    kwargs.update(overrides)
    return random_hf(transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config(**kwargs), dtype, seed, buffers=("e_score_correction_bias",))



def logits(model, tokens=TOKENS, **kw):
    return family_logits(model, tokens, **kw)


@pytest.fixture
def _fp64_reference_norm(monkeypatch):
    mod = sys.modules[transformers.DeepseekV3ForCausalLM.__module__]

    def router(self, h):  # HF's router logits are fp32 whatever the model dtype; ours keep fp64 too
        h = h.view(-1, self.config.hidden_size)
        return torch.nn.functional.linear(h, self.weight.to(h.dtype))

    norm_in_model_dtype(monkeypatch, mod.DeepseekV3RMSNorm)
    monkeypatch.setattr(mod.DeepseekV3TopkRouter, "forward", router)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers_fp32(variant):
    hf = tiny_hf(**VARIANTS[variant])
    model = ours_from(hf)
    assert model.cfg.family == "deepseek_v3" and model.cfg.dense_layers == [0]
    err = rel_err(logits(model), logits(hf))
    assert err <= 1e-5, f"{variant}: max relative logits error {err:.3e}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers_fp64(variant, _fp64_reference_norm):
    hf = tiny_hf(torch.float64, **VARIANTS[variant])
    err = rel_err(logits(ours_from(hf)), logits(hf))
    assert err <= 1e-10, f"{variant}: max relative logits error {err:.3e}"


def test_group_limit_bias_and_interleave_matter(monkeypatch):
    """The comparison above can fail: routing over all groups, ignoring the selection bias, or
    rotating without HF's interleave each move the logits far beyond the tolerance."""
    hf = tiny_hf(torch.float64)
    ref = logits(hf)
    model = ours_from(hf)
    for mlp in model.moe_layers():
        mlp.router.topk_group = mlp.router.n_group
    assert rel_err(logits(model), ref) > 1e-3
    model = ours_from(hf)
    for mlp in model.moe_layers():
        mlp.router.expert_bias.zero_()
    assert rel_err(logits(model), ref) > 1e-3
    monkeypatch.setattr(deepseek_v3, "deinterleave", lambda x: x)
    assert rel_err(logits(ours_from(hf)), ref) > 1e-3


def test_state_dict_round_trip_is_bitwise():
    hf = tiny_hf()
    sd = to_hf_state_dict(ours_from(hf), layout="fused")
    theirs = hf.state_dict()
    assert sorted(sd) == sorted(theirs)
    for key, t in theirs.items():
        assert torch.equal(sd[key], t), key


def test_checkpoint_round_trip_and_transformers_reads_it(tmp_path):
    hf = tiny_hf()
    hf.save_pretrained(tmp_path / "hf")
    model = build_model_from_hf(tmp_path / "hf", FP4Config(scope="none"))  # the family from config.json alone
    assert model.cfg.family == "deepseek_v3" and model.cfg.moe_n_group == 4
    save_hf_checkpoint(model, model.cfg, tmp_path / "ours")
    again = build_model_from_hf(tmp_path / "ours", FP4Config(scope="none"))
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "ours").float().eval()
    back.config._experts_implementation = "eager"
    assert torch.equal(logits(back), logits(hf))


@pytest.mark.parametrize("capacity", [0, 32])
def test_kv_cache_decode_equals_full_forward(capacity):
    """Prefill then one token at a time (growing and static caches; v_head_dim != qk dim) gives the
    full forward's logits (fp64: the cache changes only which kernel sums, not the values)."""
    model = ours_from(tiny_hf(torch.float64))
    full = logits(model)
    cache = KVCache.empty(model.cfg.num_layers, capacity=capacity)
    steps = [logits(model, TOKENS[:, :8], kv_cache=cache)]
    for t in range(8, TOKENS.shape[1]):
        steps.append(logits(model, TOKENS[:, t:t + 1], kv_cache=cache))
    assert rel_err(torch.cat(steps, dim=1), full) <= 1e-12


def test_unsupported_hf_settings_are_refused():
    cfg = tiny_hf().config.to_dict()
    for key, value in (("rope_interleave", False), ("attention_bias", True), ("topk_method", "greedy"),
                       ("rope_parameters", {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})):
        with pytest.raises(ValueError, match=key.split("_")[0]):
            ours_config_from_hf({**cfg, key: value})


def test_left_padded_batch_equals_unpadded_rows():
    model = ours_from(tiny_hf(torch.float64))
    row = TOKENS[:1, :10]
    padded = torch.cat([torch.zeros(1, 3, dtype=row.dtype), row], dim=1)
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 10)], dim=1).long()
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    out = logits(model, padded, positions=positions, attention_mask=mask)
    assert rel_err(out[:, 3:], logits(model, row)) <= 1e-10


def test_convert_checkpoint_cli_round_trip_is_bitwise(tmp_path, capsys):
    cli_round_trip_is_bitwise(tiny_hf(), tmp_path, capsys, "deepseek_v3")
