"""Checkpoints are data, damage is detected, and a root always resolves to an intact step.

Every test here builds tiny step directories (no training: the trainer's own DCP save of a tiny
model, or DCP / former-format files written directly): crafted pickles that would create a marker
file if anything executed them, flipped and truncated bytes, `latest` naming a missing step, stale
temp dirs, retention."""
import json
import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_fp4.config import ConfigError, default_config_path, load_config
from megatron_fp4.training.checkpoint import directory as ckpt
from megatron_fp4.training.checkpoint import files
from megatron_fp4.training.checkpoint.dcp_metadata import SafeFileSystemReader, load_metadata_file
from megatron_fp4.training.checkpoint.dcp import load_full_model_state, read_full_model_state


class RunsCode:
    """Unpickling this runs a shell command that creates `marker` (what an attacker's file does)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def weights(step: int) -> torch.Tensor:
    return torch.arange(4096, dtype=torch.float32) + step  # 16 KiB of tensor data


_TRAINER = []  # one tiny trainer for every save of a test process (building one per save is slow)
MARKED = "norm.weight"  # the parameter `save` sets to its step, so a loaded step proves its tensors


def _saver(keep_last: int):
    if not _TRAINER:
        from megatron_fp4.parallel.mesh import ParallelMesh
        from megatron_fp4.training.trainer import Trainer

        cfg = load_config(None, ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2",
                                 "model.num_kv_heads=1", "model.head_dim=16", "model.num_experts=2", "model.top_k=1",
                                 "model.moe_ffn_hidden_size=16", "model.vocab_size=32", "schedule.seq_len=8",
                                 "schedule.global_batch_size=2", "schedule.micro_batch_size=2"])
        _TRAINER.append(Trainer(cfg, ParallelMesh.single(), build_data=False))
    trainer = _TRAINER[0]
    trainer.cfg.checkpoint.keep_last = keep_last
    return trainer


def save(root, step: int, keep_last: int = 0):
    """Step `step` through the trainer's own save (DCP, one process), its marked parameter = step."""
    trainer = _saver(keep_last)
    trainer.step = step
    with torch.no_grad():
        dict(trainer.model.named_parameters())[MARKED].fill_(step)
    return trainer.save_checkpoint(str(root))


def loaded_step(root) -> int:
    """The step a root (or step dir) loads, checking that its tensors are that step's."""
    def load_one(step_dir):
        meta = ckpt.read_meta(step_dir)
        return read_full_model_state(step_dir, meta), meta

    state, meta = ckpt.with_fallback(root, load_one)
    assert torch.equal(state[MARKED], torch.full_like(state[MARKED], meta["step"]))
    return meta["step"]


def shard(step_dir):
    return next(step_dir.glob("*.distcp"))


def legacy_save(root, step: int, state: dict = None, config: dict = None, **extra):
    """A step directory of the former single-file format (state.pt, kind "single"), as older versions
    wrote it: what `tools/convert_checkpoint.py` still reads (written here, no longer by the package)."""
    step_dir = root / ckpt.step_dir_name(step)
    step_dir.mkdir(parents=True)
    state = state or {"model": {"w": weights(step)}, "step": step, "rng": {"torch": torch.get_rng_state()}}
    torch.save({**state, **extra}, step_dir / ckpt.STATE_FILE)
    sums = {n: files.file_digest(step_dir / n) for n in files.data_files(step_dir)}
    ckpt.write_meta(step_dir, {"format_version": ckpt.FORMAT_VERSION, "step": step, "kind": "single",
                               "config": config or {"model": {}}}, sums)
    (root / ckpt.LATEST_FILE).write_text(step_dir.name + "\n")
    return step_dir


def flip_bytes(path, count=64):
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + count] = bytes(b ^ 0xFF for b in data[mid:mid + count])
    path.write_bytes(bytes(data))


def dcp_step(root, step: int, metadata: bytes = None):
    """A 'dcp' step directory: real DCP files (or a crafted `.metadata`) and a consistent meta.json."""
    step_dir = root / ckpt.step_dir_name(step)
    dcp.save({"model/w": weights(step), "model/b": torch.ones(3, dtype=torch.bfloat16)},
             checkpoint_id=str(step_dir), no_dist=True)
    if metadata is not None:
        (step_dir / ".metadata").write_bytes(metadata)
    sums = {n: files.file_digest(step_dir / n) for n in files.data_files(step_dir)}
    ckpt.write_meta(step_dir, {"format_version": ckpt.FORMAT_VERSION, "step": step, "kind": "dcp",
                               "config": {"model": {"num_layers": 1}}}, sums)
    return step_dir


