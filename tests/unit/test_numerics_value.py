"""Numerics as a value (issue 24): what a GEMM computes is the model's ``fp4.Numerics``, passed down
at build time and to the fp4 functions explicitly. No ContextVar, process-global mode or
environment variable read after config load decides it, so two models in one process compute
their own numerics."""
from __future__ import annotations

import copy

import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.fp4 import STANDARD, Numerics, apply_numerics
from megatron_fp4.model import build_model
from megatron_fp4.model.specs import numerics_from_config


def _cfg(**fp4):
    cfg = Config()
    cfg.model.vocab_size, cfg.model.num_layers = 64, 2
    cfg.fp4.scope = "experts+attention"
    for key, value in fp4.items():
        setattr(cfg.fp4, key, value)
    return cfg


def _tokens():
    return torch.randint(1, 64, (3, 12), generator=torch.Generator().manual_seed(0))


def test_two_models_compute_their_own_batch_invariance():
    """Same weights, different Numerics: each model computes its own (a process-global mode would
    give both the same bits)."""
    a, b = build_model(_cfg(), seed=1).eval(), build_model(_cfg(), seed=1).eval()
    apply_numerics(a, Numerics(invariance="exact"))
    tokens = _tokens()
    with torch.no_grad():
        ya, yb = a(tokens).logits, b(tokens).logits
        assert not torch.equal(ya, yb)  # the exact GEMMs round differently from the standard ones
        apply_numerics(b, Numerics(invariance="exact"))  # b alone rebuilt at exact: a is untouched
        assert torch.equal(b(tokens).logits, ya)
        assert torch.equal(a(tokens).logits, ya)
        apply_numerics(a, Numerics(invariance="standard"))
        assert torch.equal(a(tokens).logits, yb) and not torch.equal(b(tokens).logits, yb)


def test_the_level_is_fixed_when_the_numerics_are_built():
    """No block or assignment switches a model's level (design rule 6): it is set once, at build."""
    numerics = Numerics(invariance="batch")
    with pytest.raises(ValueError, match="fixed when the numerics are built"):
        numerics.invariance = "standard"
    assert numerics.invariance == "batch" and not hasattr(numerics, "invariant")
    with pytest.raises(ValueError, match="Numerics.triton is fixed when the numerics are built"):
        numerics.triton = "off"  # the kernels decide bits on CUDA: fixed at build as the level
    with numerics.cached_weights():  # a change that keeps the bits still opens a block
        assert numerics.invariance == "batch" and numerics.triton == "auto" and numerics.weight_cache == {}
    assert numerics.weight_cache is None and not hasattr(numerics, "portable")



def test_the_compiled_backend_is_a_field_of_the_numerics(monkeypatch):
    """The compiled fake-quant backend is the model's ``Numerics.kernels``, given at build (and kept
    by the rollout copy's numerics): a model's FP4 ops count their work towards its own store only,
    and a bare quantizer call, which names none, is the eager reference (nothing installed decides)."""
    from megatron_fp4.fp4 import fused, nvfp4, rollout_numerics

    monkeypatch.setattr(fused, "AUTO_MIN_ELEMENTS", 1 << 40)  # auto: count the eager work, never compile
    own = fused.CompiledKernels()
    model = build_model(_cfg(), seed=1).eval()
    numerics = apply_numerics(model, Numerics(kernels=own))
    assert rollout_numerics(numerics, "batch").kernels is own
    with torch.no_grad():
        model(_tokens())
    assert own.variants and all(v.seen > 0 for v in own.variants.values())
    assert not fused.PROCESS.variants  # the process's store saw none of it
    x = torch.randn(8, 64)
    bare = nvfp4.fake_quantize_nvfp4(x, compile="on")
    assert torch.equal(bare, nvfp4.fake_quantize_nvfp4(x, compile="off")) and not fused.PROCESS.variants


def test_two_models_draw_their_own_stochastic_rounding_streams():
    """Each model's step position keys its SR streams: a step opened on one model does not move the
    other's (a process-global step context, the innermost winning, would)."""
    def grads(model):
        model.zero_grad(set_to_none=True)
        model(_tokens()).logits.float().pow(2).mean().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    cfg = _cfg(grad_rounding="stochastic")
    a, b = build_model(cfg, seed=1), build_model(cfg, seed=1)
    assert a.numerics is not b.numerics
    with a.numerics.training_step(3), a.numerics.micro_batch(1):
        alone = grads(a)
    with a.numerics.training_step(3), a.numerics.micro_batch(1), b.numerics.training_step(5):
        assert a.numerics.position.micro_batch == 1 and b.numerics.position.micro_batch == 0
        nested = grads(a)
        other = grads(b)
    assert all(torch.equal(x, y) for x, y in zip(nested, alone))
    assert not all(torch.equal(x, y) for x, y in zip(other, alone))  # step 5, micro-batch 0: other draws
    with b.numerics.training_step(3), b.numerics.micro_batch(1):
        assert all(torch.equal(x, y) for x, y in zip(grads(b), alone))  # same weights, same position


def test_standard_numerics_cannot_change_and_every_layer_shares_the_models():
    with pytest.raises(ValueError, match="STANDARD numerics cannot be changed"):
        STANDARD.cached_weights()
    with pytest.raises(ValueError, match="fixed when the numerics are built"):
        STANDARD.invariance = "batch"
    assert copy.deepcopy(STANDARD) is STANDARD and STANDARD.invariance == "standard"
    model = build_model(_cfg(), seed=0)
    holders = [m for m in model.modules() if hasattr(m, "numerics")]
    assert len(holders) > 10 and all(m.numerics is model.numerics for m in holders)
    with pytest.raises(ValueError, match="triton='fast'"):
        Numerics(triton="fast")


def test_trainer_and_rollout_numerics_come_from_the_config():
    from megatron_fp4.training.trainer import Trainer

    cfg = _cfg(triton="off")
    cfg.model.num_layers = 1
    cfg.schedule.global_batch_size, cfg.schedule.micro_batch_size, cfg.schedule.seq_len = 2, 2, 8
    cfg.data.num_samples, cfg.logging.tensorboard_dir, cfg.logging.progress = 8, None, False
    numerics = Trainer(cfg).model.numerics
    # the trainer's model at the config's level (default batch): its scoring and training forward alike
    assert (numerics.mode, numerics.triton, numerics.invariance) == ("train", "off", cfg.numerics.invariance)
    assert cfg.numerics.invariance == "batch"
    assert build_model(cfg, seed=0).numerics.triton == "off"  # any build honours the config's backend
    rollout = numerics_from_config(cfg, "rollout")
    assert (rollout.mode, rollout.invariance) == ("rollout", cfg.numerics.invariance)
