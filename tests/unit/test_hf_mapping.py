"""HF Qwen3-MoE name/config mapping and strict loading, with our model only (no transformers)."""
import json

import pytest
import torch
from safetensors.torch import save_file

from megatron_fp4.config import FP4Config, ModelConfig
from megatron_fp4.integrations.hf import (build_model_from_hf, from_hf_state_dict, hf_config_from_ours,
                                          load_hf_checkpoint, ours_config_from_hf, save_hf_checkpoint,
                                          to_hf_state_dict)
from megatron_fp4.model import MoETransformer, init_weights

E, F, H, DENSE_F = 4, 32, 32, 48


def tiny_cfg(**overrides) -> ModelConfig:
    kwargs = dict(vocab_size=40, hidden_size=H, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  max_seq_len=64, rope_theta=5e5, num_experts=E, top_k=2, moe_ffn_hidden_size=F,
                  dense_layers=[1], dense_ffn_hidden_size=DENSE_F, init_std=0.1)
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def tiny_model(seed: int = 0, **overrides) -> MoETransformer:
    model = MoETransformer(tiny_cfg(**overrides), FP4Config(scope="none"))
    init_weights(model, seed)
    return model


def snapshot(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------------------------- config


def test_config_round_trip():
    cfg = tiny_cfg(norm_topk_prob=False, tie_embeddings=True, router_aux_loss_coef=0.02, norm_eps=1e-5)
    hf = hf_config_from_ours(cfg)
    assert hf["model_type"] == "qwen3_moe" and hf["mlp_only_layers"] == [1] and hf["decoder_sparse_step"] == 1
    assert hf["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e5} and hf["rope_theta"] == 5e5
    assert hf["intermediate_size"] == DENSE_F and hf["moe_intermediate_size"] == F and hf["num_experts"] == E
    assert ours_config_from_hf(json.loads(json.dumps(hf))) == cfg


def test_config_legacy_spellings_and_defaults():
    """transformers 4.x / Hub config.json: top-level rope_theta, rope_scaling null, num_local_experts."""
    d = dict(vocab_size=40, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, moe_intermediate_size=16,
             num_experts_per_tok=2, num_local_experts=4, rope_theta=1e6, rope_scaling=None, decoder_sparse_step=2)
    cfg = ours_config_from_hf(d)
    assert cfg.num_experts == 4 and cfg.rope_theta == 1e6
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 8  # HF defaults: MHA, hidden // heads
    assert cfg.dense_layers == [0, 2]  # HF: layer i is MoE iff (i + 1) % decoder_sparse_step == 0
    assert cfg.norm_topk_prob is False and cfg.dense_ffn_hidden_size == 6144  # Qwen3MoeConfig defaults


@pytest.mark.parametrize("change, field", [
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True, "sliding_window": 128}, "use_sliding_window"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_type"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"model_type": "qwen2_moe"}, "model_type"),
    ({"mlp_only_layers": [0, 1]}, "no layer is MoE"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_config_rejects_unsupported(change, field):
    d = hf_config_from_ours(tiny_cfg())
    d.update(change)
    with pytest.raises(ValueError, match=field):
        ours_config_from_hf(d)


def test_shared_experts_have_no_qwen3_equivalent():
    with pytest.raises(ValueError, match="num_shared_experts"):
        hf_config_from_ours(tiny_cfg(num_shared_experts=1))
    with pytest.raises(ValueError, match="num_shared_experts"):
        to_hf_state_dict(tiny_model(num_shared_experts=1, shared_expert_ffn_hidden_size=16))


# ---------------------------------------------------------------------------------- names


def expected_checkpoint_keys(num_layers=2, moe_layers=(0,), tied=False) -> set:
    keys = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if tied else {"lm_head.weight"})
    for i in range(num_layers):
        p = f"model.layers.{i}."
        keys |= {p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                 "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")}
        if i in moe_layers:
            keys.add(p + "mlp.gate.weight")
            keys |= {f"{p}mlp.experts.{e}.{w}_proj.weight" for e in range(E) for w in ("gate", "up", "down")}
        else:
            keys |= {f"{p}mlp.{w}_proj.weight" for w in ("gate", "up", "down")}
    return keys


def test_checkpoint_layout_names_and_values():
    model = tiny_model()
    sd = to_hf_state_dict(model)
    assert set(sd) == expected_checkpoint_keys()
    moe = model.layers[0].mlp
    for e in range(E):
        assert torch.equal(sd[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"], moe.experts.w13[e, :F])
        assert torch.equal(sd[f"model.layers.0.mlp.experts.{e}.up_proj.weight"], moe.experts.w13[e, F:])
        assert torch.equal(sd[f"model.layers.0.mlp.experts.{e}.down_proj.weight"], moe.experts.w2[e])
    assert sd["model.layers.0.mlp.experts.0.gate_proj.weight"].shape == (F, H)
    assert sd["model.layers.0.mlp.experts.0.down_proj.weight"].shape == (H, F)
    assert torch.equal(sd["model.layers.0.mlp.gate.weight"], moe.router.weight)
    assert torch.equal(sd["model.layers.1.mlp.up_proj.weight"], model.layers[1].mlp.up_proj.weight)


def test_fused_layout_names_and_tied_head():
    model = tiny_model(tie_embeddings=True)
    sd = to_hf_state_dict(model, layout="fused")
    experts = {k for k in sd if ".experts." in k}
    assert experts == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}
    assert "lm_head.weight" not in sd  # tied: the Hub convention stores the embedding once
    assert torch.equal(sd["model.layers.0.mlp.experts.gate_up_proj"], model.layers[0].mlp.experts.w13)
    with pytest.raises(ValueError, match="layout"):
        to_hf_state_dict(model, layout="per_expert")


@pytest.mark.parametrize("layout", ["checkpoint", "fused"])
@pytest.mark.parametrize("scope", ["none", "experts+attention"])
def test_round_trip_into_fresh_model_is_bitwise(layout, scope):
    source = tiny_model(seed=1)
    sd = {k: v.clone() for k, v in to_hf_state_dict(source, layout).items()}
    target = MoETransformer(source.cfg, FP4Config(scope=scope))
    init_weights(target, seed=2)
    from_hf_state_dict(target, sd)
    assert_same(snapshot(target), snapshot(source))


def test_mixed_layouts_per_layer_are_accepted():
    source = tiny_model(seed=1, dense_layers=[])
    per_expert = to_hf_state_dict(source, "checkpoint")
    fused = to_hf_state_dict(source, "fused")
    sd = {k: v for k, v in per_expert.items() if not k.startswith("model.layers.1.mlp.experts.")}
    sd.update({k: v for k, v in fused.items() if k.startswith("model.layers.1.mlp.experts.")})
    target = tiny_model(seed=2, dense_layers=[])
    from_hf_state_dict(target, sd)
    assert_same(snapshot(target), snapshot(source))


# ---------------------------------------------------------------------------------- strictness


def check_rejected(sd: dict, *fragments: str, model=None) -> None:
    model = model or tiny_model(seed=5)
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        from_hf_state_dict(model, sd)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert_same(snapshot(model), before)  # nothing was modified


def test_missing_unexpected_and_mismatched_keys_listed_together():
    sd = dict(to_hf_state_dict(tiny_model()))
    del sd["model.layers.0.mlp.experts.3.up_proj.weight"]
    del sd["model.norm.weight"]
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    sd["model.layers.1.mlp.down_proj.weight"] = torch.zeros(H, DENSE_F + 1)
    check_rejected(sd, "missing keys (2)", "model.layers.0.mlp.experts.3.up_proj.weight", "model.norm.weight",
                   "unexpected keys (1)", "q_proj.bias", "mismatched tensors (1)",
                   f"model.layers.1.mlp.down_proj.weight: checkpoint [{H}, {DENSE_F + 1}] vs model [{H}, {DENSE_F}]")


def test_fused_shape_mismatch_and_wrong_expert_count():
    sd = dict(to_hf_state_dict(tiny_model(), "fused"))
    sd["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(E + 1, 2 * F, H)
    check_rejected(sd, "gate_up_proj: checkpoint")
    sd = dict(to_hf_state_dict(tiny_model(num_experts=E + 1)))  # one expert too many
    check_rejected(sd, "unexpected keys", f"experts.{E}.gate_proj.weight", "mlp.gate.weight: checkpoint")


def test_fused_and_per_expert_for_the_same_layer_is_rejected():
    model = tiny_model()
    sd = dict(to_hf_state_dict(model, "fused"))
    sd["model.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(F, H)
    check_rejected(sd, "unexpected keys (1)", "experts.0.gate_proj.weight")


def test_tied_checkpoint_with_lm_head():
    source = tiny_model(tie_embeddings=True)
    sd = dict(to_hf_state_dict(source))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()  # transformers' state_dict includes it
    target = tiny_model(seed=9, tie_embeddings=True)
    from_hf_state_dict(target, sd)
    assert_same(snapshot(target), snapshot(source))
    sd["lm_head.weight"] = torch.zeros_like(sd["lm_head.weight"])
    check_rejected(sd, "lm_head.weight: differs", model=tiny_model(seed=9, tie_embeddings=True))
    untied = dict(to_hf_state_dict(tiny_model()))
    del untied["lm_head.weight"]
    check_rejected(untied, "missing keys (1): lm_head.weight")


# ---------------------------------------------------------------------------------- files


def test_save_and_load_checkpoint_files(tmp_path):
    model = tiny_model(seed=4)
    out = save_hf_checkpoint(model, model.cfg, tmp_path / "export")
    cfg, sd = load_hf_checkpoint(out)
    assert cfg == model.cfg
    assert set(sd) == expected_checkpoint_keys()
    assert_same(snapshot(build_model_from_hf(out, FP4Config(scope="none"))), snapshot(model))
    with pytest.raises(ValueError, match="overwrite=True"):
        save_hf_checkpoint(model, model.cfg, out)
    save_hf_checkpoint(tiny_model(seed=8), model.cfg, out, overwrite=True)
    assert not torch.equal(load_hf_checkpoint(out)[1]["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temp or old directories left


def test_load_sharded_checkpoint(tmp_path):
    model = tiny_model(seed=4)
    sd = {k: v.contiguous().clone() for k, v in to_hf_state_dict(model).items()}
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in shards.items():
        save_file({k: sd[k] for k in part}, str(tmp_path / name), metadata={"format": "pt"})
    weight_map = {k: name for name, part in shards.items() for k in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_ours(model.cfg)))
    assert_same(snapshot(build_model_from_hf(tmp_path, FP4Config(scope="none"))), snapshot(model))


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="config.json not found"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_ours(tiny_cfg())))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="convert them to safetensors"):
        load_hf_checkpoint(tmp_path)


def test_build_model_checks_fp4_block_sizes(tmp_path):
    model = tiny_model(moe_ffn_hidden_size=24)  # not a multiple of the NVFP4 block of 16
    out = save_hf_checkpoint(model, model.cfg, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="moe_ffn_hidden_size"):
        build_model_from_hf(out, FP4Config(scope="experts"))
    assert_same(snapshot(build_model_from_hf(out, FP4Config(scope="none"))), snapshot(model))  # no FP4: it loads
