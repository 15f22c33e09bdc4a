"""The training job end to end: loss falls, resume is bit-exact, NaN steps are refused, CLI errors."""
import math

import pytest
import torch

from megatron_fp4.config import default_config_path, load_config
from megatron_fp4.train import main
from megatron_fp4.training.checkpoint.directory import CheckpointError
from megatron_fp4.training.trainer import NonFiniteError, Trainer


def small_cfg(tmp_path, *extra):
    return load_config(default_config_path(), [
        "model.num_layers=2", "schedule.seq_len=32", "schedule.global_batch_size=8", "schedule.micro_batch_size=4",
        "schedule.train_steps=40", "schedule.warmup_steps=5", "logging.progress=false",
        f"logging.tensorboard_dir={tmp_path / 'tb'}", f"checkpoint.dir={tmp_path / 'ckpt'}", *extra])


def test_loss_falls_with_fp4_moeresq(tmp_path):
    cfg = small_cfg(tmp_path, "schedule.train_steps=30")
    assert cfg.fp4.train_mode == "fp4_resq" and cfg.fp4.scope == "experts"
    history = Trainer(cfg).train()
    first = sum(h["loss"] for h in history[:3]) / 3
    last = sum(h["loss"] for h in history[-3:]) / 3
    assert first > 3.0 and last < first - 0.6, (first, last)
    logged = [h for h in history if "moe/aux_loss" in h]
    assert logged and all(math.isfinite(h["fp4/expert_input_sqnr_db"]) for h in logged)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))  # TensorBoard got the scalars


def test_resume_from_half_way_is_bit_exact(tmp_path):
    cfg = small_cfg(tmp_path, "schedule.train_steps=8", "checkpoint.save_interval=4", "fp4.grad_rounding=stochastic")
    full = Trainer(cfg)
    losses = [h["loss"] for h in full.train()]
    resumed = Trainer(cfg)
    assert resumed.load_checkpoint(str(tmp_path / "ckpt" / "step_00000004")) == 4
    tail = [h["loss"] for h in resumed.train()]
    assert tail == losses[4:]  # bit for bit: model, Adam state, LR step, data position, RNG
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nan_step_is_refused_before_the_weights(tmp_path, policy):
    cfg = small_cfg(tmp_path, f"schedule.nan_policy={policy}", "checkpoint.dir=null")
    trainer = Trainer(cfg)
    trainer.train(num_steps=1)
    with torch.no_grad():
        trainer.model.embed_tokens.weight[3, 0] = float("nan")  # poisons the step's activations
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    if policy == "stop":
        with pytest.raises(NonFiniteError, match="non-finite"):
            trainer.train_step()
    else:
        result = trainer.train_step()
        assert result["skipped"] and "non-finite" in result["message"] and "model.layers.0" in result["message"]
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name], ) or torch.equal(p.nan_to_num(7.0), before[name].nan_to_num(7.0)), name


def test_checkpoint_of_another_model_is_rejected(tmp_path):
    cfg = small_cfg(tmp_path, "schedule.train_steps=1", "schedule.warmup_steps=0")
    Trainer(cfg).train()
    other = small_cfg(tmp_path, "model.hidden_size=128", "schedule.warmup_steps=0", "schedule.train_steps=1")
    with pytest.raises(CheckpointError, match="model.hidden_size: checkpoint 64 vs config 128"):
        Trainer(other).load_checkpoint(str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match="not a megatron-fp4 checkpoint"):
        Trainer(cfg).load_checkpoint(str(tmp_path))


def test_interrupted_save_leaves_latest_loadable(tmp_path, monkeypatch):
    cfg = small_cfg(tmp_path, "schedule.train_steps=2", "schedule.warmup_steps=0", "checkpoint.save_interval=1")
    trainer = Trainer(cfg)
    trainer.train(num_steps=1)
    import errno

    from torch.distributed.checkpoint import filesystem

    def crash(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(filesystem.FileSystem, "create_stream", crash)  # DCP's writes, one process too
    with pytest.raises(CheckpointError, match="disk full while saving step 2 .*; step 1 is intact"):
        trainer.train(num_steps=1)
    monkeypatch.undo()
    assert Trainer(cfg).load_checkpoint(str(tmp_path / "ckpt")) == 1  # still the complete step 1


def test_cli_reports_config_errors(capsys):
    assert main(["--set", "model.top_k=99", "--steps", "1"]) == 2
    assert "model.top_k=99" in capsys.readouterr().err


def test_trains_on_megatron_indexed_and_numpy_files(tmp_path):
    import numpy as np

    from megatron_fp4.training.data import IndexedDatasetWriter

    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(str(tmp_path / "corpus"), dtype=np.uint16) as writer:
        for _ in range(40):
            writer.add_document(rng.integers(0, 32, size=int(rng.integers(20, 60))))
    np.save(tmp_path / "tokens.npy", rng.integers(0, 32, size=3000).astype(np.int32))
    for kind, path in [("megatron", tmp_path / "corpus"), ("numpy", tmp_path / "tokens.npy")]:
        cfg = small_cfg(tmp_path, f"data.kind={kind}", f"data.path={path}", "schedule.train_steps=2",
                        "schedule.warmup_steps=0", "checkpoint.dir=null")
        history = Trainer(cfg).train()
        assert len(history) == 2 and all(math.isfinite(h["loss"]) for h in history)
    cfg = small_cfg(tmp_path, "data.kind=numpy", f"data.path={tmp_path / 'missing.npy'}")
    with pytest.raises(ValueError, match="data.path"):
        Trainer(cfg)
