"""Activation recomputation (model/recompute.py): full and selective recompute give the gradients of
recompute=none bit for bit, and hold less activation memory.

Bitwise holds by construction: the recompute runs the same ops on the same inputs (the same FP4
quantization streams, seeded from the forward's step context), and the backward runs the same
kernels on the same saved values. FP4 MoEResQ is on for experts and attention, with stochastic
rounding on every operand (input, weight, grad output), so a recompute drawing other noise than
its forward would change the gradients.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_fp4.config import Config, ConfigError
from megatron_fp4.config.choices import RECOMPUTE_MODULES
from megatron_fp4.fp4 import Recipe
from megatron_fp4.model import recompute
from megatron_fp4.model.layers import KVCache
from megatron_fp4.model.transformer import build_model, lm_loss

MODES = {
    "full": dict(recompute="full"),
    "full_every_2": dict(recompute="full", recompute_num_layers=2),
    "selective": dict(recompute="selective"),
    "selective_moe": dict(recompute="selective", recompute_modules=["moe", "attention", "experts"]),
}


def tiny_cfg(**model) -> Config:
    cfg = Config()
    cfg.model.num_layers, cfg.model.dense_layers, cfg.model.num_shared_experts = 3, [0], 1
    cfg.fp4.scope, cfg.fp4.grad_rounding = "experts+attention", "stochastic"
    for key, value in model.items():
        setattr(cfg.model, key, value)
    return cfg.validate()


def stochastic_everywhere(model) -> None:
    for m in model.modules():
        r = getattr(m, "recipe", None)
        if isinstance(r, Recipe) and r.mode != "bf16":
            m.recipe = dataclasses.replace(r, input=dataclasses.replace(r.input, rounding="stochastic"),
                                           weight=dataclasses.replace(r.weight, rounding="stochastic"))


def run(model_cfg: dict, backward_in_micro_batch: bool = True):
    """Two micro-batches of step 5 (aux losses, routing and MoE statistics recorded); returns the
    gradients, the routing, the statistics count and the activation bytes held after forward 0."""
    model = build_model(tiny_cfg(**model_cfg), seed=7)
    stochastic_everywhere(model)
    model.train()
    model.set_record_stats(True)
    model.set_aux_loss_scale(0.5)
    tokens = torch.randint(0, 32, (2, 2, 16), generator=torch.Generator().manual_seed(3))
    routing, held = [], []
    with model.numerics.training_step(5, first_micro_batch=2):
        for i in range(2):
            with model.numerics.micro_batch(i):
                out, nbytes = recompute.held_activation_bytes(lambda: model(tokens[i], return_routing=True))
                loss = lm_loss(out.logits[:, :-1], tokens[i, :, 1:]) / 2
                if backward_in_micro_batch:
                    loss.backward()
            if not backward_in_micro_batch:  # backward outside the micro-batch's FP4 context
                loss.backward()
            routing.append(out.routing)
            held.append(nbytes)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, routing, [len(moe.stats) for moe in model.moe_layers()], held[0]


@pytest.fixture(scope="module")
def reference():
    return run({})


@pytest.mark.parametrize("name", list(MODES))
def test_equal_gradients_and_less_activation_memory(reference, name):
    ref_grads, ref_routing, ref_stats, ref_held = reference
    grads, routing, stats, held = run(MODES[name])
    assert grads.keys() == ref_grads.keys()
    unequal = [n for n in grads if not torch.equal(grads[n], ref_grads[n])]
    assert not unequal, f"{name}: gradients differ from recompute=none in {unequal}"
    # side effects once: one routing entry per layer per forward, one statistics record per MoE forward
    assert [[None if r is None else r.tolist() for r in mb] for mb in routing] == \
        [[None if r is None else r.tolist() for r in mb] for mb in ref_routing]
    assert stats == ref_stats == [2, 2]
    assert held < 0.9 * ref_held, f"{name}: {held} activation bytes held vs {ref_held} without recompute"


def test_recompute_draws_the_forward_streams_outside_its_context(reference):
    """Backward after the micro-batch's FP4 context closed: the recompute still quantizes with the
    forward's (step, micro-batch) streams, not with micro-batch 0's."""
    ref_grads = run({}, backward_in_micro_batch=False)[0]
    assert all(torch.equal(a, b) for a, b in zip(ref_grads.values(), reference[0].values()))
    for name in ("full", "selective"):
        grads = run(MODES[name], backward_in_micro_batch=False)[0]
        assert all(torch.equal(grads[n], ref_grads[n]) for n in grads), name


def test_selective_keeps_gemm_outputs_full_keeps_less():
    """Full keeps only block inputs; selective also keeps GEMM outputs: in between the two."""
    held = {name: run(spec)[3] for name, spec in (("none", {}), ("full", MODES["full"]),
                                                   ("selective", MODES["selective"]))}
    assert held["full"] < held["selective"] < held["none"], held


def test_generation_and_no_grad_scoring_run_without_checkpoints():
    base = build_model(tiny_cfg(), seed=7).eval()
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    for spec in MODES.values():
        model = build_model(tiny_cfg(**spec), seed=7).eval()
        with torch.no_grad():
            assert torch.equal(model(tokens).logits, base(tokens).logits)
            cache, ref_cache = KVCache.empty(3), KVCache.empty(3)
            assert torch.equal(model(tokens, kv_cache=cache).logits, base(tokens, kv_cache=ref_cache).logits)
        assert cache.length == 8


@pytest.mark.parametrize("field,value,needle", [
    ("recompute", "partial", "model.recompute='partial'"),
    ("recompute_num_layers", 0, "model.recompute_num_layers=0"),
    ("recompute_modules", ["attention", "core_attn"], "model.recompute_modules="),
    ("recompute_modules", [], "model.recompute_modules=.*at least one module"),
])
def test_bad_recompute_config_names_the_field(field, value, needle):
    cfg = Config()
    cfg.model.recompute = "selective"
    setattr(cfg.model, field, value)
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
        cfg.validate()


def test_every_recompute_module_the_config_allows_has_a_target():
    from megatron_fp4.model.transformer import SELECTIVE_TARGETS

    assert tuple(SELECTIVE_TARGETS) == RECOMPUTE_MODULES


def test_split_backward_recomputes_in_each_pass():
    """Zero-bubble schedules: an input-grad pass (`autograd.grad` w.r.t. the stage input, graph
    kept), then a weight-grad pass; each recomputes, and both give recompute=none's gradients."""
    def two_passes(spec):
        model = build_model(tiny_cfg(**spec), seed=7)
        stochastic_everywhere(model)
        model.train()
        h0 = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2)).requires_grad_()
        positions = model.default_positions(h0)
        with model.numerics.training_step(1):
            out = model.head(model.run_layers(h0, positions, layers=range(1, 3)))
            (dh,) = torch.autograd.grad(out.square().mean(), h0, retain_graph=True)
            params = [p for p in model.layers[1:].parameters()]
            dw = torch.autograd.grad(out.square().mean(), params, allow_unused=True)
        return dh, dw

    ref_dh, ref_dw = two_passes({})
    for name in ("full", "selective", "selective_moe"):
        dh, dw = two_passes(MODES[name])
        assert torch.equal(dh, ref_dh), name
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(dw, ref_dw)), name


