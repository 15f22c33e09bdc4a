"""Stochastic-rounding streams: one per (recipe seed, layer, step, micro-batch, operand).

The statistical test derives its threshold from the variance of stochastic rounding: an element
``a`` between E2M1 grid points ``lo`` and ``lo + step`` rounds up with probability
``p = (a − lo) / step``, so one draw has variance ``p(1 − p)·step²`` and the mean of ``n``
independent draws has variance ``p(1 − p)·step² / n``.
"""
from __future__ import annotations

import pytest
import torch

import megatron_fp4.fp4.moeresq as moeresq
from megatron_fp4.fp4 import MoEResQLinear, Numerics, OperandFormat, Recipe, fake_quantize, name_quant_sites, sr_seed
from megatron_fp4.parallel.pipeline import BackwardInMicroBatch

SR = Recipe(mode="fp4", grad_output=OperandFormat(rounding="stochastic"))
D = 64
NUM = Numerics()  # the layers' numerics (each test's layers share it, as a model's modules do)
training_step, micro_batch = NUM.training_step, NUM.micro_batch


def block_max_grad(tokens: int, seed: int = 0) -> torch.Tensor:
    """dY in (−6, 6) with a ±6 in every 16-element block: every block and row amax is 6, so the
    NVFP4 scales are 1 (up to one fp32 ulp) and the scaled values are dY itself."""
    g = torch.Generator().manual_seed(seed)
    dy = (torch.rand(tokens, D, generator=g) * 12 - 6).clamp(-5.99, 5.99)
    sign = torch.where(torch.rand(tokens, D // 16, generator=g) < 0.5, -1.0, 1.0)
    dy.view(tokens, D // 16, 16)[..., 0] = 6.0 * sign
    return dy


def sr_variance(dy: torch.Tensor) -> torch.Tensor:
    """Per-element variance p(1 − p)·step² of one stochastic rounding of |dy| ≤ 6 (float64)."""
    a = dy.double().abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    p = (a - torch.floor(a / step) * step) / step
    return p * (1 - p) * step ** 2


def layer(name: str = "layers.0.mlp.fc") -> MoEResQLinear:
    lin = MoEResQLinear(D, D, recipe=SR, numerics=NUM)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(D, D, generator=torch.Generator().manual_seed(1)) / 8)
    lin.quant_name = name
    return lin


def dgrad(lin: MoEResQLinear, dy: torch.Tensor) -> torch.Tensor:
    x = torch.randn(dy.shape[0], D, generator=torch.Generator().manual_seed(2)).requires_grad_()
    lin(x).backward(dy)
    return x.grad


def test_mean_over_steps_converges_at_the_sr_rate():
    """Mean of dX = Q_SR(dY)·Q(W) over n = 64 steps against the exact dY·Q(W).

    Independent streams: E‖mean − exact‖² = Σ_j Σ_i var_ti · Q(W)_ij² / n. The sum runs over
    64·64 = 4096 terms, so the measured value is within a few percent of that (relative standard
    deviation ≈ √(2/4096) ≈ 2%); 1.5× is many standard errors. A stream reused by every step
    gives the mean of one draw: n = 64 times the bound."""
    n, dy, lin = 64, block_max_grad(64), layer()
    wq = fake_quantize(lin.weight.detach(), SR.weight).double()
    draws = []
    for step in range(n):
        with training_step(step), micro_batch(0):
            draws.append(dgrad(lin, dy).double())
    exact = dy.double() @ wq
    expected = (sr_variance(dy) @ wq.pow(2)).sum() / n
    measured = (torch.stack(draws).mean(0) - exact).pow(2).sum()
    assert measured < 1.5 * expected, (measured / expected).item()
    # and at the 1/√n rate: 16 steps leave ~4x the squared error of 64
    measured16 = (torch.stack(draws[:16]).mean(0) - exact).pow(2).sum()
    assert 2.0 < (measured16 / measured).item() < 8.0


def test_layers_micro_batches_and_operands_draw_different_noise():
    dy = block_max_grad(32)
    with training_step(5):
        with micro_batch(0):
            a, b = dgrad(layer("layers.0.mlp.fc"), dy), dgrad(layer("layers.1.mlp.fc"), dy)
        with micro_batch(1):
            a1 = dgrad(layer("layers.0.mlp.fc"), dy)
        with micro_batch(0):
            again = dgrad(layer("layers.0.mlp.fc"), dy)
    assert not torch.equal(a, b) and not torch.equal(a, a1)
    assert torch.equal(a, again)  # reproducible
    operands = ("weight", "input", "grad_output", "grad_output (columnwise)", "input (columnwise)")
    seeds = {sr_seed(0, f"layers.{i}.fc", s, m, op) for i in range(4) for s in range(4) for m in range(4)
             for op in operands}
    assert len(seeds) == 4 * 4 * 4 * len(operands)
    assert sr_seed(0, "l", 0, 0, "input") != sr_seed(1, "l", 0, 0, "input")  # recipe.seed enters too


def test_same_bits_for_the_same_global_micro_batch_on_any_split():
    """dp: rank r's local micro-batch j is global micro-batch r·m + j; pp: the schedule's chunk id."""
    dy, lin = block_max_grad(32), layer()
    with training_step(3), micro_batch(3):
        single = dgrad(lin, dy)
    with training_step(3, first_micro_batch=2), micro_batch(1):  # dp rank 1 of 2, 2 micro-batches each
        assert NUM.position.micro_batch == 3
        assert torch.equal(dgrad(lin, dy), single)

    class Stage:  # the PipelineStage backward methods a schedule calls, with the chunk id first
        submod = type("Chunk", (), {"numerics": NUM})()  # the stage's module: the model's numerics

        def backward_one_chunk(self, chunk_id, *args, **kwargs):
            return NUM.position.micro_batch

        backward_weight_one_chunk = backward_one_chunk

    class InMicroBatch(BackwardInMicroBatch, Stage):  # as `MicroBatchStage` is over PipelineStage
        pass

    stage = InMicroBatch()
    with training_step(3, first_micro_batch=2):
        assert [stage.backward_one_chunk(j) for j in range(2)] == [2, 3]
        assert stage.backward_weight_one_chunk(1) == 3


def test_backward_keeps_the_forward_micro_batch():
    """Pipeline schedules run a micro-batch's backward later, under another context."""
    dy, lin = block_max_grad(32), layer()
    x = torch.randn(32, D, generator=torch.Generator().manual_seed(2)).requires_grad_()
    with training_step(0):
        with micro_batch(1):
            y = lin(x)
        with micro_batch(0):
            y.backward(dy)
        with micro_batch(1):
            assert torch.equal(dgrad(lin, dy), x.grad)


def test_model_names_are_global_and_experts_keyed_by_global_id(monkeypatch):
    from megatron_fp4.config import Config
    from megatron_fp4.model import build_model

    cfg = Config()
    cfg.model.num_layers = 2
    cfg.fp4.scope, cfg.fp4.grad_rounding = "experts+attention", "stochastic"
    model = build_model(cfg)
    seen = []
    monkeypatch.setattr(moeresq, "sr_seed", lambda *key: seen.append(key) or sr_seed(*key))
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with model.numerics.training_step(7, first_micro_batch=4), model.numerics.micro_batch(1):
        model(tokens).logits.float().pow(2).mean().backward()
    layers = {key[1] for key in seen}
    assert "layers.1.self_attn.q_proj" in layers
    assert any(name.startswith("layers.0.mlp.experts.") and name.endswith(".w13") for name in layers)
    assert {key[2:4] for key in seen} == {(7, 5)}
    assert {key[4] for key in seen} == {"grad_output"} | {"grad_output (columnwise)"}
    experts = model.layers[0].mlp.experts
    experts = experts.shard(4, experts.num_global_experts - 4)  # as expert parallelism builds a rank's block
    seen.clear()
    with model.numerics.training_step(0):
        experts.expert_forward(0, torch.randn(3, cfg.model.hidden_size, requires_grad=True)).sum().backward()
    assert {key[1] for key in seen} == {"layers.0.mlp.experts.4.w13", "layers.0.mlp.experts.4.w2"}
    name_quant_sites(model)  # idempotent
    assert model.layers[0].self_attn.q_proj.quant_name == "layers.0.self_attn.q_proj"


@pytest.mark.parametrize("bad", [dict(step=-1), dict(step=0, first_micro_batch=1.5)])
def test_context_validates(bad):
    with pytest.raises(ValueError, match="must be a non-negative int"):
        training_step(**bad)


def tiny_trainer_cfg():
    """One decoder layer, 2 micro-batches of 2 × 16 tokens (shared with the non-finite tests)."""
    from megatron_fp4.config import Config

    cfg = Config()
    cfg.model.num_layers = 1
    s = cfg.schedule
    s.global_batch_size, s.micro_batch_size, s.seq_len = 4, 2, 16
    cfg.data.num_samples = 40
    cfg.logging.tensorboard_dir, cfg.logging.progress = None, False
    return cfg


def test_resumed_run_draws_the_uninterrupted_streams(tmp_path):
    """Seeds come from the trainer's step (restored from the checkpoint), not a process counter."""
    from megatron_fp4.training.trainer import Trainer

    cfg = tiny_trainer_cfg()
    cfg.fp4.grad_rounding = "stochastic"
    straight = Trainer(cfg)
    losses = [straight.train_step()["loss"] for _ in range(2)]
    first = Trainer(cfg)
    first.train_step()
    first.save_checkpoint(str(tmp_path))  # DCP, one process
    resumed = Trainer(cfg)
    assert resumed.load_checkpoint(str(tmp_path)) == 1
    assert resumed.train_step()["loss"] == losses[1]
    assert all(torch.equal(p, q) for p, q in zip(resumed.model.parameters(), straight.model.parameters()))
