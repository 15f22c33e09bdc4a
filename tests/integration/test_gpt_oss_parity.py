"""GPT-OSS: our family (`model/gpt_oss.py`) against the installed `transformers.GptOssForCausalLM`.

A tiny random HF model (nothing downloaded) is converted both ways and the logits compared.

Tolerances. fp32: max|ours - hf| / max|hf| <= 1e-5: the same operations on the same weights, what
differs is fp32 summation order (our de-interleaved w13 GEMM vs HF's interleaved one, ``addmm`` vs
matmul + bias, our ascending-expert combine vs HF's ``index_add``), a few ulps (~1e-7) per op over
4 layers (measured: ~1e-6). fp64: <= 1e-10, the same comparison at fp64 rounding (measured ~1e-14);
HF's ``GptOssRMSNorm`` computes in fp32 whatever the model dtype (``.to(torch.float32)``) while
our fp64 verification mode keeps fp64, so for that comparison the reference's norm runs the same
formula in the model dtype (`_fp64_reference_norm`). RoPE is fp32 on both sides (HF's rotary forces it).
"""
import json
import sys
import warnings

import pytest
import torch

import transformers

from megatron_fp4.config import Config, ConfigError, FP4Config
from megatron_fp4.integrations.hf import build_model_from_hf, save_hf_checkpoint, to_hf_state_dict
from megatron_fp4.model import KVCache
from megatron_fp4.parallel.mesh import ParallelMesh
from megatron_fp4.training.trainer import Trainer
from tools.convert_checkpoint import main as convert_main

from tests.integration.hf_family_parity import logits as family_logits
from tests.integration.hf_family_parity import (cli_round_trip_is_bitwise, norm_in_model_dtype, ours_from,
                                                random_hf, rel_err)
TOKENS = torch.randint(0, 64, (3, 24), generator=torch.Generator().manual_seed(7))
YARN = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=16)
# (a) HF's default layer pattern (sliding, full, ...) with a window shorter than the sequence, YaRN;
# (b) full attention only, plain RoPE, tied embeddings, top-1.
VARIANTS = {
    "sliding_yarn": dict(sliding_window=5, rope_parameters=YARN),
    "full_default_rope_tied": dict(layer_types=["full_attention"] * 4, tie_word_embeddings=True, num_experts_per_tok=1,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def tiny_hf(dtype=torch.float32, seed=0, **overrides):
    """Random GptOssForCausalLM: hidden 64, 4 q / 2 kv heads of 16, 8 experts of 32, 4 layers."""
    kwargs = dict(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=256, sliding_window=5, rope_parameters=YARN)
    kwargs.update(overrides)
    return random_hf(transformers.GptOssForCausalLM, transformers.GptOssConfig(**kwargs), dtype, seed)



def logits(model, tokens=TOKENS, **kw):
    return family_logits(model, tokens, **kw)


@pytest.fixture
def _fp64_reference_norm(monkeypatch):
    mod = sys.modules[transformers.GptOssForCausalLM.__module__]

    norm_in_model_dtype(monkeypatch, mod.GptOssRMSNorm)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers_fp32(variant):
    hf = tiny_hf(**VARIANTS[variant])
    model = ours_from(hf)
    assert model.cfg.family == "gpt_oss"
    err = rel_err(logits(model), logits(hf))
    assert err <= 1e-5, f"{variant}: max relative logits error {err:.3e}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers_fp64(variant, _fp64_reference_norm):
    hf = tiny_hf(torch.float64, **VARIANTS[variant])
    err = rel_err(logits(ours_from(hf)), logits(hf))
    assert err <= 1e-10, f"{variant}: max relative logits error {err:.3e}"


def test_sliding_window_and_sinks_matter():
    """The comparison above can fail: without the window, or with the sinks zeroed, the logits move."""
    hf = tiny_hf()
    model, ref = ours_from(hf), logits(hf)
    for layer in model.layers:
        layer.self_attn.sliding_window = 0
    assert rel_err(logits(model), ref) > 1e-3
    model = ours_from(hf)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.sinks.zero_()
    assert rel_err(logits(model), ref) > 1e-3


def test_state_dict_round_trip_is_bitwise():
    hf = tiny_hf()
    sd = to_hf_state_dict(ours_from(hf))
    theirs = hf.state_dict()
    assert sorted(sd) == sorted(theirs)
    for key, t in theirs.items():
        assert torch.equal(sd[key], t), key


def test_checkpoint_round_trip_and_transformers_reads_it(tmp_path):
    hf = tiny_hf()
    hf.save_pretrained(tmp_path / "hf")
    model = build_model_from_hf(tmp_path / "hf", FP4Config(scope="none"))  # the family from config.json alone
    assert model.cfg.family == "gpt_oss" and model.cfg.layer_types[:2] == ["sliding_attention", "full_attention"]
    save_hf_checkpoint(model, model.cfg, tmp_path / "ours")
    again = build_model_from_hf(tmp_path / "ours", FP4Config(scope="none"))
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "ours").float().eval()
    back.config._experts_implementation = "eager"
    assert torch.equal(logits(back), logits(hf))


def test_kv_cache_decode_equals_full_forward():
    """Prefill 7 tokens then decode 1 at a time past the sliding window (5): fp64, where the only
    difference (GEMM shapes) is fp64 rounding; 1e-10 relative."""
    hf = tiny_hf(torch.float64)
    model = ours_from(hf)
    full = logits(model)
    cache = KVCache.empty(len(model.layers))
    steps = [logits(model, TOKENS[:, :7], kv_cache=cache)]
    for t in range(7, TOKENS.shape[1]):
        steps.append(logits(model, TOKENS[:, t:t + 1], kv_cache=cache))
    assert rel_err(torch.cat(steps, dim=1), full) <= 1e-10


def test_left_padded_batch_equals_unpadded_rows():
    hf = tiny_hf(torch.float64)
    model = ours_from(hf)
    row = TOKENS[:1, :10]
    padded = torch.cat([torch.zeros(1, 3, dtype=row.dtype), row], dim=1)
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 10)], dim=1).long()
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    out = logits(model, padded, positions=positions, attention_mask=mask)
    assert rel_err(out[:, 3:], logits(model, row)) <= 1e-10


