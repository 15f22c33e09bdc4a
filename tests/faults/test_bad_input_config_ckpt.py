"""Issue 22, section 1's `fp4.compile=off` and table rows 8, 13-16 and 21-25: config values and
checkpoints that crashed with a traceback, allocated without bound or were silently misread.

Each bad input must give one line naming the file or field (CLIs: exit code 2), allocate nothing
it was not asked for, and leave no half-written save behind.
"""
import errno
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from megatron_fp4.config import ConfigError, config_from_dict, load_config
from megatron_fp4.training import checkpoint as ckpt
from megatron_fp4.training import checkpoint_files as files

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


def _convert(*args):
    return _run(*args, module=(str(REPO / "tools" / "convert_checkpoint.py"),))


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
    for cfg in (load_config(None, [f"{field}={text}"]), load_config(_yaml_file(tmp_path, f"{section}:\n  {name}: {text}\n"))):
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


# -- rows 13 and 14: meta.json that lies about the model, or has the wrong types -----------------------
def _tiny_cfg(*overrides):
    return load_config(None, ["model.num_layers=1", "schedule.seq_len=16", "schedule.global_batch_size=4",
                              "schedule.micro_batch_size=4", "logging.progress=false", "logging.tensorboard_dir=null",
                              "data.num_samples=8", *overrides])


def _edit_meta(step_dir: Path, edit) -> None:
    """Edit meta.json and make its own sha256 consistent again (what a careful hand edit does)."""
    path = step_dir / ckpt.META_FILE
    meta = json.loads(path.read_text())
    edit(meta)
    meta["meta_sha256"] = ckpt._meta_digest(meta)
    path.write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory):
    from megatron_fp4.training.trainer import Trainer

    root = tmp_path_factory.mktemp("ckpt") / "ck"
    Trainer(_tiny_cfg()).save_checkpoint(str(root))
    return root


def _copy(saved_root, tmp_path) -> Path:
    import shutil

    shutil.copytree(saved_root, tmp_path / "ck")
    return tmp_path / "ck" / ckpt.step_dir_name(0)


@pytest.mark.parametrize("field, value, override", [("num_layers", 2, "model.num_layers=2"),
                                                    ("hidden_size", 128, "model.hidden_size=128")])
def test_meta_claiming_another_model_is_refused_on_resume_and_to_hf(saved_root, tmp_path, field, value, override):
    from megatron_fp4.training.trainer import Trainer

    step_dir = _copy(saved_root, tmp_path)
    _edit_meta(step_dir, lambda meta: meta["config"]["model"].update({field: value}))
    trainer = Trainer(_tiny_cfg(override))  # the config the edited meta.json claims
    with pytest.raises(ckpt.CheckpointError, match="written for a different model"):
        trainer.load_checkpoint(str(step_dir.parent))
    for proc in (_convert("to-hf", step_dir.parent, tmp_path / "hf"), _convert("inspect", step_dir)):
        _assert_one_line(proc, "written for a different model", "Use the config")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m.update(config=[1]), "'config' is a JSON list"),
    (lambda m: m["config"].update(model=5), "'config.model' is a JSON int"),
    (lambda m: m.update(step="7"), "'step'"),
    (lambda m: m.update(files={k: [v] for k, v in m["files"].items()}), "not a sha256"),
    (lambda m: m.update(files={k: 5 for k in m["files"]}), "not a sha256"),
    (lambda m: m.update(files={}), "no checksum of ['state.pt']"),
    (lambda m: m["files"].update({"../../outside": "0" * 64}), "not a file name"),
])
def test_meta_with_wrong_types_is_refused_in_one_line(saved_root, tmp_path, edit, needle):
    step_dir = _copy(saved_root, tmp_path)
    _edit_meta(step_dir, edit)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load_checkpoint(step_dir)
    assert needle in str(err.value) and "meta.json" in str(err.value), str(err.value)
    _assert_one_line(_convert("inspect", step_dir), needle)


