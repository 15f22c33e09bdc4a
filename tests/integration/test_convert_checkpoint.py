"""tools/convert_checkpoint.py: ours -> HF safetensors -> ours keeps every weight bit for bit."""
import pytest
import torch

from megatron_fp4.config import load_config
from megatron_fp4.training.trainer import Trainer
from tests.integration.test_train import small_cfg
from tools.convert_checkpoint import main

pytest.importorskip("safetensors")


def test_roundtrip_through_hf(tmp_path, capsys):
    cfg = small_cfg(tmp_path, "schedule.train_steps=2", "schedule.warmup_steps=0")
    trained = Trainer(cfg)
    trained.train()
    ckpt_root = tmp_path / "ckpt"
    assert main(["inspect", str(ckpt_root)]) == 0
    assert "kind: single  step: 2" in capsys.readouterr().out
    assert main(["to-hf", str(ckpt_root), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").exists()
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "conv")]) == 0
    step_dir = tmp_path / "conv" / "step_00000000"
    conv_cfg = load_config(step_dir / "config.yaml", [f"checkpoint.load={tmp_path / 'conv'}", "checkpoint.dir=null",
                                                       "logging.tensorboard_dir=null", "logging.progress=false"])
    resumed = Trainer(conv_cfg)
    assert resumed.load_checkpoint(str(tmp_path / "conv")) == 0  # weights-only: starts at step 0
    for (name, a), (_, b) in zip(trained.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
    result = resumed.train_step()
    assert result["loss"] == result["loss"]  # trains from the converted weights


def test_errors_are_reported_not_raised(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "not a megatron-fp4 checkpoint" in capsys.readouterr().err