# -- row 1 and 2: nothing in a checkpoint executes ---------------------------------------------------
def test_crafted_state_pt_is_refused_not_executed(tmp_path):
    """The former format is still read (by the converter): weights_only refuses a crafted pickle."""
    marker = tmp_path / "pwned"
    step_dir = legacy_save(tmp_path / "ckpt", 1, payload=RunsCode(marker))  # checksums are right: only weights_only stops it
    with pytest.raises(ckpt.CheckpointError, match="state.pt holds objects other than tensors"):
        ckpt.load_legacy_step(step_dir)
    with pytest.raises(ckpt.CheckpointError):
        ckpt.with_fallback(tmp_path / "ckpt", ckpt.load_legacy_step)
    assert not marker.exists()


def test_the_trainer_refuses_the_former_format_naming_the_converter(tmp_path):
    marker = tmp_path / "pwned"
    step_dir = legacy_save(tmp_path / "ckpt", 1, payload=RunsCode(marker))
    trainer = _saver(0)
    with pytest.raises(ckpt.CheckpointError, match=r"former single-file format .*convert_checkpoint.py upgrade"):
        trainer.load_checkpoint(str(step_dir))
    assert not marker.exists()


def test_real_state_with_optimizer_sampler_and_rng_loads_weights_only(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7, "rng": {"torch": torch.get_rng_state()},
             "sampler": {"epoch": 1, "consumed": 40}}
    legacy_save(tmp_path, 7, state)
    got, meta = ckpt.with_fallback(tmp_path, ckpt.load_legacy_step)
    assert meta["step"] == 7 and got["sampler"] == state["sampler"]
    assert got["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert torch.equal(got["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])


def test_crafted_dcp_metadata_is_refused_not_executed(tmp_path):
    marker = tmp_path / "pwned"
    step_dir = dcp_step(tmp_path / "ckpt", 1, metadata=pickle.dumps(RunsCode(marker)))
    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata refers to (posix|os|nt)\.system"):
        load_metadata_file(step_dir / ".metadata")
    with pytest.raises(ckpt.CheckpointError, match="system"):
        load_full_model_state(tmp_path / "ckpt")
    with pytest.raises(ckpt.CheckpointError, match="system"):
        SafeFileSystemReader(str(step_dir)).read_metadata()
    assert not marker.exists()


def test_real_dcp_metadata_reads_the_same_through_the_allow_list(tmp_path):
    step_dir = dcp_step(tmp_path, 3)
    safe = SafeFileSystemReader(str(step_dir)).read_metadata()
    plain = dcp.FileSystemReader(str(step_dir)).read_metadata()  # our own file: fine to compare against
    assert safe.state_dict_metadata == plain.state_dict_metadata and safe.storage_data == plain.storage_data
    full = load_full_model_state(tmp_path)
    assert torch.equal(full["w"], weights(3)) and full["b"].dtype == torch.bfloat16


# -- row 7 and truncation: damage is detected, a root falls back ------------------------------------
def test_flipped_bytes_fail_the_checksum_and_a_root_falls_back(tmp_path):
    for step in (1, 2):
        save(tmp_path, step)
    flip_bytes(shard(tmp_path / "step_00000002"))
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"distcp fails its sha256 check"):
        loaded_step(tmp_path / "step_00000002")
    with pytest.warns(UserWarning, match="skipping damaged checkpoint.*step_00000002"):
        assert loaded_step(tmp_path) == 1


@pytest.mark.parametrize("victim", ["state.pt", "meta.json"])
@pytest.mark.parametrize("with_checksums", [True, False])
def test_truncated_files_raise_checkpoint_error(tmp_path, victim, with_checksums):
    step_dir = legacy_save(tmp_path, 1) if victim == "state.pt" else save(tmp_path, 1)
    if not with_checksums:  # as written by older versions: no 'files', no 'meta_sha256'
        meta = json.loads((step_dir / "meta.json").read_text())
        (step_dir / "meta.json").write_text(json.dumps({k: v for k, v in meta.items()
                                                        if k not in ("files", "meta_sha256")}))
    path = step_dir / victim
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    load = ckpt.load_legacy_step if victim == "state.pt" else loaded_step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ckpt.CorruptCheckpointError, match=victim):
            load(step_dir)


