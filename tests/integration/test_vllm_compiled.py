"""The `megatron_fp4` vLLM plugin under vLLM's torch.compile (plain `vllm.LLM(model=dir)`, no
`enforce_eager`): the same tokens, log-probs and experts as the eager engine, bit for bit.

vLLM on CPU traces the model once with Dynamo and compiles it with inductor. Every numeric piece of
the plugin (its linears, router gate, MoE method, LM head, the trainer's RMSNorm and SiLU, in the
batch-invariant mode its RoPE; its attention runs inside vLLM's own attention op) is one opaque op
(integrations/vllm/opaque.py) running the eager engine's code, and with the standard kernels vLLM's
RoPE runs its own kernel under compile too (`model.keep_kernel`), so what inductor compiles is exact
(the embedding gather, fp32 residual adds): the compiled engine's bits are the eager engine's by
construction, in both modes and both scopes. A live weight update of a compiled engine serves what
a fresh engine on the new weights serves, bitwise (weights are read when each op runs, not baked
into the graph). The old plugin failed here: Dynamo raised `Unsupported function call`
(`SimpleNamespace`) in the plugin's RMSNorm, so every engine start without enforce_eager died.
"""
from __future__ import annotations

import pytest

from tests.integration.test_vllm_plugin import MAX_TOKENS, needs_vllm, tiny_cfg, vllm_generate, write_hf


def tokens(out):
    return [r["tokens"] for r in out["results"]]


def logprobs(out):
    return [r["logprobs"] for r in out["results"]]


def routing(out):
    return [r["routing"] for r in out["results"]]


def with_numerics(cfg, level):
    cfg.numerics.invariance = level
    return cfg


# first: its compiled engine on A, before the update, is the [experts+attention-batch] run below
# (vllm_generate shares identical runs; in another order each starts its own engine)
@needs_vllm
@pytest.mark.slow
def test_live_update_of_a_compiled_engine_serves_a_fresh_engines_bits(tmp_path):
    cfg = tiny_cfg("experts+attention")
    a, b = write_hf(tmp_path / "a", cfg), write_hf(tmp_path / "b", cfg, seed=1)
    fresh = vllm_generate(b, tmp_path)  # eager: the compiled engine's bits (the test below)
    updated = vllm_generate(a, tmp_path, update_from=b, enforce_eager=False)
    assert tokens(updated) == tokens(fresh)
    assert logprobs(updated) == logprobs(fresh)
    assert routing(updated) == routing(fresh)


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("level", ["batch", "standard"])
@pytest.mark.parametrize("scope", ["experts+attention", "experts"])
def test_compiled_engine_serves_the_eager_engines_bits(tmp_path, scope, level):
    hf = write_hf(tmp_path, with_numerics(tiny_cfg(scope), level))
    eager = vllm_generate(hf, tmp_path)
    compiled = vllm_generate(hf, tmp_path, enforce_eager=False)
    assert compiled["plugin"] and compiled["compiled"] and not eager["compiled"]
    assert all(len(t) == MAX_TOKENS for t in tokens(compiled))
    assert tokens(compiled) == tokens(eager)
    assert logprobs(compiled) == logprobs(eager)
    assert routing(compiled) == routing(eager)


# -- fast: the plugin's pieces under torch.compile(fullgraph=True), no engine ---------------------------
@pytest.fixture(scope="module")
def vllm_group():
    """A one-process gloo group for vLLM's parameters (test_vllm_plugin.one_process_group), torn down after."""
    from tests.integration.test_vllm_plugin import one_process_group

    with one_process_group():
        yield


@needs_vllm
@pytest.mark.parametrize("level", ["batch", "exact", "standard"])
def test_plugin_pieces_compile_as_opaque_ops_reading_weights_at_call_time(vllm_group, level):
    """RMSNorm, RoPE, a fused qkv linear, SiLU-and-mul and the router gate of the plugin, traced in one
    graph: Dynamo sees one op per piece (fullgraph: no break), inductor's result is the eager
    pieces' bit for bit, and a weight written in place after compiling is what the graph computes with."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    from megatron_fp4.integrations.vllm.attention import TrainerRotary
    from megatron_fp4.integrations.vllm.opaque import make_layers_opaque
    from megatron_fp4.integrations.vllm.plugin import register
    from megatron_fp4.integrations.vllm.quant import MoEResQLinearMethod, RouterGateMethod
    from tests.integration.test_vllm_plugin import linear_layer, plugin_config

    register()
    qc = plugin_config(tiny_cfg("experts+attention"), level)
    gen = torch.Generator().manual_seed(7)
    config = VllmConfig(quant_config=qc)
    with set_current_vllm_config(config):
        pieces = torch.nn.Module()
        pieces.norm, pieces.act, pieces.rope = RMSNorm(128, eps=1e-6), SiluAndMul(), TrainerRotary(64, 1e4)
        qkv, gate = MoEResQLinearMethod(qc, "model.layers.0.self_attn.qkv_proj"), RouterGateMethod(qc)
        pieces.qkv = linear_layer(qkv, [128, 64, 64], 128, torch.randn(256, 128, generator=gen) * 0.1)
        pieces.gate = linear_layer(gate, [8], 128, torch.randn(8, 128, generator=gen) * 0.1)
    for layer, method in ((pieces.qkv, qkv), (pieces.gate, gate)):
        layer.quant_method = method  # as vLLM's linear layers hold their method
    assert make_layers_opaque(pieces, config) == 5

    def forward(x, positions):
        h = pieces.norm(x)
        qkv = pieces.qkv.quant_method.apply(pieces.qkv, h)
        q, k = pieces.rope(positions, qkv[:, :128], qkv[:, 128:192])
        return q, k, pieces.act(qkv), pieces.gate.quant_method.apply(pieces.gate, h)

    x, positions = torch.randn(11, 128, generator=gen), torch.arange(3, 14)
    compiled = torch.compile(forward, fullgraph=True, backend="inductor")
    with torch.inference_mode():
        for step in range(2):
            want, got = forward(x, positions), compiled(x, positions)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), step
            assert got[3].dtype == torch.float32 and got[2].shape == (11, 128)
            w = pieces.qkv.weight
            w.weight_loader(w, -2 * w.detach().clone())  # vLLM's loader: an in-place copy, Q(W) cache cleared
        with set_current_vllm_config(config):
            loose = RMSNorm(128, eps=1e-6)  # a plugin norm outside the plugin's model class
        with pytest.raises(Exception, match="enforce_eager=True"):
            torch.compile(loose, fullgraph=True, backend="eager")(x)
