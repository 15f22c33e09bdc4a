"""Deferred non-finite checks: no host sync per quantization, one check per step naming the tensor.

A host sync is counted at the Python level: every way a tensor value reaches Python
(``bool``, ``item``, ``int``, ``float``, ``tolist``) is wrapped with a counter. On a GPU each of
those waits for the stream; on the CPU they are the same calls, so the count is device-agnostic.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch

from megatron_fp4.fp4 import MoEResQLinear, NonFiniteInputError, Numerics, Recipe

NUM = Numerics()  # the test layers' numerics
training_step, micro_batch = NUM.training_step, NUM.micro_batch

SYNCS = ("__bool__", "item", "__int__", "__float__", "tolist")


@contextmanager
def count_host_syncs(monkeypatch):
    calls = []
    for attr in SYNCS:
        original = getattr(torch.Tensor, attr)

        def counted(self, *args, _original=original, _attr=attr, **kwargs):
            calls.append(_attr)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, attr, counted)
    try:
        yield calls
    finally:
        monkeypatch.undo()


def layer() -> MoEResQLinear:
    lin = MoEResQLinear(64, 32, bias=True, recipe=Recipe(), numerics=NUM)
    lin.quant_name = "layers.3.mlp.fc1"
    return lin


def step(lin, x):
    x = x.clone().requires_grad_()
    lin(x).backward(torch.ones(x.shape[0], 32))


def accelerator_path(monkeypatch) -> None:
    """Switch off the CPU-only eager sweeps (`formats.Sweep`: they choose between their result and the
    reference's by the input's finiteness on the host, which on CPU waits for no device; a ResQ sweep
    checks its two quantizations at once), so every quantization takes the path a GPU tensor takes."""
    from megatron_fp4.fp4 import mxfp4, nvfp4, resq
    for module, fn in ((nvfp4, "_fake_sweep"), (mxfp4, "_fake_sweep"), (resq, "_resq_sweep")):
        monkeypatch.setattr(module, fn, lambda *args, **kwargs: None)


def test_deferred_mode_has_no_host_sync_per_quantization(monkeypatch):
    lin, x = layer(), torch.randn(24, 64)
    with training_step(0, defer_nonfinite=True) as fp4_step:
        accelerator_path(monkeypatch)  # (count_host_syncs undoes every patch when it ends)
        with count_host_syncs(monkeypatch) as calls:
            for i in range(2):
                with micro_batch(i):
                    step(lin, x)
        assert calls == []  # 2 micro-batches x 7 quantizations, none synced
        assert fp4_step.nonfinite_error() is None
    with training_step(0, defer_nonfinite=False):  # the eager check syncs at every quantization
        accelerator_path(monkeypatch)
        with count_host_syncs(monkeypatch) as calls:
            step(lin, x)
        assert calls.count("__bool__") >= 7


def test_step_end_check_names_the_tensor():
    lin, x = layer(), torch.randn(24, 64)
    bad = x.clone()
    bad[5, 7] = math.nan
    with training_step(0, defer_nonfinite=True) as fp4_step:
        with micro_batch(0):
            step(lin, x)
        assert fp4_step.nonfinite_error() is None
        with micro_batch(1):
            step(lin, bad)  # no raise here: the flag stays on the device
        with pytest.raises(NonFiniteInputError, match=r"tensor 'layers.3.mlp.fc1:input' had non-finite .*other"):
            fp4_step.check_nonfinite()
        assert fp4_step.flags.any_flag().item() == 1.0
    with training_step(1, defer_nonfinite=True) as fp4_step:  # a new step starts clean
        step(lin, x)
        assert fp4_step.nonfinite_error() is None and fp4_step.flags.any_flag().item() == 0.0


def test_cached_weight_still_flags_a_nonfinite_weight_in_every_step():
    """A Q(W) served from the weight cache records the weight's flag again: a cache kept across two
    steps (a new flags object each) still reports a NaN weight in the second step, without quantizing
    the weight again."""
    lin, x = layer(), torch.randn(24, 64)
    with torch.no_grad():
        lin.weight[3, 9] = math.nan
    store: dict = {}
    for s in range(2):
        with NUM.cached_weights(store), training_step(s, defer_nonfinite=True) as fp4_step:
            with micro_batch(0):
                step(lin, x)
            with pytest.raises(NonFiniteInputError, match=r"tensor 'layers.3.mlp.fc1:weight' had non-finite"):
                fp4_step.check_nonfinite()
        assert len(store) == 1  # one cached Q(W), quantized in step 0 only


def test_default_defers_on_accelerators_only():
    lin, bad = layer(), torch.randn(24, 64)
    bad[0, 0] = math.inf
    with training_step(0) as fp4_step:
        assert fp4_step.nonfinite_flags_for(torch.device("cuda")) is fp4_step.flags
        assert fp4_step.nonfinite_flags_for(torch.device("cpu")) is None
        with pytest.raises(NonFiniteInputError, match="'layers.3.mlp.fc1:input' has 1 non-finite"):
            step(lin, bad)  # CPU: eager, raises at the quantization
    assert NUM.position.flags is None  # outside a step: eager everywhere


def test_trainer_reports_deferred_fp4_nonfinite_as_nan_step():
    """The trainer's hook: a deferred flag turns the step into its NaN policy, naming the tensor."""
    from megatron_fp4.training.trainer import Trainer, lm_loss_fn
    from tests.unit.test_fp4_sr_streams import tiny_trainer_cfg

    trainer = Trainer(tiny_trainer_cfg())
    with torch.no_grad():  # NaN before the router/experts: the expert inputs are non-finite
        trainer.model.layers[0].self_attn.o_proj.weight[0, 0] = math.nan
    trainer.gate.reset()
    with trainer.model.numerics.training_step(0, defer_nonfinite=True):
        loss, metrics = trainer.forward_backward(trainer.next_micro_batches(), lm_loss_fn)
    assert math.isnan(loss) and metrics == {}  # metrics stay numeric (they are all-reduced over dp)
    assert "tensor 'layers.0.mlp.experts." in trainer.gate.where