def _trainer_cfg(**model):
    cfg = Config()
    cfg.model.family, cfg.model.vocab_size, cfg.model.num_layers = "gpt_oss", 32, 2
    cfg.model.layer_types, cfg.model.sliding_window = ["sliding_attention", "full_attention"], 4
    cfg.model.rope_scaling = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16}
    for k, v in model.items():
        setattr(cfg.model, k, v)
    cfg.numerics.invariance, cfg.fp4.compile = "standard", "off"  # eager FP4 kernels: no compile time in a test
    s = cfg.schedule
    s.global_batch_size, s.micro_batch_size, s.seq_len = 4, 2, 16
    cfg.data.num_samples = 40
    cfg.logging.tensorboard_dir, cfg.logging.progress = None, False
    return cfg


def test_trainer_step_is_finite_and_deterministic():
    """Two trainers of the same config (FP4 experts, MoEResQ): the same losses, bit for bit."""
    runs = []
    for _ in range(2):
        trainer = Trainer(_trainer_cfg(), ParallelMesh.single())
        runs.append([float(trainer.train_step()["loss"]).hex() for _ in range(2)])
    assert runs[0] == runs[1]
    assert all(torch.isfinite(torch.tensor(float.fromhex(h))) for h in runs[0])


@pytest.mark.parametrize("field,value,named", [
    ("model.moe_router_bias_update_rate", 0.001, "learned router bias"),
    ("model.dense_layers", [0], "model.dense_layers")])  # cp: tests/distributed/test_family_cp.py
def test_unsupported_features_are_refused(field, value, named):
    cfg = _trainer_cfg()
    section, key = field.split(".")
    setattr(getattr(cfg, section), key, value)
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        cfg.validate()


def test_family_and_layer_fields_are_validated():
    cfg = _trainer_cfg(family="llama")
    with pytest.raises(ConfigError, match="qwen3_moe"):
        cfg.validate()
    with pytest.raises(ConfigError, match="sliding_window"):
        _trainer_cfg(sliding_window=0).validate()
    with pytest.raises(ConfigError, match="layer_types"):
        _trainer_cfg(layer_types=["full_attention"]).validate()
    with pytest.raises(ConfigError, match="rope_scaling"):
        _trainer_cfg(rope_scaling={"rope_type": "linear", "factor": 2.0}).validate()
    cfg = Config()
    cfg.model.layer_types = ["sliding_attention"] * cfg.model.num_layers
    cfg.model.sliding_window = 8
    with pytest.raises(ConfigError, match="qwen3_moe family"):
        cfg.validate()


def test_unknown_model_type_is_one_clear_error(tmp_path, capsys):
    hf = tiny_hf()
    hf.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg["model_type"] = "mixtral"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type='mixtral' is not a supported model family"):
        build_model_from_hf(tmp_path / "hf")
    assert convert_main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    assert "not a supported model family" in capsys.readouterr().err


def test_convert_checkpoint_cli_round_trip_is_bitwise(tmp_path, capsys):
    cli_round_trip_is_bitwise(tiny_hf(), tmp_path, capsys, "gpt_oss")
