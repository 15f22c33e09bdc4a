"""vLLM adapter: the export (HF checkpoint + FP4 sidecar) on CPU; the vLLM engine parts are skipped
unless vLLM is importable (it also needs a GPU in practice)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatron_fp4.config import Config, FP4Config
from megatron_fp4.integrations.hf import load_hf_checkpoint, to_hf_state_dict
from megatron_fp4.integrations.vllm import (QUANT_METHOD, SIDECAR_FILE, build_vllm_llm, export_for_vllm,
                                            load_quant_sidecar, quant_sidecar, recipe_from_sidecar, vllm_available)
from megatron_fp4.model import build_model
from megatron_fp4.model.specs import recipe_from_config

VLLM = vllm_available()


def _cfg(**fp4) -> Config:
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, num_layers=3, dense_layers=[0])
    cfg.fp4 = FP4Config(**fp4)
    return cfg


def test_export_writes_hf_checkpoint_and_sidecar(tmp_path):
    cfg = _cfg(scope="experts", train_mode="fp4_resq", rollout_mode="fp4_resq", grad_rounding="stochastic", seed=5)
    model = build_model(cfg)
    out = export_for_vllm(model, cfg, tmp_path / "rollout", dtype=None)
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "model.safetensors", SIDECAR_FILE])
    # the HF part is an ordinary Qwen3-MoE checkpoint with our weights, bit for bit (dtype=None)
    model_cfg, sd = load_hf_checkpoint(out)
    assert model_cfg == cfg.model
    ref = to_hf_state_dict(model)
    assert set(sd) == set(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    side = load_quant_sidecar(out)
    assert side == json.loads((out / SIDECAR_FILE).read_text()) == json.loads(json.dumps(quant_sidecar(cfg)))
    assert (side["quant_method"], side["scope"], side["format"], side["rollout_mode"], side["train_mode"]) == \
        (QUANT_METHOD, "experts", "nvfp4", "fp4_resq", "fp4_resq")
    assert side["fp4_modules"]["0"] == [f"model.layers.0.mlp.{n}_proj" for n in ("gate", "up", "down")]
    assert side["fp4_modules"]["1"] == ["model.layers.1.mlp.experts"]
    # the sidecar carries the exact recipes, so the rollout side rebuilds the same Recipe value
    assert recipe_from_sidecar(side) == recipe_from_config(cfg.fp4, "fp4_resq")
    assert recipe_from_sidecar(side, "train") == recipe_from_config(cfg.fp4, cfg.fp4.train_mode)
    assert recipe_from_sidecar(side).grad_output.rounding == "stochastic" and recipe_from_sidecar(side).seed == 5


def test_sidecar_scopes_and_modes():
    side = quant_sidecar(_cfg(scope="experts+attention", format="mxfp4", rollout_mode="fp4"))
    assert side["fp4_modules"]["2"][:4] == [f"model.layers.2.self_attn.{n}_proj" for n in ("q", "k", "v", "o")]
    assert recipe_from_sidecar(side).mode == "fp4" and recipe_from_sidecar(side).input.format == "mxfp4"
    none = quant_sidecar(_cfg(scope="none", train_mode="bf16", rollout_mode="bf16"))
    assert all(v == [] for v in none["fp4_modules"].values())
    with pytest.raises(ValueError, match="sidecar"):
        recipe_from_sidecar({"format_version": 99})


def test_export_is_bf16_by_default_and_refuses_to_clobber(tmp_path):
    cfg = _cfg()
    model = build_model(cfg)
    out = export_for_vllm(model, cfg, tmp_path / "x")
    _, sd = load_hf_checkpoint(out)
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="overwrite=True"):
        export_for_vllm(model, cfg, out)
    cfg2 = _cfg(scope="none", train_mode="bf16", rollout_mode="bf16")
    export_for_vllm(build_model(cfg2), cfg2, out, overwrite=True)
    assert load_quant_sidecar(out)["scope"] == "none"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging leftovers
    with pytest.raises(ValueError, match="megatron_fp4 Config"):
        export_for_vllm(model, cfg.model, tmp_path / "y")
    with pytest.raises(ValueError, match="not found"):
        load_quant_sidecar(tmp_path)


@pytest.mark.skipif(bool(VLLM), reason="vLLM is importable here")
def test_build_llm_raises_clearly_without_vllm(tmp_path):
    assert not VLLM and VLLM.reason
    with pytest.raises(RuntimeError, match="vLLM backend unavailable"):
        build_vllm_llm(tmp_path)


@pytest.mark.skipif(not VLLM or not torch.cuda.is_available(), reason="needs vLLM and a GPU")
def test_build_llm_from_export(tmp_path):  # pragma: no cover - GPU machines only
    cfg = _cfg(scope="none", train_mode="bf16", rollout_mode="bf16")
    cfg.model = dataclasses.replace(cfg.model, hidden_size=128, head_dim=32, vocab_size=256)
    out = export_for_vllm(build_model(cfg), cfg, tmp_path / "m")
    llm = build_vllm_llm(out, skip_tokenizer_init=True, enforce_eager=True, gpu_memory_utilization=0.2)
    assert llm is not None
