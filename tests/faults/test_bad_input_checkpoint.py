"""Issue 22, table rows 13-16: checkpoints whose meta.json lies about the model or has the wrong
types, a full disk during a save (one process and two: DCP at every size), and a DCP `.metadata`
sizing a tensor at 2^40. Each must be one line naming the checkpoint (the tools: exit code 2), with nothing allocated
for a size the files do not hold and no temp directory left behind.
"""
import contextlib
import errno
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from megatron_fp4.config import load_config
from megatron_fp4.training.checkpoint import directory as ckpt
from megatron_fp4.training.checkpoint import files
from tests.faults.test_bad_input_config import REPO, _assert_one_line, _run

pytestmark = pytest.mark.faults


def _convert(*args):
    return _run(*args, module=(str(REPO / "tools" / "convert_checkpoint.py"),))


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
    (lambda m: m.update(files={}), "no checksum of ['.metadata']"),
    (lambda m: m["files"].update({"../../outside": "0" * 64}), "not a file name"),
])
def test_meta_with_wrong_types_is_refused_in_one_line(saved_root, tmp_path, edit, needle):
    from megatron_fp4.training.trainer import Trainer

    step_dir = _copy(saved_root, tmp_path)
    _edit_meta(step_dir, edit)
    with pytest.raises(ckpt.CheckpointError) as err:
        Trainer(_tiny_cfg()).load_checkpoint(str(step_dir))
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


def _fill_disk_during_dcp_save(monkeypatch, room=1000):
    """Every file DCP writes takes `room` bytes, then the disk is full."""
    from torch.distributed.checkpoint import filesystem

    real = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            yield _FullDisk(stream, room) if "w" in mode else stream

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", create_stream)


def test_disk_full_while_saving_is_one_line_and_leaves_no_temp_dir(tmp_path, monkeypatch):
    from tests.unit.test_checkpoint_safety import loaded_step, save

    root = tmp_path / "ck"
    save(root, 1)  # the trainer's save, one process
    with monkeypatch.context() as m:
        _fill_disk_during_dcp_save(m)
        with pytest.raises(ckpt.CheckpointError, match=r"disk full while saving step 2 to .*; step 1 is intact"):
            save(root, 2)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]
    assert loaded_step(root) == 1  # its tensors are step 1's


def test_disk_full_while_writing_meta_json_cleans_up_too(tmp_path, monkeypatch):
    from tests.unit.test_checkpoint_safety import save

    root = tmp_path / "ck"
    real = files.write_durable_text

    def full(path, text):
        if path.name == ckpt.META_FILE:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, text)

    monkeypatch.setattr(files, "write_durable_text", full)
    with pytest.raises(ckpt.CheckpointError, match="disk full while saving step 3 .*no earlier step is saved there"):
        save(root, 3)
    assert list(root.iterdir()) == []


def test_durable_text_leaves_no_temp_file_when_the_write_fails(tmp_path, monkeypatch):
    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fsync", no_space)
    with pytest.raises(OSError):
        files.write_durable_text(tmp_path / "latest", "step_00000001\n")
    assert list(tmp_path.iterdir()) == []


def _dcp_disk_full(rank, world_size, root):
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
    from megatron_fp4.training.checkpoint.dcp import read_full_model_state

    good = _dcp_checkpoint(tmp_path / "good", huge=False)
    assert "parameters" in _convert("inspect", good).stdout
    step_dir = _dcp_checkpoint(tmp_path / "huge", huge=True)
    _assert_one_line(_convert("inspect", step_dir), "written for a different model", "1099511627776")
    with pytest.raises(ckpt.CorruptCheckpointError, match="store"):  # without a config: against the files
        read_full_model_state(step_dir, ckpt.read_meta(step_dir))


def _dcp_meta_claims_another_model(rank, world_size, root):
    import torch.distributed as dist

    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer
    from tests.distributed.test_parallel_training import tiny_cfg

    t = Trainer(tiny_cfg(), ParallelMesh.build(1, world_size, 1))
    t.save_checkpoint(root)
    t.optimizer.remove_hooks()
    if rank == 0:
        _edit_meta(Path(root) / ckpt.step_dir_name(0), lambda m: m["config"]["model"].update(moe_ffn_hidden_size=32))
    dist.barrier()
    cfg = tiny_cfg()
    cfg.model.moe_ffn_hidden_size = 32  # what the edited meta.json claims
    r = Trainer(cfg, ParallelMesh.build(1, world_size, 1))
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
