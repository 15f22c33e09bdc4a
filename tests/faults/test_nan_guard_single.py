"""Row 8 of issue 10, one process: the guard is active from step 0, skips are capped, and
non-finite weights are never saved (nor loaded)."""
import pytest
import torch

from megatron_fp4.config import load_config
from megatron_fp4.training.checkpoint import directory as ckpt
from megatron_fp4.training.checkpoint import dcp as dcp_ckpt
from megatron_fp4.training.trainer import NonFiniteError, Trainer

pytestmark = pytest.mark.faults


def tiny(tmp_path, *extra):
    return load_config(None, [
        "model.num_layers=1", "schedule.seq_len=16", "schedule.global_batch_size=4", "schedule.micro_batch_size=2",
        "schedule.train_steps=10", "schedule.warmup_steps=0", "logging.progress=false", "logging.tensorboard_dir=null",
        "logging.log_interval=0", "data.num_samples=100", f"checkpoint.dir={tmp_path / 'ckpt'}", *extra])


def test_an_update_that_makes_weights_non_finite_stops_at_step_0_and_is_not_saved(tmp_path):
    trainer = Trainer(tiny(tmp_path))
    trainer.cfg.optimizer.lr = float("inf")  # what validation now refuses, forced past it
    with pytest.raises(NonFiniteError, match="step 0: the optimizer update"):
        trainer.train()
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").glob("step_*"))
    with pytest.raises(NonFiniteError, match="refusing to save step 0"):
        trainer.save_checkpoint(str(tmp_path / "ckpt"))
    assert ckpt.latest_step(tmp_path / "ckpt") is None


def test_consecutive_skips_are_capped(tmp_path):
    trainer = Trainer(tiny(tmp_path, "schedule.nan_policy=skip", "schedule.max_consecutive_skips=2"))
    assert not trainer.train_step()["skipped"]
    handle = trainer.model.layers[0].register_forward_pre_hook(lambda m, args: (args[0] * float("nan"),) + args[1:])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert [trainer.train_step()["skipped"] for _ in range(2)] == [True, True]
    with pytest.raises(NonFiniteError, match="schedule.max_consecutive_skips=2"):
        trainer.train_step()
    handle.remove()
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert not trainer.train_step()["skipped"] and trainer.consecutive_skips == 0  # a good step resets the count


def test_a_checkpoint_with_non_finite_weights_is_refused_on_load(tmp_path):
    trainer = Trainer(tiny(tmp_path))
    with torch.no_grad():
        next(trainer.model.parameters())[0] = float("nan")
    trainer.step = 3
    dcp_ckpt.save(tmp_path / "ckpt", trainer)  # bypassing the trainer's refusal
    with pytest.raises(ckpt.CheckpointError, match="non-finite weights"):
        Trainer(tiny(tmp_path)).load_checkpoint(str(tmp_path / "ckpt"))