# -- row 15: a full disk during a save ------------------------------------------------------------------
class _FullDisk:
    """A file that takes `room` bytes, then fails every write as a full disk does."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data):
        data = memoryview(data).cast("B")
        if len(data) > self.room:
            self.f.write(data[:self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):  # tell, seek, flush, ...: the real file's
        return getattr(self.f, name)


def _fill_disk_during_torch_save(monkeypatch, room=1000):
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            with open(f, "wb") as handle:
                return real_save(obj, _FullDisk(handle, room), *args, **kwargs)
        return real_save(obj, _FullDisk(f, room), *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def _state(step):
    return {"model": {"w": torch.arange(4096, dtype=torch.float32) + step}, "step": step}


def test_disk_full_while_saving_is_one_line_and_leaves_no_temp_dir(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    ckpt.save_checkpoint(root, 1, _state(1), {"model": {}})
    with monkeypatch.context() as m:
        _fill_disk_during_torch_save(m)
        with pytest.raises(ckpt.CheckpointError, match=r"disk full while saving step 2 to .*; step 1 is intact"):
            ckpt.save_checkpoint(root, 2, _state(2), {"model": {}})
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]
    state, meta = ckpt.load_checkpoint(root)
    assert meta["step"] == 1 and torch.equal(state["model"]["w"], _state(1)["model"]["w"])


def test_disk_full_while_writing_meta_json_cleans_up_too(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    real = files.write_durable_text

    def full(path, text):
        if path.name == ckpt.META_FILE:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, text)

    monkeypatch.setattr(files, "write_durable_text", full)
    with pytest.raises(ckpt.CheckpointError, match="disk full while saving step 3 .*no earlier step is saved there"):
        ckpt.save_checkpoint(root, 3, _state(3), {"model": {}})
    assert list(root.iterdir()) == []


def test_durable_text_leaves_no_temp_file_when_the_write_fails(tmp_path, monkeypatch):
    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fsync", no_space)
    with pytest.raises(OSError):
        files.write_durable_text(tmp_path / "latest", "step_00000001\n")
    assert list(tmp_path.iterdir()) == []


def _dcp_disk_full(rank, world_size, root):
    import contextlib

    from torch.distributed.checkpoint import filesystem

    from tests.distributed.test_parallel_training_checkpoint import _trainer

    t = _trainer(world_size, zero_stage=1)
    t.save_checkpoint(root)  # step 0: intact
    t.train_step()
    real = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def full_on_rank_1(self, path, mode):
        with real(self, path, mode) as stream:
            yield _FullDisk(stream, 100) if rank == 1 and "w" in mode else stream

    filesystem.FileSystem.create_stream = full_on_rank_1
    try:
        t.save_checkpoint(root)
        message = None
    except ckpt.CheckpointError as err:
        message = str(err)
    finally:
        filesystem.FileSystem.create_stream = real
        t.optimizer.remove_hooks()
    return {"message": message, "names": sorted(p.name for p in Path(root).iterdir())}


def test_dcp_disk_full_on_one_rank_is_one_line_on_every_rank(tmp_path):
    from tests.distributed.launch import run_distributed

    root = str(tmp_path / "ck")
    for rank, out in enumerate(run_distributed(_dcp_disk_full, 2, (root,), timeout_s=300)):
        assert out["message"] and "disk full while saving step 1" in out["message"], (rank, out)
        assert "step 0 is intact" in out["message"], (rank, out)
        assert out["names"] == ["latest", "step_00000000"], (rank, out)


# -- row 16: DCP metadata sizing a tensor at 2^40 ---------------------------------------------------------
def _dcp_checkpoint(root: Path, huge: bool) -> Path:
    import torch.distributed.checkpoint as dcp

    from megatron_fp4.model import build_model

    cfg = _tiny_cfg()
    step_dir = root / ckpt.step_dir_name(1)
    dcp.save({f"model/{k}": v for k, v in build_model(cfg).state_dict().items()}, checkpoint_id=str(step_dir),
             no_dist=True)
    if huge:  # allowed classes only, checksums made consistent below: only the sizes lie
        md = pickle.loads((step_dir / ".metadata").read_bytes())  # our own file, just written
        entry = md.state_dict_metadata["model/embed_tokens.weight"]
        entry.size = entry.chunks[0].sizes = torch.Size([2 ** 40])
        (step_dir / ".metadata").write_bytes(pickle.dumps(md))
    sums = {n: files.file_digest(step_dir / n) for n in files.data_files(step_dir)}
    ckpt.write_meta(step_dir, {"format_version": ckpt.FORMAT_VERSION, "step": 1, "kind": "dcp",
                               "config": cfg.to_dict()}, sums)
    return step_dir


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_metadata_sizes_are_checked_before_allocating(tmp_path):
    from megatron_fp4.training.dist_checkpoint import read_full_model_state

    good = _dcp_checkpoint(tmp_path / "good", huge=False)
    assert "parameters" in _convert("inspect", good).stdout
    step_dir = _dcp_checkpoint(tmp_path / "huge", huge=True)
    _assert_one_line(_convert("inspect", step_dir), "written for a different model", "1099511627776")
    with pytest.raises(ckpt.CorruptCheckpointError, match="store"):  # without a config: against the files
        read_full_model_state(step_dir, ckpt.read_meta(step_dir))


def _dcp_meta_claims_another_model(rank, world_size, root):
    import torch.distributed as dist

    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.parallel_trainer import ParallelTrainer
    from tests.distributed.test_parallel_training import tiny_cfg

    t = ParallelTrainer(tiny_cfg(), ParallelMesh.build(1, world_size, 1))
    t.save_checkpoint(root)
    t.optimizer.remove_hooks()
    if rank == 0:
        _edit_meta(Path(root) / ckpt.step_dir_name(0), lambda m: m["config"]["model"].update(moe_ffn_hidden_size=32))
    dist.barrier()
    cfg = tiny_cfg()
    cfg.model.moe_ffn_hidden_size = 32  # what the edited meta.json claims
    r = ParallelTrainer(cfg, ParallelMesh.build(1, world_size, 1))
    try:
        r.load_checkpoint(root)
        return None
    except ckpt.CheckpointError as err:
        return str(err)
    finally:
        r.optimizer.remove_hooks()


def test_dcp_meta_claiming_another_model_is_refused_on_resume(tmp_path):
    from tests.distributed.launch import run_distributed

    for rank, message in enumerate(run_distributed(_dcp_meta_claims_another_model, 2, (str(tmp_path / "ck"),),
                                                   timeout_s=300)):
        assert message and "written for a different model" in message and "experts.w" in message, (rank, message)
