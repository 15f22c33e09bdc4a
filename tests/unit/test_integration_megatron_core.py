"""Megatron-Core mapping: config fields, FP4 submodules, checkpoint names (bitwise round trips).

Tests marked `megatron_core` build real megatron-core objects (TransformerConfig, and a GPTModel
with the local spec on CPU in a subprocess) and are skipped when megatron-core is not installed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import megatron.core  # noqa: F401 - the test extra installs megatron-core: a missing package fails, never skips

from megatron_fp4.config import Config, FP4Config
from megatron_fp4.fp4 import MoEResQLinear
from megatron_fp4.integrations.megatron_core import (build_transformer_config, fp4_module_names, fp4_submodules,
                                                     from_mcore_state_dict, from_megatron_transformer_config,
                                                     interleave_qkv, is_fp4_parameter, split_megatron_kwargs,
                                                     split_qkv, to_mcore_state_dict, to_megatron_transformer_config)
from megatron_fp4.model import GroupedExperts, build_model

REPO = Path(__file__).resolve().parents[2]


def _cfg(**model) -> Config:
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, **{"num_layers": 4, "dense_layers": [0], "num_shared_experts": 1,
                                                  "shared_expert_ffn_hidden_size": 32, "rope_theta": 1e6, **model})
    return cfg


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
def test_config_fields():
    cfg = _cfg()
    cfg.parallel = dataclasses.replace(cfg.parallel, pp=2, virtual_stages=2, ep=2, schedule="interleaved_1f1b")
    d = to_megatron_transformer_config(cfg)
    m = cfg.model
    expect = {
        "num_layers": 4, "hidden_size": m.hidden_size, "num_attention_heads": m.num_heads,
        "num_query_groups": m.num_kv_heads, "kv_channels": m.head_dim, "ffn_hidden_size": m.dense_ffn_hidden_size,
        "moe_ffn_hidden_size": m.moe_ffn_hidden_size, "num_moe_experts": m.num_experts, "moe_router_topk": m.top_k,
        "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": m.router_aux_loss_coef,
        "moe_z_loss_coeff": m.router_z_loss_coef, "qk_layernorm": True, "normalization": "RMSNorm",
        "gated_linear_unit": True, "add_bias_linear": False, "rotary_base": 1000000,
        "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2,
        "moe_router_dtype": "fp32", "moe_layer_freq": [0, 1, 1, 1], "moe_shared_expert_intermediate_size": 32,
        "moe_router_pre_softmax": False, "fp4": None,
    }
    assert {k: d[k] for k in expect} == expect
    assert d["activation_func"] is F.silu
    tc, gpt = split_megatron_kwargs(d)
    assert set(gpt) == {"vocab_size", "max_sequence_length", "position_embedding_type", "rotary_base",
                        "rotary_percent", "share_embeddings_and_output_weights"}
    assert not set(tc) & set(gpt)


def test_config_round_trip():
    cfg = _cfg(norm_topk_prob=False, tie_embeddings=True)
    cfg.parallel = dataclasses.replace(cfg.parallel, pp=2, virtual_stages=2, ep=2, schedule="interleaved_1f1b")
    back = from_megatron_transformer_config(to_megatron_transformer_config(cfg), fp4_cfg=cfg.fp4)
    assert back.model == cfg.model
    assert (back.parallel.pp, back.parallel.virtual_stages, back.parallel.ep, back.parallel.schedule) == \
        (2, 2, 2, "interleaved_1f1b")
    assert back.fp4 == cfg.fp4
    cfg.parallel = dataclasses.replace(cfg.parallel, tp=2, etp=2, sequence_parallel=True)
    d = to_megatron_transformer_config(cfg)
    assert (d["tensor_model_parallel_size"], d["expert_tensor_parallel_size"], d["sequence_parallel"]) == (2, 2, True)
    back = from_megatron_transformer_config(d, fp4_cfg=cfg.fp4).parallel
    assert (back.tp, back.etp, back.sequence_parallel) == (2, 2, True)
    # without fp4_cfg, fp4=None (our MoEResQ backend is invisible to mcore) reads back as no FP4
    assert from_megatron_transformer_config(to_megatron_transformer_config(cfg)).fp4.scope == "none"


def test_te_nvfp4_backend_only_for_what_it_expresses():
    with pytest.raises(ValueError, match="fp4.scope='experts'.*te_nvfp4"):
        to_megatron_transformer_config(_cfg(), fp4_backend="te_nvfp4")
    cfg = _cfg()
    cfg.fp4 = FP4Config(scope="experts+attention", train_mode="fp4", rollout_mode="fp4")
    d = to_megatron_transformer_config(cfg, fp4_backend="te_nvfp4")
    assert (d["fp4"], d["fp4_recipe"]) == ("e2m1", "nvfp4")
    back = from_megatron_transformer_config(d)
    assert (back.fp4.scope, back.fp4.format, back.fp4.train_mode) == ("experts+attention", "nvfp4", "fp4")
    with pytest.raises(ValueError, match="fp4_backend"):
        to_megatron_transformer_config(cfg, fp4_backend="fp8")


@pytest.mark.parametrize("field,value", [
    ("normalization", "LayerNorm"), ("add_bias_linear", True), ("gated_linear_unit", False),
    ("activation_func", F.gelu), ("moe_router_score_function", "sigmoid"), ("context_parallel_size", 2),
    ("hidden_dropout", 0.1), ("qk_layernorm", False), ("moe_router_load_balancing_type", "seq_aux_loss"),
    ("num_moe_experts", None), ("fp8", "hybrid"), ("moe_router_dtype", "fp64"), ("multi_latent_attention", True),
    ("moe_layer_freq", "([1]*3+[0])"),
])
def test_unsupported_features_name_the_field(field, value):
    d = to_megatron_transformer_config(_cfg())
    d[field] = value
    with pytest.raises(ValueError, match=field):
        from_megatron_transformer_config(d)


def test_reverse_needs_vocab_size():
    tc, gpt = split_megatron_kwargs(to_megatron_transformer_config(_cfg()))
    with pytest.raises(ValueError, match="vocab_size"):
        from_megatron_transformer_config(tc)
    assert from_megatron_transformer_config(tc, gpt).model == _cfg().model


def test_int_moe_layer_freq():
    d = to_megatron_transformer_config(_cfg())
    d["moe_layer_freq"] = 2  # mcore: layer i is MoE when i % 2 == 0
    assert from_megatron_transformer_config(d).model.dense_layers == [1, 3]


def test_megatron_transformer_config_accepts_the_mapping():
    cfg = _cfg()
    cfg.parallel = dataclasses.replace(cfg.parallel, pp=2, virtual_stages=2, ep=2, schedule="interleaved_1f1b")
    tc = build_transformer_config(cfg)
    assert (tc.num_query_groups, tc.kv_channels, tc.moe_router_topk, tc.moe_router_dtype) == \
        (cfg.model.num_kv_heads, cfg.model.head_dim, cfg.model.top_k, "fp32")
    _, gpt = split_megatron_kwargs(to_megatron_transformer_config(cfg))
    back = from_megatron_transformer_config(tc, gpt, fp4_cfg=cfg.fp4)
    assert back.model == cfg.model and back.parallel.pp == 2 and back.parallel.ep == 2
    cfg.fp4 = FP4Config(scope="experts+attention", train_mode="fp4", rollout_mode="fp4")
    assert build_transformer_config(cfg, fp4_backend="te_nvfp4").fp4 == "e2m1"


# ---------------------------------------------------------------------------------------------
# FP4 submodules
# ---------------------------------------------------------------------------------------------
def test_fp4_submodules_per_scope():
    assert fp4_submodules("none") == ()
    assert fp4_submodules("experts") == ("mlp.experts.linear_fc1", "mlp.experts.linear_fc2")
    assert fp4_submodules("experts+attention") == ("self_attention.linear_qkv", "self_attention.linear_proj",
                                                   "mlp.experts.linear_fc1", "mlp.experts.linear_fc2")
    assert "mlp.shared_experts.linear_fc1" in fp4_submodules("experts", shared_experts=True)
    assert fp4_submodules("experts", is_moe=False) == ("mlp.linear_fc1", "mlp.linear_fc2")
    with pytest.raises(ValueError, match="scope"):
        fp4_submodules("attention")


@pytest.mark.parametrize("scope", ["none", "experts", "experts+attention"])
@pytest.mark.parametrize("spec,experts", [("te", "sequential"), ("local", "te_grouped")])
def test_fp4_parameters_match_our_model(scope, spec, experts):
    """The mcore parameters the spec helper calls FP4 are exactly the images of our FP4 weights."""
    cfg = _cfg()
    cfg.fp4 = FP4Config(scope=scope)
    model = build_model(cfg)
    ours_fp4 = set()
    for mod_name, mod in model.named_modules():  # (scope none keeps bf16-mode MoEResQ linears: exact F.linear)
        if isinstance(mod, MoEResQLinear) and mod.recipe.quantized:
            ours_fp4.add(f"{mod_name}.weight")
        elif isinstance(mod, GroupedExperts) and mod.recipe.quantized:
            ours_fp4 |= {f"{mod_name}.w13", f"{mod_name}.w2"}
    assert bool(ours_fp4) == (scope != "none")
    marked = {k: torch.full_like(v, 1.0 if k in ours_fp4 else 0.0) for k, v in model.state_dict().items()}
    mc = to_mcore_state_dict(marked, cfg.model, spec, experts)
    for name, t in mc.items():
        assert is_fp4_parameter(name, cfg) == bool(t.min() == 1.0), name
        assert bool(t.min() == t.max()), name  # no tensor mixes FP4 and non-FP4 sources
    mods = fp4_module_names(cfg)
    assert len(mods) == (0 if scope == "none" else
                         sum(len(fp4_submodules(scope, i != 0, True)) for i in range(cfg.model.num_layers)))


# ---------------------------------------------------------------------------------------------
# checkpoint names
# ---------------------------------------------------------------------------------------------
def test_qkv_interleave_against_hand_written_reference():
    heads, kv_heads, D, H = 6, 2, 2, 3
    # Row r of q is head r // D; fill every row with a code naming (tensor, head, row within head).
    q = torch.tensor([[100 + 10 * (r // D) + r % D] * H for r in range(heads * D)], dtype=torch.float32)
    k = torch.tensor([[200 + 10 * (r // D) + r % D] * H for r in range(kv_heads * D)], dtype=torch.float32)
    v = torch.tensor([[300 + 10 * (r // D) + r % D] * H for r in range(kv_heads * D)], dtype=torch.float32)
    # Megatron: per query group g, the 3 query heads 3g..3g+2, then k head g, then v head g.
    expected_rows = [100, 101, 110, 111, 120, 121, 200, 201, 300, 301,
                     130, 131, 140, 141, 150, 151, 210, 211, 310, 311]
    qkv = interleave_qkv(q, k, v, heads, kv_heads, D)
    assert qkv[:, 0].tolist() == expected_rows
    q2, k2, v2 = split_qkv(qkv, heads, kv_heads, D)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)
    with pytest.raises(ValueError, match="rows"):
        split_qkv(qkv[:-1], heads, kv_heads, D)
    with pytest.raises(ValueError, match="shape"):
        interleave_qkv(q[:-1], k, v, heads, kv_heads, D)


@pytest.mark.parametrize("spec", ["te", "local"])
@pytest.mark.parametrize("experts", ["sequential", "te_grouped"])
@pytest.mark.parametrize("tie", [False, True])
def test_state_dict_round_trip_bitwise(spec, experts, tie):
    cfg = _cfg(tie_embeddings=tie)
    model = build_model(cfg, seed=3)
    ours = model.state_dict()
    mc = to_mcore_state_dict(ours, cfg.model, spec, experts)
    assert ("output_layer.weight" in mc) == (not tie)
    if spec == "te":
        assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in mc
        assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in mc  # dense layer: fused into fc1
        assert "decoder.layers.1.pre_mlp_layernorm.weight" in mc  # MoE layer: a separate norm
    else:
        assert "decoder.layers.1.input_layernorm.weight" in mc and "decoder.layers.0.pre_mlp_layernorm.weight" in mc
    fc1 = ("decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight" if experts == "sequential"
           else "decoder.layers.2.mlp.experts.linear_fc1.weight3")
    assert torch.equal(mc[fc1], ours["layers.2.mlp.experts.w13"][3])
    F_ = cfg.model.dense_ffn_hidden_size
    fc1_dense = mc["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1_dense[:F_], ours["layers.0.mlp.gate_proj.weight"])  # gate first, then up
    back = from_mcore_state_dict(mc, cfg.model, spec, experts)
    assert set(back) == set(ours)
    for key in ours:
        # bitwise: compare the fp32 bit patterns (torch.equal alone would let -0.0 == 0.0 pass)
        assert back[key].dtype == ours[key].dtype == torch.float32, key
        assert torch.equal(back[key].contiguous().view(torch.int32), ours[key].contiguous().view(torch.int32)), key
    fresh = build_model(cfg, seed=4)
    fresh.load_state_dict(back, strict=True)
    # extra_state entries are ignored; a missing or stray weight is an error
    mc_extra = dict(mc, **{"decoder.layers.1.self_attention.linear_qkv._extra_state": None})
    assert set(from_mcore_state_dict(mc_extra, cfg.model, spec, experts)) == set(ours)
    with pytest.raises(ValueError, match="lacks"):
        from_mcore_state_dict({k: v for k, v in mc.items() if k != fc1}, cfg.model, spec, experts)
    with pytest.raises(ValueError, match="does not explain"):
        from_mcore_state_dict(dict(mc, stray=torch.zeros(1)), cfg.model, spec, experts)
    with pytest.raises(ValueError, match="no Megatron-Core name"):
        to_mcore_state_dict(dict(ours, stray=torch.zeros(1)), cfg.model, spec, experts)


def test_bad_layout_names():
    cfg = _cfg()
    with pytest.raises(ValueError, match="spec="):
        to_mcore_state_dict({}, cfg.model, spec="transformer_engine")
    with pytest.raises(ValueError, match="experts="):
        from_mcore_state_dict({}, cfg.model, experts="grouped")


_GPT_SCRIPT = textwrap.dedent("""
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = sys.argv[1]
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron_fp4.config import Config
    from megatron_fp4.integrations.megatron_core import (build_transformer_config, from_mcore_state_dict,
                                                         split_megatron_kwargs, to_mcore_state_dict,
                                                         to_megatron_transformer_config)
    from megatron_fp4.model import build_model
    family = sys.argv[2] if len(sys.argv) > 2 else "qwen3_moe"
    if family == "qwen3_moe":
        cfg = Config()
        cfg.model.num_layers, cfg.model.dense_layers, cfg.model.num_shared_experts = 3, [0], 1
    else:  # tests/unit/test_megatron_core_families.py's configs
        from tests.unit.test_megatron_core_families import _cfg
        cfg = _cfg(family)
        # Megatron-Core creates the sinks (softmax_offset) and YaRN tables on the current CUDA device
        torch.cuda.current_device = lambda: "cpu"
    # allgather: the alltoall dispatcher allocates CUDA streams at construction
    tc = build_transformer_config(cfg, use_cpu_initialization=True, moe_token_dispatcher_type="allgather")
    _, gpt_kwargs = split_megatron_kwargs(to_megatron_transformer_config(cfg))
    gpt = GPTModel(config=tc, transformer_layer_spec=get_gpt_decoder_block_spec(tc, use_transformer_engine=False),
                   **gpt_kwargs)
    ours = build_model(cfg, seed=7)
    mc = to_mcore_state_dict(ours.state_dict(), cfg.model, spec="local")
    ref = {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    result = {"missing": sorted(set(ref) - set(mc)), "unexpected": sorted(set(mc) - set(ref)),
              "shape_mismatch": sorted(k for k in ref if k in mc and tuple(ref[k].shape) != tuple(mc[k].shape))}
    incompatible = gpt.load_state_dict(mc, strict=False)
    result["load_missing"] = [k for k in incompatible.missing_keys if not k.endswith("_extra_state")]
    back = from_mcore_state_dict(gpt.state_dict(), cfg.model, spec="local")
    src = ours.state_dict()
    result["bitwise"] = all(torch.equal(back[k], src[k]) for k in src) and set(back) == set(src)
    print("RESULT " + json.dumps(result))
""")


def run_result_script(path, source: str, base_port: int, args: tuple = ()) -> dict:
    """Run `source` as a fresh CPU-only Python process (megatron-core initialises torch.distributed
    and CUDA state globally) with a master port argument (then `args`); return the JSON of its last
    RESULT line."""
    path.write_text(source)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUDA_VISIBLE_DEVICES="")
    port = str(base_port + os.getpid() % 500)
    proc = subprocess.run([sys.executable, str(path), port, *args], capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_names_match_a_real_megatron_gpt_model(tmp_path):
    """Build Megatron-Core's GPTModel (local spec) on CPU: our names/shapes are exactly its state
    dict, it loads them strictly, and reading its state dict back gives our tensors bitwise."""
    result = run_result_script(tmp_path / "build_gpt.py", _GPT_SCRIPT, base_port=29400)
    assert result == {"missing": [], "unexpected": [], "shape_mismatch": [], "load_missing": [], "bitwise": True}
