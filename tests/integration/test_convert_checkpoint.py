"""tools/convert_checkpoint.py: ours -> HF safetensors -> ours keeps every weight bit for bit; a
checkpoint of the former single-file format upgrades to DCP and resumes bit for bit."""
import math

import pytest
import torch

from megatron_fp4.config import load_config
from megatron_fp4.training.checkpoint import directory as ckpt
from megatron_fp4.training.trainer import Trainer
from tests.integration.test_train import small_cfg
from tools.convert_checkpoint import main


def test_roundtrip_through_hf(tmp_path, capsys):
    cfg = small_cfg(tmp_path, "schedule.train_steps=2", "schedule.warmup_steps=0")
    trained = Trainer(cfg)
    trained.train()
    ckpt_root = tmp_path / "ckpt"
    assert main(["inspect", str(ckpt_root)]) == 0
    assert "kind: dcp  step: 2" in capsys.readouterr().out
    assert main(["to-hf", str(ckpt_root), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").exists()
    assert main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "conv")]) == 0
    conv_cfg = load_config(tmp_path / "conv" / "config.yaml", [f"checkpoint.load={tmp_path / 'conv'}", "checkpoint.dir=null",
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
    from tests.unit.test_checkpoint_safety import RunsCode, dcp_step, legacy_save

    marker = tmp_path / "pwned"
    legacy_save(tmp_path / "single", 1, payload=RunsCode(marker))
    assert main(["inspect", str(tmp_path / "single")]) == 2
    assert "holds objects other than tensors" in capsys.readouterr().err
    import pickle
    dcp_step(tmp_path / "dcp", 1, metadata=pickle.dumps(RunsCode(marker)))
    assert main(["inspect", str(tmp_path / "dcp")]) == 2
    assert "system, which DCP metadata never holds" in capsys.readouterr().err
    assert not marker.exists()


def test_meta_without_model_section_is_a_clear_error(tmp_path, capsys):
    from megatron_fp4.training.checkpoint import directory as ckpt
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


def _legacy_state(trainer) -> dict:
    """The trainer's state as the former single-process format held it: torch AdamW's state dict over
    the params requiring grad, decayed ones first (indices in that order), fp32 masters of non-fp32
    params (none here: an fp32 run), step, sampler, RNG."""
    from megatron_fp4.model.specs import no_weight_decay

    named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    order = [n for n, p in named if not no_weight_decay(n, p)] + [n for n, p in named if no_weight_decay(n, p)]
    per_param = {}
    for k, buf in enumerate(trainer.optimizer.buffers):
        st = trainer.optimizer.adam_state(k)
        for i, name in enumerate(buf.names):
            lo, p = buf.offsets[i], buf.params[i]
            per_param[name] = {"step": torch.tensor(st["step"]),
                               **{key: st[key][lo:lo + p.numel()].view_as(p).clone() for key in ("exp_avg", "exp_avg_sq")}}
    decayed = sum(not no_weight_decay(n, p) for n, p in named)
    groups = [{"params": list(range(decayed)), "weight_decay": trainer.cfg.optimizer.weight_decay},
              {"params": list(range(decayed, len(order))), "weight_decay": 0.0}]
    return {"model": trainer.model.state_dict(), "masters": {}, "step": trainer.step,
            "optimizer": {"state": {i: per_param[name] for i, name in enumerate(order)}, "param_groups": groups},
            "sampler": trainer.sampler.state_dict(), "rng": {"torch": torch.get_rng_state()}}


def test_upgrade_of_the_former_format_resumes_bit_for_bit(tmp_path, capsys):
    from tests.unit.test_checkpoint_safety import legacy_save

    cfg = small_cfg(tmp_path, "schedule.train_steps=4", "schedule.warmup_steps=0", "checkpoint.dir=null",
                    "fp4.grad_rounding=stochastic")
    full = Trainer(cfg)
    full.train(num_steps=2)
    legacy = legacy_save(tmp_path / "old", 2, _legacy_state(full), config=cfg.to_dict())
    tail = [h["loss"] for h in full.train(num_steps=2)]
    resumed = Trainer(cfg)
    with pytest.raises(ckpt.CheckpointError, match="convert_checkpoint.py upgrade"):
        resumed.load_checkpoint(str(legacy))
    assert main(["upgrade", str(tmp_path / "old"), str(tmp_path / "new")]) == 0
    assert "step 2" in capsys.readouterr().out
    assert resumed.load_checkpoint(str(tmp_path / "new")) == 2
    assert [h["loss"] for h in resumed.train(num_steps=2)] == tail  # Adam moments, step, data, RNG: all carried
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
    assert main(["upgrade", str(tmp_path / "old"), str(tmp_path / "new")]) == 2  # never over a checkpoint
