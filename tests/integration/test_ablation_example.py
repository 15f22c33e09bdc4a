"""examples/ablation_moeresq.py end to end on a very small run: generated verl parquet + BPE
tokenizer, SFT, GRPO in two settings, table/plot/results written.

The sides really run their own FP4 modes: with an fp32 rollout (no engine gap) BF16 on both sides
differs only by fp32 summation order (KL ~1e-9 on this model, see docs/consistency.md), while
rollout-only compensation computes a different function on each side (KL ~1e-4 measured), so its KL
must exceed BF16's by 100x (a run where the rollout silently used the trainer's mode would give ~1x).
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import ablation_moeresq as ablation  # noqa: E402

from megatron_fp4.rl.tasks.rl_dataset import read_rows  # noqa: E402


def test_ablation_runs_and_sides_use_their_own_modes(tmp_path):
    args = ablation.parse_args([
        "--out", str(tmp_path), "--seeds", "0", "--settings", "BF16", "rollout-only compensation",
        "--sft-steps", "3", "--sft-batch", "8", "--steps", "2", "--eval-every", "1", "--num-prompts", "2",
        "--group-size", "4", "--max-new-tokens", "6", "--eval-size", "8", "--num-train", "40", "--num-test", "8",
        "--rollout-dtype", "fp32", "--tis", "on", "--override", "model.num_layers=1"])
    out = ablation.run(args)
    test_rows = read_rows(tmp_path / "data" / "test.parquet")
    carrying = sum(row["extra_info"]["carries"] > 0 for row in test_rows)
    runs = {r["setting"]: r for r in out["runs"]}
    assert set(runs) == {"BF16", "rollout-only compensation"}
    for r in runs.values():
        assert [s for s, _ in r["evals"]] == [0, 1, 2] and len(r["history"]) == 2
        for (_, acc), (_, groups) in zip(r["evals"], r["eval_groups"]):  # the groups partition the test set
            sizes = {"carry": carrying, "no carry": 8 - carrying}
            assert set(groups) == {g for g, n in sizes.items() if n} and \
                abs(sum(groups[g] * sizes[g] for g in groups) / 8 - acc) < 1e-12
    bf16_kl = max(h["kl"] for h in runs["BF16"]["history"])
    split_kl = min(h["kl"] for h in runs["rollout-only compensation"]["history"])
    assert split_kl > 100 * max(bf16_kl, 1e-9), (bf16_kl, split_kl)
    for name in ("accuracy", "kl", "pearson", "expert_agreement"):
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000
    table = (tmp_path / "table.md").read_text().splitlines()
    assert len(table) == 4 and "rollout-only compensation" in table[-1]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"][0]["setting"] == "BF16" and (tmp_path / "data" / "train.parquet").is_file()
