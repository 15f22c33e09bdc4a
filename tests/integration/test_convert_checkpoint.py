"""tools/convert_checkpoint.py: ours -> HF safetensors -> ours keeps every weight bit for bit."""
import math

import torch

from megatron_fp4.config import load_config
from megatron_fp4.training.trainer import Trainer
from tests.integration.test_train import small_cfg
from tools.convert_checkpoint import main


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
    # it trains from the converted weights: the first step's loss is the bits of a fresh trainer of the
    # same config holding the trained weights directly (same data position 0, same fresh optimizer)
    direct = Trainer(conv_cfg)
    direct.model.load_state_dict(trained.model.state_dict())
    result, want = resumed.train_step(), direct.train_step()
    assert math.isfinite(result["loss"]) and result["loss"] == want["loss"], (result["loss"], want["loss"])


def test_errors_are_reported_not_raised(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "not a megatron-fp4 checkpoint" in capsys.readouterr().err


def test_crafted_checkpoints_are_refused_by_inspect(tmp_path, capsys):
    from tests.unit.test_checkpoint_safety import RunsCode, dcp_step, save

    marker = tmp_path / "pwned"
    save(tmp_path / "single", 1, payload=RunsCode(marker))
    assert main(["inspect", str(tmp_path / "single")]) == 2
    assert "holds objects other than tensors" in capsys.readouterr().err
    import pickle
    dcp_step(tmp_path / "dcp", 1, metadata=pickle.dumps(RunsCode(marker)))
    assert main(["inspect", str(tmp_path / "dcp")]) == 2
    assert "system, which DCP metadata never holds" in capsys.readouterr().err
    assert not marker.exists()


def test_meta_without_model_section_is_a_clear_error(tmp_path, capsys):
    from megatron_fp4.training import checkpoint as ckpt
    from tests.unit.test_checkpoint_safety import save

    step_dir = save(tmp_path, 1)
    meta = ckpt.read_meta(step_dir)
    ckpt.write_meta(step_dir, {k: v for k, v in meta.items() if k not in ("files", "meta_sha256", "config")},
                    meta["files"])
    assert main(["inspect", str(tmp_path)]) == 2
    assert "has no config.model section" in capsys.readouterr().err


def test_overwrite_message_names_the_cli_flag(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("x")
    assert main(["to-hf", str(tmp_path / "missing"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "pass --overwrite" in err and "overwrite=True" not in err
    assert (tmp_path / "hf" / "keep.txt").exists()
