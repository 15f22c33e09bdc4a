"""examples/ablation_report.py: the Student-t intervals of the ablation table and its paired contrasts.

References: scipy.stats.t (where installed) and, independently of any library, the classic t-table
value t(0.975, 7) = 2.3646 (8 seeds; e.g. NIST/SEMATECH e-Handbook 1.3.6.7.2, "Critical values of
the Student's t distribution", row df 7, column 0.025 upper tail: 2.365) and t(0.975, 1) =
12.706 — the latter is exact in closed form: the t with 1 df is the Cauchy, quantile tan(pi (p - 1/2)).
"""
import math
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import ablation_report as report  # noqa: E402


def test_t_quantile_matches_closed_form_and_the_table():
    assert abs(report.t_quantile(0.975, 1) - math.tan(math.pi * 0.475)) < 1e-6  # Cauchy: 12.7062...
    assert abs(report.t_quantile(0.975, 7) - 2.3646) < 5e-4  # the printed table's 2.365 (4 digits: 2.3646)
    assert abs(report.t_cdf(0.0, 5) - 0.5) < 1e-15 and abs(report.t_cdf(-2.0, 5) + report.t_cdf(2.0, 5) - 1) < 1e-12


@pytest.mark.parametrize("df", [1, 2, 3, 5, 7, 11, 30, 100])
@pytest.mark.parametrize("p", [0.9, 0.975, 0.995])
def test_t_quantile_matches_scipy(df, p):
    from scipy import stats  # the [test] extra installs it: a missing reference fails, never skips
    assert abs(report.t_quantile(p, df) - stats.t.ppf(p, df)) < 1e-6 * max(1.0, stats.t.ppf(p, df))


def test_mean_ci_is_scipys_t_interval():
    from scipy import stats  # the [test] extra installs it: a missing reference fails, never skips
    xs = [0.81, 0.86, 0.79, 0.90, 0.84, 0.77, 0.88, 0.83]
    ci = report.mean_ci(xs)
    lo, hi = stats.t.interval(0.95, len(xs) - 1, loc=statistics.fmean(xs), scale=stats.sem(xs))
    assert abs(ci["lo"] - lo) < 1e-9 and abs(ci["hi"] - hi) < 1e-9 and ci["n"] == 8
    # by hand: s / sqrt(n) with the sample std, times the table's t(0.975, 7)
    assert abs(ci["half"] - 2.3646 * statistics.stdev(xs) / math.sqrt(8)) < 1e-3 * ci["half"]


def test_mean_ci_edges():
    one = report.mean_ci([0.5, float("nan")])  # NaN dropped, one value: no interval
    assert one["n"] == 1 and one["mean"] == 0.5 and math.isnan(one["half"]) and report.fmt(one) == "0.500"
    assert report.mean_ci([])["n"] == 0 and report.fmt(report.mean_ci([])) == "n/a"
    with pytest.raises(ValueError, match="0.5 < p < 1"):
        report.t_quantile(0.4, 3)


def _run(variant, seed, accs):
    hist = [{"step": i, "reward": 0.5, "loss": 0.0, "pearson": 0.99, "kl": 1e-3 * (1 + seed),
             "expert_agreement": 0.97, "mean_abs_diff": 0.01} for i in range(4)]
    return {"variant": variant, "seed": seed, "evals": [(2 * i, a) for i, a in enumerate(accs)], "history": hist}


def test_paired_contrast_uses_only_shared_seeds_and_differences():
    runs = [_run("A", 0, [0.5, 0.7, 0.9]), _run("A", 1, [0.5, 0.6, 0.8]), _run("A", 2, [0.5, 0.6, 0.7]),
            _run("B", 0, [0.5, 0.6, 0.8]), _run("B", 1, [0.5, 0.6, 0.6])]  # B lacks seed 2
    c = report.paired(runs, "A", "B", "acc_final")
    assert c["n"] == 2 and abs(c["mean"] - 0.15) < 1e-12  # (0.1 + 0.2) / 2
    assert abs(c["half"] - report.t_quantile(0.975, 1) * statistics.stdev([0.1, 0.2]) / math.sqrt(2)) < 1e-9
    m = report.run_metrics(runs[0])
    assert m["acc_sft"] == 0.5 and m["acc_best"] == 0.9 and abs(m["acc_area"] - 0.8) < 1e-12
    assert [c["a"] for c in report.contrasts(runs, [("A", "B"), ("A", "C")])] == ["A"]


def test_overlap_and_excludes_zero():
    a, b, c = report.mean_ci([0.80, 0.82, 0.81]), report.mean_ci([0.70, 0.71, 0.72]), report.mean_ci([0.79, 0.83])
    assert report.overlap(a, b) == "disjoint" and report.overlap(a, c) == "overlap"
    assert report.excludes_zero(report.mean_ci([0.1, 0.12, 0.11])) == "yes"
    assert report.excludes_zero(report.mean_ci([-0.1, 0.12, 0.01])) == "no"
    assert report.excludes_zero(report.mean_ci([0.1])) == "n/a" and report.overlap(a, report.mean_ci([0.8])) == "n/a"
