"""`benchmarks/bench_vllm_goals.py --only kl` end to end on a few requests: vLLM + the plugin samples,
the trainer re-scores; each row's KL is the token-weighted mean of the per-request KLs it saved
(WORK/kl_SEED/kl.json, what its bootstrap resamples) and carries a standard error and the order
decided beyond it. In fp32 the rollout-only control is resolved above plain FP4 (the two sides
compute different functions; plain FP4 is at the fp32 rounding floor).

Runs where vllm imports in this process (the vLLM venv, tools/vllm_env.sh); skips with the reason
otherwise."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from megatron_fp4.integrations.vllm import vllm_available

ROOT = Path(__file__).resolve().parents[2]
VLLM = vllm_available()


@pytest.mark.skipif(not VLLM, reason=f"{VLLM.reason}; the benchmark runs vLLM in this process: run this test in "
                                     "the vLLM environment (tools/vllm_env.sh)")
@pytest.mark.slow
def test_kl_rows_report_kl_with_error_from_the_saved_requests(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_vllm_goals

    n = 6
    rows = bench_vllm_goals.main(["--only", "kl", "--seeds", "1", "--kl-prompts", str(n), "--kl-tokens", "4",
                                  "--kl-scopes", "experts", "--kl-dtype", "float32", "--kl-resamples", "500",
                                  "--work", str(tmp_path)])
    assert len(rows) == 2
    saved = json.loads((tmp_path / "kl_0" / "kl.json").read_text())
    assert set(saved) == {"experts/MoEResQ", "experts/FP4 plain", "experts/rollout-only"}
    for m in saved.values():
        assert m["tokens_per_request"] == [4] * n  # EOS ignored: every request samples all its tokens
        assert sum(m["kl_per_request"]) / (4 * n) == pytest.approx(m["kl"], rel=1e-9, abs=1e-15)
    value = rows[0]["value"]
    pairs = re.findall(r"([-\d.e+]+) ± ([\d.e+-]+)", value)
    assert len(pairs) == 5 and all(float(se) >= 0 for _, se in pairs), value  # 3 KLs, 2 paired steps
    assert [float(k) for k, _ in pairs[:3]] == pytest.approx([saved[k]["kl"] for k in saved], rel=0.01, abs=1e-12)
    assert value.endswith("(<)"), value  # rollout-only above plain FP4, resolved
    assert rows[0]["met"] in ("yes", "unresolved")  # MoEResQ vs plain: both at the fp32 floor
    assert "1 scopes" in rows[1]["measure"] and rows[1]["met"] == "no"  # 1 seed of the goal's 3
