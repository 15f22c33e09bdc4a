"""Issue 22, section 1's `fp4.compile=off` and table rows 8 and 21-25: config values that were
silently misread (YAML 1.1 reads plain off/0755/12:30 as False/493/750), YAML that expands or nests
without bound, absurd sizes, a data set smaller than the batch, a file as the TensorBoard dir.

Each bad input must give one line naming the file or field (the CLI: exit code 2) and allocate
nothing it was not asked for. The checkpoint rows are in test_bad_input_checkpoint.py.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_fp4.config import ConfigError, config_from_dict, load_config

pytestmark = pytest.mark.faults
REPO = Path(__file__).resolve().parents[2]
SMALL = ["--set", "model.num_layers=1", "--set", "schedule.seq_len=16", "--set", "schedule.global_batch_size=4",
         "--set", "schedule.micro_batch_size=4", "--set", "logging.progress=false",
         "--set", "logging.tensorboard_dir=null", "--steps", "1"]


def _run(*args, module=("-m", "megatron_fp4.train")):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, *module, *map(str, args)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def _assert_one_line(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert len(last) < 2500 and all(n in last for n in needles), last[:3000]


def _yaml_file(tmp_path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


# -- section 1 and row 23: string fields keep what was written ---------------------------------------
@pytest.mark.parametrize("text, want", [("off", "off"), ("on", "on"), ("auto", "auto"), ('"off"', "off")])
def test_choice_field_accepts_the_names_its_help_gives(tmp_path, text, want):
    """YAML 1.1 reads plain off/on as booleans: fp4.compile=off used to become 'False' and be refused."""
    assert load_config(None, [f"fp4.compile={text}"]).validate().fp4.compile == want
    assert load_config(_yaml_file(tmp_path, f"fp4:\n  compile: {text}\n")).validate().fp4.compile == want


def test_a_python_bool_on_a_choice_field_maps_to_its_on_off_names():
    assert config_from_dict({"fp4": {"compile": False}}).fp4.compile == "off"
    assert config_from_dict({"fp4": {"compile": True}}).fp4.compile == "on"
    with pytest.raises(ConfigError, match="fp4.scope"):  # its choices name no boolean
        config_from_dict({"fp4": {"scope": False}})


@pytest.mark.parametrize("field, text", [
    ("checkpoint.dir", "off"), ("data.path", "0755"), ("checkpoint.load", "12:30"), ("logging.tensorboard_dir", "yes"),
    ("data.path", "1e3"), ("checkpoint.dir", "2024-01-02"), ("fp4.scope", "none"),
])
def test_string_fields_keep_the_literal_text(tmp_path, field, text):
    section, name = field.split(".")
    from_file = load_config(_yaml_file(tmp_path, f"{section}:\n  {name}: {text}\n"))
    for cfg in (load_config(None, [f"{field}={text}"]), from_file):
        assert getattr(getattr(cfg, section), name) == text


def test_null_still_unsets_an_optional_string_and_numbers_stay_numbers():
    cfg = load_config(None, ["checkpoint.dir=null", "checkpoint.load=~", "model.num_layers=0010",
                             "schedule.train_steps=1e3", "optimizer.lr=1e-3", "model.dense_layers=[0, 1]"])
    assert cfg.checkpoint.dir is None and cfg.checkpoint.load is None
    assert cfg.model.num_layers == 10 and cfg.schedule.train_steps == 1000 and cfg.optimizer.lr == 1e-3
    assert cfg.model.dense_layers == [0, 1]
    with pytest.raises(ConfigError, match=r"model\.num_layers='12:30': expected int"):  # never YAML's base 60
        load_config(None, ["model.num_layers=12:30"])
    with pytest.raises(ConfigError, match=r"data\.path=.*expected str"):
        load_config(None, ["data.path=[a, b]"])


# -- rows 21 and 22: bounded YAML -------------------------------------------------------------------
def _laughs(levels: int) -> str:
    value, prev = '&l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]', "l0"
    for i in range(1, levels):
        value, prev = f"&l{i} [" + ",".join([value] + [f"*{prev}"] * 8) + "]", f"l{i}"
    return value


@pytest.mark.parametrize("levels", [5, 9])
def test_nested_aliases_are_refused_quickly_in_one_short_line(tmp_path, levels):
    path = _yaml_file(tmp_path, f"dtype: {_laughs(levels)}\n")
    assert path.stat().st_size < 400
    with pytest.raises(yaml.YAMLError, match="expands to more than") as err:
        load_config(path)
    assert len(str(err.value)) < 300
    with pytest.raises(yaml.YAMLError, match="expands to more than"):
        load_config(None, [f"model.dense_layers={_laughs(levels)}"])


def test_cli_error_line_of_alias_expansion_is_short(tmp_path):
    """5 levels used to print a 3.8 MB 'one-line' error (the repr of the expanded value)."""
    _assert_one_line(_run("--config", _yaml_file(tmp_path, f"dtype: {_laughs(5)}\n")), "YAML error", "cfg.yaml")


@pytest.mark.parametrize("text", ["a: &a [*a]\nmodel:\n  dense_layers: *a\n",
                                  "base: &b {num_layers: 2}\nmodel:\n  <<: *b\n"])
def test_self_referencing_aliases_and_merge_keys_are_refused(tmp_path, text):
    with pytest.raises(yaml.YAMLError, match="nested more than|merge keys"):
        load_config(_yaml_file(tmp_path, text))


def test_deeply_nested_yaml_is_refused_without_recursion_error(tmp_path):
    deep = "[" * 3000 + "]" * 3000
    with pytest.raises(yaml.YAMLError, match="nested more than 32 levels"):
        load_config(_yaml_file(tmp_path, f"model: {deep}\n"))
    with pytest.raises(yaml.YAMLError, match="nested more than 32 levels"):
        load_config(None, [f"model.dense_layers={deep}"])


def test_config_file_size_is_bounded(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# " + "x" * (2 << 20) + "\n")
    with pytest.raises(ConfigError, match="big.yaml.*bytes"):
        load_config(path)
    (tmp_path / "bin.yaml").write_bytes(b"model:\n  num_layers: \xff\xfe\n")
    with pytest.raises(ConfigError, match="bin.yaml.*not UTF-8"):
        load_config(tmp_path / "bin.yaml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


# -- row 24: sanity limits before anything is built ---------------------------------------------------
@pytest.mark.parametrize("override, field", [
    ("model.vocab_size=100000000000000", "model.vocab_size"), ("model.vocab_size=1e14", "model.vocab_size"),
    ("model.num_layers=100000000", "model.num_layers"), ("model.hidden_size=1048576", "model.hidden_size"),
    ("model.num_experts=1000000000", "model.num_experts"), ("data.num_samples=1e12", "data.num_samples"),
    ("data.num_samples=0", "data.num_samples"),
])
def test_absurd_sizes_are_refused_by_validation(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override]).validate()
    assert str(err.value).startswith(field), str(err.value)


# -- CLI: rows 8, 24, 25 ----------------------------------------------------------------------------
def test_cli_one_line_errors(tmp_path):
    import numpy as np

    a_file = tmp_path / "tb"
    a_file.write_text("")
    np.save(tmp_path / "t.npy", np.arange(40, dtype=np.int32) % 18)  # (40 - 1) // 16 = 2 samples
    cases = [
        (["--set", "data.num_samples=2"], ("data error", "global_batch_size=4", "2 samples")),
        (["--set", "data.kind=numpy", "--set", f"data.path={tmp_path / 't.npy'}"], ("data error", "2 samples")),
        (["--set", "model.num_layers=100000000"], ("config error", "model.num_layers")),
        (["--set", f"logging.tensorboard_dir={a_file}"], ("config error", "logging.tensorboard_dir", "file")),
        (["--set", f"logging.tensorboard_dir={a_file}/sub"], ("config error", "logging.tensorboard_dir", "file")),
    ]
    for args, needles in cases:
        _assert_one_line(_run(*SMALL, *args), *needles)


def test_metrics_logger_refuses_a_file_as_tensorboard_dir(tmp_path):
    from megatron_fp4.training.metrics import MetricsLogger

    (tmp_path / "tb").write_text("")
    with pytest.raises(ConfigError, match="logging.tensorboard_dir=.*existing file"):
        MetricsLogger(str(tmp_path / "tb"), total_steps=1, progress=False)
