"""`checkpoint.load=auto` through the CLI's run(): a finished job run again writes nothing, a bad
`latest` resumes from the newest complete step (never from step 0 over good steps), and a dir with
traces of checkpoints but none complete is refused."""
import warnings

import pytest

from megatron_fp4.train import run
from megatron_fp4.training.checkpoint.directory import CheckpointError
from tests.integration.test_train import small_cfg


def auto_cfg(tmp_path, steps: int):
    return small_cfg(tmp_path, f"schedule.train_steps={steps}", "schedule.warmup_steps=0",
                     "checkpoint.save_interval=1", "checkpoint.keep_last=0", "checkpoint.load=auto",
                     "fp4.scope=none", "fp4.train_mode=bf16")  # the FP4 path is not what is tested here


def inodes(root):
    return {p.name: (p / ".metadata").stat().st_ino for p in sorted(root.glob("step_*"))}


def test_finished_job_run_again_writes_nothing(tmp_path):
    run(auto_cfg(tmp_path, 2))
    before = inodes(tmp_path / "ckpt")
    assert list(before) == ["step_00000001", "step_00000002"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert run(auto_cfg(tmp_path, 2)) == []
    assert inodes(tmp_path / "ckpt") == before


@pytest.mark.parametrize("latest", ["step_00000099\n", ""])
def test_bad_latest_resumes_from_the_newest_complete_step(tmp_path, latest):
    run(auto_cfg(tmp_path, 2))
    before = inodes(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "latest").write_text(latest)
    with pytest.warns(UserWarning, match="step_00000002"):
        history = run(auto_cfg(tmp_path, 3))
    assert len(history) == 1  # step 3 only: resumed at 2, not restarted at 0
    after = inodes(tmp_path / "ckpt")
    assert {k: after[k] for k in before} == before and "step_00000003" in after


def test_only_incomplete_steps_are_refused_not_overwritten(tmp_path):
    (tmp_path / "ckpt" / "step_00000005").mkdir(parents=True)
    (tmp_path / "ckpt" / "latest").write_text("step_00000005\n")
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        run(auto_cfg(tmp_path, 2))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step_00000005"]


def test_crafted_checkpoint_given_to_the_trainer_executes_nothing(tmp_path):
    """A step whose DCP `.metadata` is a crafted pickle, its checksums made consistent (so only the
    allow-listed reader stops it), and one of the former format (never unpickled by the trainer)."""
    import pickle

    from megatron_fp4.training.checkpoint import directory as ckpt
    from megatron_fp4.training.checkpoint import files
    from tests.unit.test_checkpoint_safety import RunsCode, legacy_save

    marker = tmp_path / "pwned"
    run(auto_cfg(tmp_path, 1))
    step_dir = tmp_path / "ckpt" / "step_00000001"
    (step_dir / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    meta = ckpt.read_meta(step_dir)
    ckpt.write_meta(step_dir, meta, {n: files.file_digest(step_dir / n) for n in meta["files"]})
    legacy = legacy_save(tmp_path / "legacy", 1, payload=RunsCode(marker))
    for crafted, needle in [(step_dir, "refers to (posix|os|nt).system"), (legacy, "convert_checkpoint.py upgrade")]:
        cfg = small_cfg(tmp_path, f"checkpoint.load={crafted}", "checkpoint.dir=null", "fp4.scope=none",
                        "fp4.train_mode=bf16")
        with pytest.raises(CheckpointError, match=needle):
            run(cfg)
    assert not marker.exists()
