"""The trainer derives each weight's Q(W) once per step (`Numerics.cached_weights` around the
step's forward/backward) instead of once per micro-batch: the same losses, gradients and weights
bit for bit, with nearest and with stochastic rounding (an SR weight's stream is keyed by the
micro-batch, so it is still drawn per micro-batch). Also the fast `all_finite` of the NaN guard."""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math

import pytest
import torch

import megatron_fp4.fp4.moeresq as moeresq
from megatron_fp4.fp4 import Recipe
from megatron_fp4.training.nonfinite import all_finite, finite_checked_buffers, finite_checked_state
from megatron_fp4.training.trainer import Trainer


def _cfg(scope: str):
    from megatron_fp4.config import Config

    cfg = Config()
    cfg.model.num_layers, cfg.model.vocab_size = 2, 64
    cfg.fp4.scope, cfg.fp4.train_mode = scope, "fp4_resq"
    s = cfg.schedule
    s.global_batch_size, s.micro_batch_size, s.seq_len = 6, 2, 16  # 3 micro-batches per step
    cfg.data.num_samples = 60
    cfg.logging.tensorboard_dir, cfg.logging.progress, cfg.checkpoint.dir = None, False, None
    return cfg


def _stochastic_weights(model: torch.nn.Module) -> None:
    """Every FP4 weight (and grad output) quantized with stochastic rounding."""
    for m in model.modules():
        r = getattr(m, "recipe", None)
        if isinstance(r, Recipe) and r.mode != "bf16":
            m.recipe = dataclasses.replace(r, weight=dataclasses.replace(r.weight, rounding="stochastic"),
                                           grad_output=dataclasses.replace(r.grad_output, rounding="stochastic"))


def _run(cache: bool, sr: bool, scope: str, monkeypatch, force: bool = False):
    """Two steps; returns (results, grads, params, per-step weight quantization counts by layer).
    ``cache`` False: the reference, each Q(W) derived at every micro-batch (no cache around the step);
    ``force``: the cache even for stochastic weights (which the trainer skips: no reuse)."""
    trainer = Trainer(_cfg(scope))
    if sr:
        _stochastic_weights(trainer.model)
    if not cache:
        monkeypatch.setattr(trainer, "_weight_cache", contextlib.nullcontext)
    elif force:
        monkeypatch.setattr(trainer, "_weight_cache", trainer.model.numerics.cached_weights)
    counts = []
    real = moeresq._Site.quantize

    def counted(site, a, fmt, operand, *args, **kwargs):
        if operand == "weight":
            counts[-1][site.layer] += 1
        return real(site, a, fmt, operand, *args, **kwargs)

    monkeypatch.setattr(moeresq._Site, "quantize", counted)
    results = []
    for _ in range(2):
        counts.append(collections.Counter())
        results.append(trainer.train_step())
    monkeypatch.setattr(moeresq._Site, "quantize", real)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return results, grads, params, counts


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("sr,scope,force", [(False, "experts+attention", False), (True, "experts", False),
                                             (True, "experts", True)])
