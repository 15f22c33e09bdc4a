"""The CLI's run-level output and guards (issue 17 rows 6-7): a start banner, a final pointer to
the outputs, and a second run on a checkpoint dir in use refused with one line."""
from megatron_fp4.train import EXIT_USER_ERROR, lock_checkpoint_dir, main


def args(tmp_path, *extra):
    sets = ["model.num_layers=2", "schedule.seq_len=32", "schedule.global_batch_size=8", "schedule.micro_batch_size=4",
            "schedule.warmup_steps=0", "logging.progress=false", f"logging.tensorboard_dir={tmp_path / 'tb'}",
            f"checkpoint.dir={tmp_path / 'ckpt'}", "fp4.train_mode=fp4", *extra]
    return [f"--set={kv}" for kv in sets] + ["--steps", "2"]


def test_banner_says_what_runs_and_the_end_says_where_outputs_are(tmp_path, capsys):
    assert main(args(tmp_path)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("megatron-fp4: model ") and "parameters (2 layers, 8 experts top-2, hidden 64)" in out[0]
    assert "FP4 nvfp4 on experts: train fp4, rollout fp4_resq" in out[0]
    assert out[1].startswith("megatron-fp4: world 1 = pp 1 × dp 1 (ep 1, ZeRO-1) on cpu/gloo, fp32; 2 steps")
    assert out[2] == (f"megatron-fp4: checkpoints -> {tmp_path / 'ckpt'} (every 100 steps and at the end, newest 3 "
                      f"kept); tensorboard -> {tmp_path / 'tb'}")
    assert out[-1].startswith(f"megatron-fp4: checkpoints in {tmp_path / 'ckpt'} (resume: --set checkpoint.load=auto")
    assert out[-1].endswith(f"curves: tensorboard --logdir {tmp_path / 'tb'}")


def test_a_checkpoint_dir_in_use_is_refused_and_free_again_after(tmp_path, capsys):
    other_run = lock_checkpoint_dir(str(tmp_path / "ckpt"))
    assert main(args(tmp_path)) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"checkpoint error: checkpoint.dir='{tmp_path / 'ckpt'}' is in use by another run (it holds the "
                   f"directory's lock); give this run its own checkpoint.dir, or wait for that run to end"]
    assert not list((tmp_path / "ckpt").iterdir())  # nothing written, and no lock file left in the dir
    other_run.release()
    assert main(args(tmp_path)) == 0
    assert main(args(tmp_path, "checkpoint.load=auto")) == 0  # the finished run released it too
