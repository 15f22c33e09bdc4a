"""Rows 8-10 of issue 10: bad config values, out-of-vocabulary data and the CLI's one-line errors.

Each case used to pass validation (and write non-finite weights, or fail later with a traceback).
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_fp4.config import ConfigError, load_config
from megatron_fp4.training.data import DataError, IndexedDatasetWriter, build_dataset

pytestmark = pytest.mark.faults
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("override,field", [
    ("optimizer.lr=inf", "optimizer.lr"), ("optimizer.lr=.nan", "optimizer.lr"),
    ("optimizer.clip_grad=.inf", "optimizer.clip_grad"), ("model.router_aux_loss_coef=nan", "model.router_aux_loss_coef"),
    ("optimizer.eps=-1", "optimizer.eps"), ("optimizer.eps=0", "optimizer.eps"),
    ("model.init_std=-1", "model.init_std"), ("model.rope_theta=0", "model.rope_theta"),
    ("model.norm_eps=0", "model.norm_eps"), ("optimizer.weight_decay=-5", "optimizer.weight_decay"),
    ("logging.log_interval=-3", "logging.log_interval"), ("schedule.max_consecutive_skips=0", "schedule.max_consecutive_skips"),
])
def test_bad_values_are_rejected_naming_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, [override]).validate()


def _tokens_file(tmp_path, kind: str, bad_id: int) -> str:
    tokens = np.arange(200, dtype=np.int32) % 32
    tokens[137] = bad_id
    if kind == "numpy":
        np.save(tmp_path / "t.npy", tokens)
        return str(tmp_path / "t.npy")
    with IndexedDatasetWriter(str(tmp_path / "m"), dtype=np.int32) as writer:
        writer.add_document(tokens)
    return str(tmp_path / "m")


@pytest.mark.parametrize("kind", ["numpy", "megatron"])
@pytest.mark.parametrize("bad_id", [32, 5000, -1])
def test_token_ids_outside_the_vocabulary_are_refused_at_load(tmp_path, kind, bad_id):
    path = _tokens_file(tmp_path, kind, bad_id)
    data = {"kind": kind, "path": path, "num_samples": 0, "max_operand": 9}
    with pytest.raises(DataError, match=r"data\.path=.*model\.vocab_size=32"):
        build_dataset(data, 8, 0, vocab_size=32)
    assert len(build_dataset(data, 8, 0, vocab_size=max(bad_id, 31) + 1 if bad_id >= 0 else None)) > 0


def test_token_range_check_reads_in_chunks(tmp_path):
    from megatron_fp4.training.data.token_datasets import check_token_range

    tokens = np.zeros(1000, dtype=np.int64)
    tokens[999] = 40  # only in the last chunk
    with pytest.raises(DataError, match=r"\[0, 40\]"):
        check_token_range(tokens, 32, "x.npy", chunk=64)
    check_token_range(tokens, 41, "x.npy", chunk=64)


def _cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "megatron_fp4.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


SMALL = ["--set", "model.num_layers=1", "--set", "schedule.seq_len=16", "--set", "schedule.global_batch_size=4",
         "--set", "schedule.micro_batch_size=4", "--set", "logging.progress=false",
         "--set", "logging.tensorboard_dir=null", "--steps", "1"]


def _bad_cases(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model:\n  num_layers: [1, 2\n")
    tokens = _tokens_file(tmp_path, "numpy", 99)
    return [
        (["--config", str(bad_yaml)], str(bad_yaml)),
        (["--set", "optimizer.eps=-1"], "optimizer.eps"),
        (["--set", "model.rope_theta=0"], "model.rope_theta"),
        (["--set", "optimizer.lr=inf"], "optimizer.lr"),
        (SMALL + ["--set", f"checkpoint.load={tmp_path / 'nowhere'}"], str(tmp_path / "nowhere")),
        (SMALL + ["--set", "data.kind=numpy", "--set", f"data.path={tokens}"], "model.vocab_size"),
    ]


def test_cli_reports_user_errors_in_one_line_with_exit_code_2(tmp_path):
    for args, named in _bad_cases(tmp_path):
        proc = _cli(*args, cwd=tmp_path)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr[-2000:])
        assert len(lines) == 1 and "Traceback" not in proc.stderr, (args, proc.stderr[-2000:])
        assert named in lines[0], (args, lines[0])