def test_per_step_weight_cache_same_bits_and_one_quantization_per_step(sr, scope, force, monkeypatch):
    before = _run(False, sr, scope, monkeypatch)
    after = _run(True, sr, scope, monkeypatch, force)
    for r0, r1 in zip(before[0], after[0]):
        assert not r0["skipped"] and math.isfinite(r0["loss"])
        assert {k: v for k, v in r0.items() if k != "tokens_per_s"} == {k: v for k, v in r1.items()
                                                                        if k != "tokens_per_s"}
    for i in (1, 2):  # last step's gradients, weights after both updates
        assert before[i].keys() == after[i].keys() and before[i]
        for name in before[i]:
            assert _same_bits(before[i][name], after[i][name]), name
    for c0, c1 in zip(before[3], after[3]):
        assert c0.keys() == c1.keys() and c0  # the same weights are quantized ...
        if sr:  # ... per micro-batch when their rounding draws per micro-batch
            assert c1 == c0
        else:  # ... once per step instead of once per micro-batch that reaches them
            assert set(c1.values()) == {1} and max(c0.values()) == 3
            if scope == "experts+attention":
                assert all(c0[name] == 3 for name in c0 if ".attn" in name or "proj" in name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_all_finite_matches_isfinite(dtype):
    big = torch.finfo(dtype).max
    cases = [[], [torch.zeros(0, dtype=dtype)], [torch.randn(5, 7).to(dtype), torch.randn(3).to(dtype)],
             [torch.full((4,), big, dtype=dtype)],  # finite, but its sum overflows: the exact fallback
             [torch.tensor([big, -big, big], dtype=dtype)]]
    for bad in (math.nan, math.inf, -math.inf):
        t = torch.randn(64).to(dtype)
        t[17] = bad
        cases.append([torch.ones(3, dtype=dtype), t])
    both = torch.randn(8).to(dtype)
    both[1], both[2] = math.inf, -math.inf  # +inf + -inf: a NaN sum, still non-finite
    cases.append([both])
    for tensors in cases:
        expect = all(bool(torch.isfinite(t).all()) for t in tensors)
        assert all_finite(iter(tensors)) is expect


def test_bench_train_hf_runs_every_runner_with_the_per_expert_loop_trainer(capsys):
    """`bench_train.py --hf --loop-experts` on a tiny model: every runner timed, table printed."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import bench_train

    med = bench_train.main(["--hf", "--steps", "1", "--warmup", "0", "--loop-experts",
                            "--set", "model.num_layers=1", "--set", "model.hidden_size=64",
                            "--set", "model.moe_ffn_hidden_size=64", "--set", "schedule.seq_len=16",
                            "--set", "model.vocab_size=128", "--set", "data.num_samples=40"])
    assert set(med) == {"hf", "trainer bf16", "bare bf16", "trainer fp4_resq", "bare fp4_resq", "trainer fp4_resq/loop"}
    assert all(t > 0 for t in med.values())
    assert "trainer fp4_resq/loop" in capsys.readouterr().out


def test_finite_checked_buffers_are_the_buffers_alone():
    """The post-update check re-reads only what the optimizer did not write (its own pass covered the
    parameters): every floating-point buffer of `finite_checked_state`, no parameter."""
    layer = torch.nn.BatchNorm1d(4)  # float buffers (running stats) beside parameters, an int buffer
    layer.register_buffer("expert_bias", torch.zeros(3))
    buffers = finite_checked_buffers(layer)
    assert set(buffers) == {"running_mean", "running_var", "expert_bias"}
    assert set(finite_checked_state(layer)) == set(buffers) | {"weight", "bias"}
    layer.expert_bias[1] = math.nan  # what the check is for: a NaN in a buffer is seen
    assert not all_finite(finite_checked_buffers(layer).values())


def _accumulated_steps(trainer, monkeypatch, per_call: bool, stale: bool = False):
    """Two steps of two `forward_backward` calls each (accumulate) on fixed micro-batches; returns
    (results, last grads, params, per-step weight quantization counts). ``per_call``: the reference, a
    fresh Q(W) store per call (the layout before the store belonged to the open step); ``stale``: a
    store kept across the optimizer step (what the trainer must not do)."""
    from megatron_fp4.training.step_loss import lm_loss_fn

    kept = {}
    if per_call:
        monkeypatch.setattr(trainer, "_weight_cache", trainer.model.numerics.cached_weights)
    elif stale:
        monkeypatch.setattr(trainer, "_weight_cache", lambda: trainer.model.numerics.cached_weights(kept))
    counts, real = [], moeresq._Site.quantize

    def counted(site, a, fmt, operand, *args, **kwargs):
        if operand == "weight":
            counts[-1][site.layer] += 1
        return real(site, a, fmt, operand, *args, **kwargs)

    monkeypatch.setattr(moeresq._Site, "quantize", counted)
    torch.manual_seed(5)
    batches = [[{"tokens": torch.randint(0, 64, (2, 16)), "labels": torch.randint(0, 64, (2, 16))}] for _ in range(2)]
    results = []
    for _ in range(2):
        counts.append(collections.Counter())
        trainer.zero_grad()
        for mbs in batches:
            trainer.forward_backward(mbs, lm_loss_fn, weights=[0.5], accumulate=True)
        results.append(trainer.apply_update())
    monkeypatch.setattr(moeresq._Site, "quantize", real)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return results, grads, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, counts


def test_a_steps_calls_share_one_weight_store_dropped_by_the_optimizer_step(monkeypatch):
    """The open step's Q(W) store serves every `forward_backward` call of the step (each weight
    quantized once a step, not once a call) with the bits of a store per call; the optimizer step
    drops it. It must: the update writes the weights through the flat master without bumping the
    parameters' version counters (checked here), so a store kept across it serves stale Q(W), which
    changes the second step's loss (the control below: this test can fail)."""
    ref = _accumulated_steps(Trainer(_cfg("experts")), monkeypatch, per_call=True)
    trainer = Trainer(_cfg("experts"))
    w13 = trainer.model.layers[0].mlp.experts.w13
    version, before = w13._version, w13.detach().clone()
    got = _accumulated_steps(trainer, monkeypatch, per_call=False)
    assert not torch.equal(w13.detach(), before) and w13._version == version  # changed, counter not bumped
    for r0, r1 in zip(ref[0], got[0]):
        assert not r0["skipped"] and math.isfinite(r0["loss"])
        assert {k: v for k, v in r0.items() if k != "tokens_per_s"} == {k: v for k, v in r1.items()
                                                                        if k != "tokens_per_s"}
    for i in (1, 2):
        assert ref[i].keys() == got[i].keys() and ref[i]
        assert all(_same_bits(ref[i][n], got[i][n]) for n in ref[i])
    for c_ref, c_got in zip(ref[3], got[3]):
        assert c_ref.keys() == c_got.keys() and c_ref
        assert set(c_ref.values()) == {2} and set(c_got.values()) == {1}  # two calls a step: once, not twice
    stale = _accumulated_steps(Trainer(_cfg("experts")), monkeypatch, per_call=False, stale=True)
    assert stale[0][0]["loss"] == ref[0][0]["loss"] and stale[0][1]["loss"] != ref[0][1]["loss"]
