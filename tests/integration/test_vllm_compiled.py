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


def with_numerics(cfg, batch_invariant):
    cfg.numerics.batch_invariant = batch_invariant
    return cfg


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("batch_invariant", [True, False], ids=["batch_invariant", "standard_kernels"])
@pytest.mark.parametrize("scope", ["experts+attention", "experts"])
def test_compiled_engine_serves_the_eager_engines_bits(tmp_path, scope, batch_invariant):
    hf = write_hf(tmp_path, with_numerics(tiny_cfg(scope), batch_invariant))
    eager = vllm_generate(hf, tmp_path)
    compiled = vllm_generate(hf, tmp_path, enforce_eager=False)
    assert compiled["plugin"] and compiled["compiled"] and not eager["compiled"]
    assert all(len(t) == MAX_TOKENS for t in tokens(compiled))
    assert tokens(compiled) == tokens(eager)
    assert logprobs(compiled) == logprobs(eager)
    assert routing(compiled) == routing(eager)


@needs_vllm
@pytest.mark.slow
def test_live_update_of_a_compiled_engine_serves_a_fresh_engines_bits(tmp_path):
    cfg = tiny_cfg("experts+attention")
    a, b = write_hf(tmp_path / "a", cfg), write_hf(tmp_path / "b", cfg, seed=1)
    fresh = vllm_generate(b, tmp_path)  # eager: the compiled engine's bits (the test above)
    updated = vllm_generate(a, tmp_path, update_from=b, enforce_eager=False)
    assert tokens(updated) == tokens(fresh)
    assert logprobs(updated) == logprobs(fresh)
    assert routing(updated) == routing(fresh)
