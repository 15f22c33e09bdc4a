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
