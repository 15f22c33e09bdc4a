"""examples/ablation_moeresq.py's run bookkeeping: the (setting, TIS) variants, one result file per
(variant, seed) so a cut run resumes, stale files refused, and the same bits for a run whether it
runs alone, again, or beside another run in a second process (--jobs 2).

The tiny task is the word task with operands 0..3 at temperature 0.5, where a 40-step SFT already
samples right and wrong answers in a group, so the GRPO losses are not all 0 (checked below: a run
whose advantages are all 0 would compare nothing)."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import ablation_moeresq as ablation  # noqa: E402

TINY = ["--task", "word", "--max-operand", "3", "--sft-steps", "40", "--sft-batch", "16", "--steps", "3",
        "--eval-every", "1", "--num-prompts", "2", "--group-size", "4", "--temperature", "0.5",
        "--max-new-tokens", "16", "--eval-size", "8", "--num-train", "40", "--num-test", "8",
        "--override", "model.num_layers=1"]


def parse(out, *flags):
    return ablation.parse_args(["--out", str(out), "--seeds", "0", *TINY, *flags])


def bits(out: dict, variant: str) -> list:
    """Every number a run reports, as float.hex: losses, per-step consistency, evals."""
    r, = [r for r in out["runs"] if r["variant"] == variant]
    per_step = [float.hex(float(h[k])) for h in r["history"] for k in ("loss", "reward", *ablation.CONSISTENCY)]
    return per_step + [float.hex(float(acc)) for _, acc in r["evals"]]


def test_a_run_gives_the_same_bits_alone_again_and_beside_another_process(tmp_path):
    v = "FP4 + R3"
    alone = ablation.run(parse(tmp_path / "a", "--settings", v, "--tis", "on"))
    again = ablation.run(parse(tmp_path / "b", "--settings", v, "--tis", "on"))
    both = ablation.run(parse(tmp_path / "c", "--settings", v, "MoEResQ both sides", "--tis", "on", "--jobs", "2"))
    losses = [h["loss"] for h in alone["runs"][0]["history"]]
    assert any(loss != 0 for loss in losses), losses  # the updates really moved the policy
    assert bits(alone, v) == bits(again, v) == bits(both, v)
    sft = [(tmp_path / d / "sft" / "seed0.safetensors").read_bytes() for d in "abc"]
    assert sft[0] == sft[1] == sft[2]
    r3, = alone["runs"]
    assert r3["router_replay"] == "r3" and r3["tis"] is True
    # R3 replays the rollout's routes: the trainer's recorded experts are the rollout's (the last
    # response position routes live, so agreement is at most, not exactly, 1)
    assert min(h["expert_agreement"] for h in r3["history"]) > 0.9


def test_runs_resume_per_result_file_and_refuse_other_flags(tmp_path, monkeypatch):
    first = ablation.run(parse(tmp_path, "--settings", "BF16", "--tis", "both"))
    assert sorted((r["variant"], r["tis"]) for r in first["runs"]) == [("BF16", True), ("BF16, no TIS", False)]
    assert ablation.settings_of(parse(tmp_path), tis=False).tis_cap is None
    files = sorted((tmp_path / "runs").glob("*.json"))
    before = {f: f.read_bytes() for f in files}
    calls, sfts = [], []
    real_run, real_sft = ablation.run_setting, ablation.sft
    monkeypatch.setattr(ablation, "run_setting", lambda *a: calls.append((a[5], a[6][0], a[7])) or real_run(*a))
    monkeypatch.setattr(ablation, "sft", lambda *a: sfts.append(a[3]) or real_sft(*a))
    # seed 1 asked too: only seed 1's two runs (and its SFT) are done, seed 0's files are kept as they were
    second = ablation.run(parse(tmp_path, "--settings", "BF16", "--tis", "both", "--seeds", "0", "1"))
    assert sorted(calls) == [(1, "BF16", False), (1, "BF16", True)] and sfts == [1]
    assert all(f.read_bytes() == b for f, b in before.items()) and len(second["runs"]) == 4
    assert bits(first, "BF16") == bits({"runs": [r for r in second["runs"] if r["seed"] == 0]}, "BF16")
    row, = [r for r in second["rows"] if r["variant"] == "BF16"]
    assert row["seeds"] == [0, 1] and row["stats"]["acc_final"]["n"] == 2
    # a run file made with other flags is refused, naming the flag
    with pytest.raises(ValueError, match=r"--steps=3, this run has 4"):
        ablation.run(parse(tmp_path, "--settings", "BF16", "--tis", "on", "--steps", "4"))
    # --report-only: the table of what finished, the missing runs counted; a broken file is named
    (tmp_path / "runs" / "bf16.seed1.json").unlink()
    calls.clear()
    out = ablation.run(parse(tmp_path, "--settings", "BF16", "--tis", "both", "--seeds", "0", "1", "--report-only"))
    assert not calls and len(out["runs"]) == 3
    assert json.loads((tmp_path / "results.json").read_text())["missing_runs"] == 1
    (tmp_path / "runs" / "bf16.seed0.json").write_text("{half")
    with pytest.raises(ValueError, match=r"bf16.seed0.json: not a run record"):
        ablation.run(parse(tmp_path, "--settings", "BF16", "--tis", "on", "--report-only"))


@pytest.mark.parametrize("flags, message", [(["--settings", "nope"], "--settings 'nope' is not a setting"),
                                            (["--jobs", "0"], "--jobs 0 must be >= 1")])
def test_bad_selection_is_one_line_and_exit_2(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ablation.parse_args(flags)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err.splitlines()[-1]
