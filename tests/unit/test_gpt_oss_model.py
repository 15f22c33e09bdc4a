"""GPT-OSS model pieces on their own (HF parity lives in tests/integration/test_gpt_oss_parity.py):
activation recomputation gives the gradients of none bit for bit (the same kernels re-run on the
same inputs), YaRN's tables against a direct evaluation of the YaRN formula, the family registry's errors."""
import math

import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.model import build_model, lm_loss
from megatron_fp4.model.gpt_oss import yarn_inv_freq
from megatron_fp4.model.registry import FAMILIES, get_family


def cfg(**model):
    c = Config()
    m = c.model
    m.family, m.num_layers, m.vocab_size = "gpt_oss", 2, 32
    m.layer_types, m.sliding_window = ["sliding_attention", "full_attention"], 4
    m.rope_scaling = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8}
    c.numerics.invariance, c.fp4.compile = "standard", "off"
    for k, v in model.items():
        setattr(m, k, v)
    return c.validate()


def grads(c):
    model = build_model(c, seed=3).train()
    tokens = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(1))
    lm_loss(model(tokens[:, :-1]).logits, tokens[:, 1:]).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", [dict(recompute="full"),
                                  dict(recompute="selective", recompute_modules=["attention", "experts", "moe"])])
def test_recompute_gives_the_gradients_of_none(mode):
    ref, got = grads(cfg()), grads(cfg(**mode))
    assert ref.keys() == got.keys() and all(g is not None for g in ref.values())
    assert all(torch.equal(ref[n], got[n]) for n in ref), [n for n in ref if not torch.equal(ref[n], got[n])]


def test_yarn_inv_freq_against_the_formula():
    """YaRN (Peng et al. 2023): inv_freq_i = interp_i·(1 − γ_i) + extrap_i·γ_i with γ the linear ramp
    between the correction dims of beta_fast and beta_slow; here in fp64 from the formula, 1e-6 (fp32)."""
    d, theta, factor, orig = 16, 150000.0, 32.0, 4096
    inv, scale = yarn_inv_freq(d, theta, {"factor": factor, "original_max_position_embeddings": orig,
                                          "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False})
    dim = lambda rot: d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
    low, high = max(dim(32.0), 0), min(dim(1.0), d - 1)
    for i in range(d // 2):
        base = theta ** (-2 * i / d)
        gamma = 1 - min(max((i - low) / (high - low), 0), 1)
        want = base / factor * (1 - gamma) + base * gamma
        assert abs(inv[i].item() - want) <= 1e-6 * want
    assert scale == pytest.approx(0.1 * math.log(factor) + 1)


def test_registry_names_every_family():
    assert sorted(FAMILIES) == ["deepseek_v3", "gpt_oss", "qwen3_moe"]
    with pytest.raises(ValueError, match=r"\['qwen3_moe', 'gpt_oss', 'deepseek_v3'\]"):
        get_family("kimi_k2")

