"""Issue 36, rows on numbers: an Optional[float] field converted like a float one (`abc`, `[1.5]`,
`{a: 1}`, `true` used to pass as they were and end in a TypeError or as 1.0; YAML's `1e-3` string is
a number); every float that becomes a size, a count or a time is bounded (`1e300` used to end in an
OverflowError in the first forward or in timedelta on every rank); the router bias update rate is
bounded, and the NaN guard checks the saved buffers (expert_bias) as well as the parameters.
"""
import pytest
import torch

from megatron_fp4.config import ConfigError, load_config
from megatron_fp4.training.checkpoint import directory as ckpt
from megatron_fp4.training.trainer import NonFiniteError, Trainer
from tests.faults.test_bad_input_config import SMALL, _assert_one_line, _run
from tests.faults.test_nan_guard_single import tiny

pytestmark = pytest.mark.faults


@pytest.mark.parametrize("value, needle", [
    ("abc", "model.moe_capacity_factor='abc': expected float or null"),
    ("[1.5]", r"model.moe_capacity_factor=[1.5]: expected float or null"),
    ("{a: 1}", "model.moe_capacity_factor={'a': 1}: expected float or null"),
    ("true", "model.moe_capacity_factor='true': expected float or null"),
    ("1e300", "model.moe_capacity_factor=1e+300: must be in (0, model.num_experts=8]"),
    ("0", "model.moe_capacity_factor=0.0: must be in (0, model.num_experts=8]"),
])
def test_capacity_factor_is_converted_and_bounded(value, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"model.moe_capacity_factor={value}"]).validate()
    assert str(err.value).startswith(needle), str(err.value)


def test_optional_float_takes_every_number_spelling():
    for text, value in (("1e-3", 1e-3), ("1.25", 1.25), ("2", 2.0), ("null", None)):
        cfg = load_config(None, [f"model.moe_capacity_factor={text}"]).validate()
        assert cfg.model.moe_capacity_factor == value and type(cfg.model.moe_capacity_factor) is type(value)


@pytest.mark.parametrize("override, needle", [
    ("parallel.timeout_s=1e300", "parallel.timeout_s=1e+300: must be in (0, 604800] seconds"),
    ("parallel.timeout_s=0", "parallel.timeout_s=0.0: must be in (0, 604800] seconds"),
    ("parallel.bucket_size_mb=1e300", "parallel.bucket_size_mb=1e+300: must be in (0, 1048576] MiB"),
    ("model.moe_router_bias_update_rate=1e300", "model.moe_router_bias_update_rate=1e+300: must be in [0, 1]"),
    ("model.moe_router_bias_update_rate=-0.1", "model.moe_router_bias_update_rate=-0.1: must be in [0, 1]"),
])
def test_floats_that_become_times_sizes_or_steps_are_bounded(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override]).validate()
    assert str(err.value).startswith(needle), str(err.value)


def test_cli_refuses_a_huge_timeout_and_capacity_in_one_line():
    for override, field in (("parallel.timeout_s=1e300", "parallel.timeout_s"),
                            ("model.moe_capacity_factor=1e300", "model.moe_capacity_factor")):
        _assert_one_line(_run(*SMALL, "--set", override), "config error", field)


def test_a_non_finite_expert_bias_is_caught_by_the_guard_and_never_saved(tmp_path):
    """A rate the validation refuses, forced past it: the bias update (fp32, outside the optimizer)
    overflows; the step stops naming the buffer, and the save is refused. It used to save inf/nan."""
    trainer = Trainer(tiny(tmp_path, "model.moe_router_bias_update_rate=0.001"))
    assert not trainer.train_step()["skipped"]  # a sane rate: the guard passes
    for m in trainer.model.moe_layers():
        m.bias_update_rate = 1e300  # inf once added to the fp32 bias
    with pytest.raises(NonFiniteError, match=r"step 1: .*router bias update made weights non-finite \(here: "
                                             r"layers\.0\.mlp\.router\.expert_bias\).*moe_router_bias_update_rate"):
        trainer.train_step()
    assert not bool(torch.isfinite(trainer.model.layers[0].mlp.router.expert_bias).all())
    with pytest.raises(NonFiniteError, match=r"refusing to save step 1 .*\(here: layers\.0\.mlp\.router\.expert_bias\)"):
        trainer.save_checkpoint(str(tmp_path / "ckpt"))
    assert ckpt.latest_step(tmp_path / "ckpt") is None
