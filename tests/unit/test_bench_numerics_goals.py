"""bench_numerics_goals.py (issue 32's goal table): its parity rows measure the project's property
through the trainer's config-built model, and its table marks each goal from the measured ratios."""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import bench_numerics_goals as goals  # noqa: E402


def test_parity_rows_rollout_vs_scoring_and_training_forward_tiny():
    par = goals.parity("tiny", argparse.Namespace(batch=4, new_tokens=5))
    for mode in ("bf16", "fp4_resq"):
        p = par[mode]
        assert p["tokens"] == 4 * 5
        assert (p["score_bits"], p["train_bits"], p["score_experts"], p["train_experts"]) == (0, 0, 1.0, 1.0), (mode, p)


def test_goal_table_marks_each_goal():
    t = {("gen", "HF"): 1.0}
    # FP4 off meets every goal; fp4_resq misses each one just past its bound
    for key, (std, inv) in {"gen": (0.8, 1.04), "score": (1.0, 1.15), "train": (1.0, 1.1)}.items():
        t[(key, ("bf16", "standard"))], t[(key, ("bf16", "batch"))] = std, inv
    for key, (std, inv) in {"gen": (0.9, 1.26), "score": (1.0, 1.16), "train": (1.0, 1.11)}.items():
        t[(key, ("fp4_resq", "standard"))], t[(key, ("fp4_resq", "batch"))] = std, inv
    par = {"bf16": dict(tokens=8, score_bits=0, train_bits=0, score_experts=1.0, train_experts=1.0),
           "fp4_resq": dict(tokens=8, score_bits=1, train_bits=0, score_experts=1.0, train_experts=0.875)}
    rows = goals.table(["small"], {"small": t}, {"small": par})
    met = {measure: m["small"] for measure, _, _, m in rows}
    value = {measure: v["small"] for measure, v, _, _ in rows}
    off = [k for k in met if k.endswith("FP4 off")]
    resq = [k for k in met if k.endswith("fp4_resq")]
    context = [k for k in met if k.startswith("(")]
    assert len(off) == len(resq) == 6 and len(context) == 2 and all(met[k] == "—" for k in context)
    assert value["(generation, standard kernels vs HF generate(), fp4_resq)"] == "1.11×"
    assert all(met[k] == "yes" for k in off), {k: (value[k], met[k]) for k in off}
    assert all(met[k] == "no" for k in resq), {k: (value[k], met[k]) for k in resq}
    assert value["generation, batch vs HF generate() (speed), fp4_resq"] == "0.79×"
    md = goals.markdown(["small"], rows)
    assert md.count("\n") == len(rows) + 1 and "| 1 / 8, 100% | 0, 100 % | no |" in md


def test_ratios_are_paired_by_round_with_their_range():
    assert goals.paired([1.2, 2.4, 1.26], [1.0, 1.0, 1.0]) == (1.26, 1.2, 2.4)
    # a drift that slows both runners of round 2 alike moves a ratio of medians (1.3), not the paired median
    assert goals.paired([1.2, 2.4, 1.3], [1.0, 2.0, 1.0]) == (1.2, 1.2, 1.3)
    assert goals.paired(1.5, 1.0) == (1.5, 1.5, 1.5)
    for bad in (([1.0], [1.0, 2.0]), ([], [])):
        try:
            goals.paired(*bad)
        except ValueError as err:
            assert "rounds" in str(err)
        else:
            raise AssertionError(f"paired{bad} did not refuse")
    t = {("gen", "HF"): [1.0, 1.0, 1.0]}
    for key in ("gen", "score", "train"):
        for m in ("bf16", "fp4_resq"):
            t[(key, (m, "standard"))] = [1.0, 2.0, 1.0]
            t[(key, (m, "batch"))] = [1.25, 2.1, 1.4]  # paired 1.25, 1.05, 1.4: median 1.25
    par = {m: dict(tokens=8, score_bits=0, train_bits=0, score_experts=1.0, train_experts=1.0)
           for m in ("bf16", "fp4_resq")}
    rows = goals.table(["small"], {"small": t}, {"small": par})
    value = {measure: v["small"] for measure, v, _, _ in rows}
    met = {measure: m["small"] for measure, _, _, m in rows}
    assert value["generation, batch ÷ standard, FP4 off"] == "1.25× (1.05–1.40)"
    assert met["generation, batch ÷ standard, FP4 off"] == "yes"  # the median, not the worst round
    assert met["scoring, batch ÷ standard, FP4 off"] == "no"
    assert value["(generation, standard kernels vs HF generate(), FP4 off)"] == "1.00× (0.50–1.00)"
