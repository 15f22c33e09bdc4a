"""examples/ablation_moeresq.py's run files and cached SFT checkpoints as untrusted input: a file
whose fingerprint matches but whose record is another (variant, seed) — it was counted twice and
hid a missing run — or is not a whole record (accuracy 75.0, no evals, empty history, fingerprint
5) is refused naming the file and the fix; so is a corrupt SFT checkpoint. From the command line
that is one line and exit 2."""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import ablation_moeresq as ablation  # noqa: E402
import ablation_report as report  # noqa: E402

FLAGS = ["--settings", "BF16", "--tis", "on", "--report-only"]


def record(variant="BF16", seed=0, fp=None, accs=(0.5, 0.75)):
    hist = [{"step": i, "reward": 0.5, "loss": 0.1, "pearson": 0.99, "kl": 1e-3, "expert_agreement": 0.97,
             "mean_abs_diff": 0.01} for i in range(2)]
    return {"variant": variant, "seed": seed, "fingerprint": fp if fp is not None else {"steps": 2},
            "history": hist, "evals": [[2 * i, a] for i, a in enumerate(accs)], "eval_groups": []}


def fingerprint_of(argv):
    return report.fingerprint(ablation.parse_args(argv), exclude=ablation.NOT_IN_FINGERPRINT)


def write_runs(out: Path, seeds, records) -> list:
    paths = []
    for s, rec in zip(seeds, records):
        paths.append(report.run_path(out, "BF16", s))
        paths[-1].parent.mkdir(parents=True, exist_ok=True)
        paths[-1].write_text(json.dumps(rec))
    return paths


def test_a_record_of_another_seed_is_refused_not_counted_twice(tmp_path):
    argv = ["--out", str(tmp_path), "--seeds", "0", "1", *FLAGS]
    fp = fingerprint_of(argv)
    # seed 1's file holds seed 0's record (copied over): before, n = 2 with seed 0 twice, seed 1 missing
    _, seed1 = write_runs(tmp_path, [0, 1], [record(seed=0, fp=fp), record(seed=0, fp=fp)])
    with pytest.raises(ValueError, match=f"{seed1}: not a run record .*it holds seed 0, not 1.*delete it to rerun"):
        ablation.run(ablation.parse_args(argv))
    write_runs(tmp_path, [1], [record(variant="BF16, no TIS", seed=1, fp=fp)])
    with pytest.raises(ValueError, match="it holds variant 'BF16, no TIS', not 'BF16'"):
        ablation.run(ablation.parse_args(argv))
    write_runs(tmp_path, [1], [record(seed=1, fp=fp)])  # the right record: tabled, n = 2
    row, = ablation.run(ablation.parse_args(argv))["rows"]
    assert row["seeds"] == [0, 1] and row["stats"]["acc_final"]["n"] == 2


@pytest.mark.parametrize("change, message", [
    (dict(evals=[[0, 0.5], [2, 75.0]]), r"eval \[2, 75.0\] is not \[step, accuracy in \[0, 1\]\]"),
    (dict(evals=[[0, 0.5], [2, True]]), "is not \\[step, accuracy"),
    (dict(evals=None), "no evals"), (dict(evals=[]), "no evals"), (dict(history=[]), "no history"),
    (dict(history=[{"step": 0}]), "lacks a number for 'reward'"),
    (dict(evals=[[1, 0.5]]), "the first eval is at step 1"),
    (dict(eval_groups=[[0, {"carry": 2.0}]]), "eval_groups"),
    (dict(fingerprint=5), "fingerprint 5 is not an object"), (dict(fingerprint=[1]), "fingerprint \\[1\\]")])
def test_malformed_records_name_the_file(tmp_path, change, message):
    path = tmp_path / "runs" / "bf16.seed0.json"
    path.parent.mkdir()
    path.write_text(json.dumps({**record(), **change}))
    with pytest.raises(ValueError, match=f"{path}: not a run record of this example .*{message}"):
        report.load_run(path, {"steps": 2}, "BF16", 0)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="a JSON list, not an object"):
        report.load_run(path, {"steps": 2}, "BF16", 0)
    path.write_text(json.dumps(record()))
    assert report.load_run(path, {"steps": 2}, "BF16", 0)["seed"] == 0


def test_a_corrupt_sft_checkpoint_names_the_file(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file
    path = tmp_path / "sft" / "seed0.safetensors"
    path.parent.mkdir()
    args = SimpleNamespace(sft_fingerprint="fp")
    for body in (b"\x00garbage", b""):
        path.write_bytes(body)
        with pytest.raises(ValueError, match=f"{path}: not a readable SFT checkpoint .*delete it to redo SFT"):
            ablation.sft_state_for(args, None, None, 0, tmp_path)
    save_file({"w": torch.arange(64.0)}, str(path), metadata={"fingerprint": "fp"})
    whole = path.read_bytes()
    assert ablation.sft_state_for(args, None, None, 0, tmp_path)["w"].equal(torch.arange(64.0))
    path.write_bytes(whole[:-8])  # cut short: the header is fine, the data is not all there
    with pytest.raises(ValueError, match=f"{path}: not a readable SFT checkpoint"):
        ablation.sft_state_for(args, None, None, 0, tmp_path)


def test_the_command_line_says_one_line_and_exits_2(tmp_path):
    argv = ["--out", str(tmp_path), "--seeds", "0", *FLAGS]
    path, = write_runs(tmp_path, [0], [{**record(fp=fingerprint_of(argv)), "evals": [[0, 0.5], [2, 75.0]]}])
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "ablation_moeresq.py"), *argv],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "75.0" in lines[0] and "delete it to rerun" in lines[0]