def test_trainer_steps_equal_with_weight_cache_and_gate():
    """Through the trainer's step: the per-step Q(W) cache, the NaN gate's layer hooks, the aux-loss
    scale and the optimizer; two steps give recompute=none's losses and weights bit for bit."""
    from megatron_fp4.training.trainer import Trainer

    def train(spec):
        cfg = tiny_cfg(**spec)
        cfg.model.num_layers, cfg.model.dense_layers = 2, []
        s = cfg.schedule
        s.global_batch_size, s.micro_batch_size, s.seq_len, s.train_steps, s.warmup_steps = 4, 2, 16, 2, 0
        cfg.data.num_samples = 20
        cfg.logging.tensorboard_dir, cfg.logging.progress, cfg.checkpoint.dir = None, False, None
        trainer = Trainer(cfg)
        losses = [trainer.train_step()["loss"] for _ in range(2)]
        return losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    ref_losses, ref_params = train({})
    for name in ("full", "selective"):
        losses, params = train(MODES[name])
        assert losses == ref_losses, name
        assert all(torch.equal(params[n], ref_params[n]) for n in params), name


def test_a_deep_copy_after_selective_steps_runs_its_own_weights():
    """The rollout engine deep-copies the trained model: no recompute wrapper may be left on it that
    calls back into the original modules."""
    import copy

    model = build_model(tiny_cfg(**MODES["selective_moe"]), seed=7).train()
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    model(tokens).logits.sum().backward()
    clone = copy.deepcopy(model)
    before = clone(tokens).logits.detach()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert torch.equal(clone(tokens).logits.detach(), before)
