"""Weights' quantization / exact-GEMM splits cached per weight version (`Numerics.cached_weights`):
the same bits as recomputing them, computed once, recomputed after an in-place update."""
import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.fp4 import Numerics, Recipe, moeresq_linear
from megatron_fp4.fp4 import exact_gemm, moeresq
from megatron_fp4.model import build_model
from megatron_fp4.rollout import RolloutEngine, SamplingParams


def _bits(t):
    return t.contiguous().view(torch.int32)


def _count(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("invariant_on", [False, True])
def test_weight_derived_terms_computed_once_and_refreshed_after_in_place_update(monkeypatch, invariant_on):
    torch.manual_seed(0)
    w = torch.randn(2, 32, 32)
    x = torch.randn(5, 32)
    recipe = Recipe(mode="fp4_resq")
    fp4_calls = _count(monkeypatch, moeresq, "split_fp4" if invariant_on else "resq_quantize")
    limb_calls = _count(monkeypatch, exact_gemm, "_fixed_point_limbs")
    num = Numerics(invariance="exact" if invariant_on else "standard")

    def lin(weight):  # exact_linear with the numerics' weight cache, as invariant.linear calls it
        return exact_gemm.exact_linear(x, weight, None, num.weight_cache)
    with torch.no_grad():
        fresh = moeresq_linear(x, w[1], recipe=recipe, numerics=num)
        fresh_lin = lin(w[1])
        n_fp4, n_limbs = len(fp4_calls), len(limb_calls)
        with num.cached_weights():
            ys = [moeresq_linear(x, w[1], recipe=recipe, numerics=num) for _ in range(3)]
            lins = [lin(w[1]) for _ in range(3)]
            # 1 weight + 1 input quantization (2 input splits when invariant) the first time, then inputs only
            per_x = 2 if invariant_on else 1
            assert len(fp4_calls) - n_fp4 == (1 + per_x) + 2 * per_x
            assert len(limb_calls) - n_limbs == 2 + 2  # weight once, input every call
            w.mul_(0.5)  # in place on the base: the view's version moves too
            after = moeresq_linear(x, w[1], recipe=recipe, numerics=num)
            after_lin = lin(w[1])
        expect_after = moeresq_linear(x, w[1], recipe=recipe, numerics=num)
        expect_after_lin = lin(w[1])
    for y in ys:
        assert torch.equal(_bits(y), _bits(fresh))
    for y in lins:
        assert torch.equal(_bits(y), _bits(fresh_lin))
    assert torch.equal(_bits(after), _bits(expect_after)) and not torch.equal(after, fresh)
    assert torch.equal(_bits(after_lin), _bits(expect_after_lin))


@pytest.mark.parametrize("mode,scope,bi", [("fp4_resq", "experts", True), ("fp4_resq", "experts+attention", False),
                                           ("fp4", "experts+attention", True)])
def test_rollout_generation_bitwise_equal_with_and_without_cache(mode, scope, bi):
    cfg = Config()
    cfg.model.vocab_size, cfg.model.num_layers, cfg.fp4.scope = 40, 2, scope
    prompts = [[1, 5, 7, 9], [2, 3], [4, 4, 4, 8, 30]]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    outs = [RolloutEngine(build_model(cfg, seed=1), mode=mode, invariance="exact" if bi else "standard", cache_quantized_weights=c)
            .generate(prompts, params, return_distributions=True) for c in (False, True)]
    assert outs[0].response_ids == outs[1].response_ids
    for a, b in zip(outs[0].distributions, outs[1].distributions):
        assert torch.equal(_bits(a), _bits(b))
