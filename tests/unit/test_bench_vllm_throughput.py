"""`bench_vllm_goals.py`'s throughput rows: the ratios from per-runner seconds, which row carries
issue 32's goal, the model shape named in each row, and the throughput model built at the shape asked."""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_vllm_goals as goals  # noqa: E402
from bench_vllm_engine import build  # noqa: E402

PLUGINS = {"FP4 off, batch": ("none", "batch"), "FP4 off, standard kernels": ("none", "standard"),
           "MoEResQ experts, batch": ("experts", "batch")}


def _args(**kw):
    return argparse.Namespace(**{"tp_family": "qwen3_moe", "clock": "cpu", **kw})


def test_the_goal_row_is_fp4_off_at_batch_over_stock_and_each_row_names_its_shape():
    targs = argparse.Namespace(hidden=1024, experts=64, top_k=8, ffn=384, batch=16, new_tokens=32)
    t = {"stock": 2.0, "FP4 off, batch": 2.5, "FP4 off, standard kernels": 2.2, "MoEResQ experts, batch": 4.0}
    rows = goals.throughput_table(t, PLUGINS, targs, _args())
    by = {r["measure"].split(" (")[0]: r for r in rows}
    goal = by["plugin tokens/s ÷ stock vLLM, FP4 off, batch"]
    assert goal["value"] == "0.80×" and goal["met"] == "yes" and "0.7" in goal["goal"]
    assert by["plugin tokens/s ÷ stock vLLM, MoEResQ experts, batch"]["value"] == "0.50×"
    assert by["plugin tokens/s ÷ stock vLLM, MoEResQ experts, batch"]["met"] == "—"  # no goal of its own
    assert all("hidden 1024, 64 experts top-8 ffn 384" in r["measure"] for r in rows)
    assert "÷ the plugin FP4 off, batch: 0.62×" in by["plugin tokens/s ÷ stock vLLM, MoEResQ experts, batch"]["measure"]
    t["FP4 off, batch"] = 3.0  # 0.67×: below the goal
    assert goals.throughput_table(t, PLUGINS, targs, _args())[0]["met"] == "no"


def test_the_default_shape_keeps_its_old_label():
    targs = argparse.Namespace(hidden=128, experts=8, top_k=2, ffn=256, batch=16, new_tokens=32)
    rows = goals.throughput_table({"stock": 1.0, "FP4 off, batch": 1.0}, {"FP4 off, batch": ("none", "batch")},
                                  targs, _args())
    assert "experts top" not in rows[0]["measure"] and "hidden 128, batch 16, cpu time" in rows[0]["measure"]


def test_the_throughput_model_is_built_at_the_shape_asked():
    targs = argparse.Namespace(vocab=64, hidden=64, layers=1, experts=16, top_k=4, ffn=32, prompt_len=4,
                               new_tokens=4, batch=2)
    cfg, model = build(targs)
    assert (cfg.model.num_experts, cfg.model.top_k, cfg.model.moe_ffn_hidden_size) == (16, 4, 32)
    assert sum(p.numel() for p in model.parameters()) > 0
