"""Row 4/8 of issue 10: a NaN on ONE rank ends or skips the step identically on every rank.

Two gloo processes, tiny FP4 MoE (experts in NVFP4, so the quantizers' non-finite checks are on
the path), dp2, pp2 (1F1B) and pp2 with the interleaved zero-bubble schedule. On one rank only we inject NaN activations into a layer (forward) or a NaN
gradient out of a layer (backward, which under pp2 crosses to the other stage), or NaN into the
FP4 experts inside a layer (a non-finite FP4 operand: deferred, never raised mid-schedule), with
nan_policy=skip and stop. Every rank must take the same decision, parameters and Adam state must be
bitwise unchanged by a refused step, the next clean step must run (collectives still in step), and
`schedule.max_consecutive_skips` must stop every rank together. `run_distributed`'s timeout turns a
hang into a failure.
"""
import math

import pytest

from tests.distributed.launch import run_distributed
from tests.faults._nan_worker import MODES, nan_guard_worker

pytestmark = [pytest.mark.faults, pytest.mark.distributed]


ZERO_BUBBLE = dict(virtual_stages=2, schedule="interleaved_zero_bubble")  # backward split into input/weight passes


@pytest.mark.parametrize("layout,pp,victim,parallel", [("dp2", 1, 0, {}), ("pp2", 2, 1, {}),
                                                      ("pp2_zero_bubble", 2, 1, ZERO_BUBBLE)])
def test_nan_on_one_rank_is_decided_the_same_on_every_rank(layout, pp, victim, parallel):
    max_skips = 2
    results = run_distributed(nan_guard_worker, 2, args=(pp, victim, max_skips, parallel), timeout_s=240)
    for policy, mode in [(policy, mode) for policy in ("skip", "stop") for mode in MODES]:
        cases = [r["cases"][(policy, mode)] for r in results]
        want = "skipped" if policy == "skip" else "stopped"
        assert [c["decision"] for c in cases] == [want, want], (layout, policy, mode, cases)
        assert all(c["unchanged"] for c in cases), (layout, policy, mode)  # weights and Adam state, bitwise
        assert any(c["tripped_here"] for c in cases), (layout, policy, mode)
        # The batch is consumed on every rank alike (the step counter and data stay in step).
        assert len({str(c["sampler_after"]) for c in cases}) == 1 and cases[0]["sampler_after"] != cases[0]["sampler_before"]
        assert all("rank(s)" in c["message"] and "weights are unchanged" in c["message"] for c in cases)
        if mode == "fp4":  # deferred, with and without a pipeline: no rank raised mid-schedule
            assert "an FP4 operand" in cases[victim]["message"] and "mlp.experts" in cases[victim]["message"], cases
        after = [r["cases"][(policy, mode, "after")] for r in results]
        assert all(math.isfinite(loss) and not skipped for loss, skipped in after), (layout, policy, mode, after)
        assert after[0] == after[1], (layout, policy, mode, after)
    for r in results:
        assert r["cap"] == ["skipped"] * max_skips + ["stopped"], (layout, r["cap"])
