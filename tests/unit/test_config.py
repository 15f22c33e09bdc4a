"""Config loading, overrides and validation errors (each names the field and the fix)."""
import pytest

from megatron_fp4.config import Config, ConfigError, default_config_path, load_config
from megatron_fp4.parallel.dims import ParallelDims


def validate_run(cfg, world_size: int = 1):
    """What the trainer checks: every field, then the layout against the world size."""
    return ParallelDims.from_config(cfg.validate(), world_size)


def test_default_config_loads_and_validates():
    cfg = load_config(default_config_path())
    cfg.validate()
    assert cfg.fp4.train_mode == "fp4_resq" and cfg.fp4.scope == "experts"


def test_dotted_overrides_are_typed():
    cfg = load_config(default_config_path(), ["model.num_layers=2", "fp4.scope=none", "optimizer.lr=1e-3",
                                              "model.dense_layers=[0]", "checkpoint.dir=null"])
    assert cfg.model.num_layers == 2 and cfg.fp4.scope == "none" and cfg.optimizer.lr == 1e-3
    assert cfg.model.dense_layers == [0] and cfg.checkpoint.dir is None


@pytest.mark.parametrize("override, needle", [
    ("model.num_layrs=2", "model.num_layrs"),          # typo: unknown keys are never ignored
    ("modle.num_layers=2", "modle"),
    ("model.num_layers=two", "model.num_layers='two': expected int"),
])
def test_unknown_or_mistyped_keys_are_rejected(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(default_config_path(), [override])
    assert needle in str(err.value)


@pytest.mark.parametrize("overrides, field", [
    (["model.top_k=9"], "model.top_k"),
    (["model.hidden_size=66"], "model.hidden_size"),
    (["model.num_kv_heads=3"], "model.num_kv_heads"),
    (["model.moe_ffn_hidden_size=40"], "model.moe_ffn_hidden_size"),   # not a multiple of the NVFP4 block
    (["fp4.format=mxfp4", "model.moe_ffn_hidden_size=48"], "model.moe_ffn_hidden_size"),  # MX blocks are 32
    (["fp4.train_mode=fp8"], "fp4.train_mode"),
    (["schedule.seq_len=4096"], "schedule.seq_len"),
    (["schedule.global_batch_size=10"], "schedule.global_batch_size"),
    (["optimizer.min_lr=1.0"], "optimizer.min_lr"),
    (["model.vocab_size=8"], "model.vocab_size"),
    (["parallel.virtual_stages=2"], "parallel.schedule"),
    (["parallel.tp=2"], "parallel.tp"),
    (["data.kind=megatron"], "data.path"),
])
def test_validation_names_the_field(overrides, field):
    cfg = load_config(default_config_path(), overrides)
    with pytest.raises(ConfigError) as err:
        validate_run(cfg)
    assert str(err.value).startswith(field), str(err.value)


def test_parallel_layout_checked_against_world_size():
    cfg = load_config(default_config_path(), ["parallel.pp=3"])
    with pytest.raises(ConfigError, match="world size 4"):
        validate_run(cfg, 4)
    cfg = load_config(default_config_path(), ["parallel.pp=2", "parallel.ep=4"])
    with pytest.raises(ConfigError, match="ep must divide dp=2"):
        validate_run(cfg, 4)
    cfg = load_config(default_config_path(), ["parallel.pp=2", "parallel.virtual_stages=4",
                                              "parallel.schedule=interleaved_1f1b"])
    with pytest.raises(ConfigError, match="model chunks"):
        validate_run(cfg, 2)
    cfg = load_config(default_config_path(), ["parallel.pp=2", "parallel.virtual_stages=2",
                                              "parallel.schedule=interleaved_1f1b", "schedule.micro_batch_size=16"])
    with pytest.raises(ConfigError, match="multiple of pp"):
        validate_run(cfg, 2)
    validate_run(load_config(default_config_path(), ["parallel.pp=2", "parallel.virtual_stages=2",
                                                     "parallel.schedule=interleaved_1f1b",
                                                     "schedule.micro_batch_size=4"]), 4)



@pytest.mark.parametrize("overrides, field, needle", [
    (["parallel.schedule=interleaved_zero_bubble"], "parallel.virtual_stages", "virtual_stages >= 2"),
    (["parallel.schedule=interleaved_zero_bubble", "parallel.virtual_stages=2", "schedule.micro_batch_size=16"],
     "schedule.global_batch_size", "multiple of pp"),
    (["parallel.schedule=zbv", "parallel.virtual_stages=3", "model.num_layers=6"], "parallel.virtual_stages",
     "exactly 2 model chunks"),
    (["parallel.schedule=zb"], "parallel.schedule", "interleaved_zero_bubble"),
])
def test_zero_bubble_schedule_constraints(overrides, field, needle):
    cfg = load_config(default_config_path(), ["parallel.pp=2", *overrides])
    with pytest.raises(ConfigError) as err:
        validate_run(cfg, 2)
    assert str(err.value).startswith(field) and needle in str(err.value), str(err.value)
    for schedule in ("interleaved_zero_bubble", "zbv"):
        validate_run(load_config(default_config_path(), ["parallel.pp=2", "parallel.virtual_stages=2",
                                                         f"parallel.schedule={schedule}"]), 2)


def test_missing_file_and_bad_override_syntax():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/cfg.yaml")
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(None, ["model.num_layers"])


def test_example_configs_validate():
    """Every shipped config is valid for some process count (1, 2, 4 or 8)."""
    import pathlib
    from megatron_fp4.config import default_config_path
    paths = sorted(pathlib.Path(__file__).resolve().parents[2].joinpath("examples", "configs").glob("*.yaml"))
    assert len(paths) >= 3
    paths.append(default_config_path())
    for path in paths:
        cfg = load_config(path)
        errors = []
        for world in (1, 2, 4, 8):
            try:
                validate_run(cfg, world)
                break
            except ConfigError as err:
                errors.append(str(err))
        else:
            raise AssertionError(f"{path.name} is valid for no world size: {errors}")
    assert Config().validate()