@pytest.mark.parametrize("with_checksums", [True, False])
def test_truncated_dcp_shard_raises_checkpoint_error(tmp_path, with_checksums):
    step_dir = dcp_step(tmp_path, 1)
    meta = ckpt.read_meta(step_dir)
    if not with_checksums:
        meta.pop("files")
    shard = next(step_dir.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ckpt.CorruptCheckpointError, match="distcp|shards"):
            read_full_model_state(step_dir, meta)


def test_save_fsyncs_files_and_directories(tmp_path, monkeypatch):
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to name fsynced descriptors")
    synced, real_fsync = [], os.fsync

    def recording_fsync(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)
    monkeypatch.setattr(os, "fsync", recording_fsync)
    save(tmp_path / "ckpt", 5)
    temp = [n for n in synced if n.startswith(".tmp-step_00000005")]
    written = files.data_files(tmp_path / "ckpt" / "step_00000005", exclude=[ckpt.META_FILE])
    assert ".metadata" in written and set(written) <= set(synced) and "ckpt" in synced and temp, (written, synced)
    assert any(n.startswith(".tmp-meta.json") for n in synced), synced  # meta.json: temp file, fsync, rename


# -- row 5: `latest` is a hint, a complete step is never replaced -----------------------------------
@pytest.mark.parametrize("latest", ["step_00000099\n", "", "incomplete"])
def test_bad_latest_falls_back_to_the_newest_complete_step(tmp_path, latest):
    for step in (1, 2):
        save(tmp_path, step)
    if latest == "incomplete":
        (tmp_path / "step_00000003").mkdir()  # a step dir without meta.json
        latest = "step_00000003\n"
    (tmp_path / "latest").write_text(latest)
    with pytest.warns(UserWarning, match="using .*step_00000002"):
        assert ckpt.latest_step(tmp_path) == 2
    with pytest.warns(UserWarning):
        assert loaded_step(tmp_path) == 2


def test_traces_without_a_complete_step_fail_loudly(tmp_path):
    assert ckpt.latest_step(tmp_path / "fresh") is None  # nothing there: a fresh start is right
    (tmp_path / "step_00000004").mkdir()
    (tmp_path / "latest").write_text("step_00000004\n")
    with pytest.raises(ckpt.CheckpointError, match="holds no complete checkpoint"):
        ckpt.latest_step(tmp_path)


def test_a_complete_step_is_never_written_again(tmp_path):
    first = save(tmp_path, 3)
    inode = shard(first).stat().st_ino
    with pytest.warns(UserWarning, match="already holds a complete checkpoint"):
        save(tmp_path, 3)
    assert shard(first).stat().st_ino == inode


def test_a_damaged_step_is_replaced_by_a_new_save(tmp_path):
    save(tmp_path, 3)
    flip_bytes(shard(tmp_path / "step_00000003"))
    save(tmp_path, 3)
    assert loaded_step(tmp_path / "step_00000003") == 3


def test_a_copy_hidden_by_an_older_interrupted_replace_is_recovered(tmp_path):
    save(tmp_path, 2)
    os.replace(tmp_path / "step_00000002", tmp_path / ".step_00000002.old-1a2b3c4d")  # old replace_dir, killed
    assert loaded_step(tmp_path) == 2


# -- row 12: retention and stale temp dirs ----------------------------------------------------------
def test_keep_last_deletes_the_oldest_steps(tmp_path):
    for step in range(1, 6):
        save(tmp_path / "two", step, keep_last=2)
        save(tmp_path / "all", step, keep_last=0)
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["latest", "step_00000004", "step_00000005"]
    assert len(list((tmp_path / "all").glob("step_*"))) == 5


def test_keep_last_is_validated_and_defaults_bound_the_run():
    cfg = load_config(default_config_path())
    assert cfg.checkpoint.keep_last > 0 and 0 < cfg.checkpoint.save_interval <= cfg.schedule.train_steps
    with pytest.raises(ConfigError, match="checkpoint.keep_last=-1"):
        load_config(default_config_path(), ["checkpoint.keep_last=-1"]).validate()


def test_stale_temp_dirs_are_cleaned_at_the_next_save(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = [files.temp_name("step_00000007", pid=dead.pid), ".tmp-step_00000007-1234", ".tmp-step_00000008",
                 files.temp_name("step_00000009", host="another-host"), files.temp_name("latest")]
        kept = files.temp_name("step_00000007", pid=live.pid)
        for name in stale + [kept]:
            (tmp_path / name).mkdir()
        save(tmp_path, 10)
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted([kept, "latest", "step_00000010"]), left
    finally:
        live.kill()
        live.wait()
