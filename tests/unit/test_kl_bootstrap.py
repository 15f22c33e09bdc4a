"""The KL's sampling noise: per-request KL from `rescore`, the paired request bootstrap
(`kl_bootstrap`), the ordering decided beyond the noise (`kl_order`) and the vLLM goal benchmark's
verdict per (seed, scope) (`bench_vllm_goals.kl_verdict`), against float64 (numpy) references."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_fp4.rollout.consistency import kl_bootstrap, kl_order, kl_tokens

RNG = np.random.default_rng(0)


def _bench():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_vllm_goals
    return bench_vllm_goals


def test_rescore_reports_each_requests_kl_summed_over_its_tokens():
    """`kl_per_request[i]` is request i's exact KL summed over its tokens (numpy float64 reference
    from the two sides' distributions), and the token-weighted mean of them is the reported KL."""
    from megatron_fp4.rollout import score
    from megatron_fp4.rollout.consistency import rescore
    from tests.unit.test_consistency_metrics import PROMPTS as prompts
    from tests.unit.test_consistency_metrics import bf16_rollout_and_fp4_scorer

    gen, model = bf16_rollout_and_fp4_scorer(return_routing=False)
    flat = {k: getattr(gen, k) for k in ("prompt_ids", "response_ids", "log_probs", "distributions")}
    m = rescore(model, flat, 0, "fp4", batch_size=2, reverse=True)
    train = score(model, prompts, gen.response_ids, 0, "fp4", return_distributions=True)
    want = []
    for p, q in zip(gen.distributions, train["distributions"]):
        p, q = p.double().numpy(), q.double().numpy()
        want.append(float((np.exp(p) * (p - q)).sum()))
    assert m["tokens_per_request"] == [len(r) for r in gen.response_ids]
    assert m["kl_per_request"] == pytest.approx(want, rel=1e-9, abs=1e-15)
    assert sum(m["kl_per_request"]) / sum(m["tokens_per_request"]) == pytest.approx(m["kl"], rel=1e-12)
    assert m["kl"] > 0  # the bf16 rollout: a real gap


def test_kl_tokens_k3_matches_numpy():
    a, b = RNG.normal(size=30), RNG.normal(size=30)
    log_r = b - a
    assert kl_tokens(torch.tensor(a), torch.tensor(b)).numpy() == pytest.approx(np.exp(log_r) - 1 - log_r, abs=1e-12)


def test_bootstrap_se_of_iid_requests_is_the_standard_error_of_the_mean():
    """One token per request, iid: the bootstrap s.e. is s·sqrt((n-1)/n)/sqrt(n) up to its own
    Monte Carlo error (~1/sqrt(2·resamples) = 1.1 % relative at 4000)."""
    x = RNG.exponential(2e-3, size=400)
    reps = kl_bootstrap([x.tolist(), (2 * x).tolist()], [[1] * 400] * 2, resamples=4000, seed=1)
    assert reps.shape == (4000, 2)
    want = x.std() / np.sqrt(400)  # numpy's std is the plug-in (ddof=0) one the bootstrap estimates
    assert float(reps[:, 0].std()) == pytest.approx(want, rel=0.05)
    assert float(reps[:, 1].std()) == pytest.approx(2 * want, rel=0.05)


def test_bootstrap_resamples_requests_and_weights_by_tokens():
    """Request 0: 1 token of KL 0; request 1: 3 tokens of KL 1 each. A resample of requests gives
    the ratio of sums: {0, 0}: 0, {1, 1}: 1, {0, 1}: 3/4 (a mean of per-request means would give 1/2)."""
    reps = kl_bootstrap([[0.0, 3.0], [0.0, 3.0]], [[1, 3], [1, 3]], resamples=200, seed=0)
    vals = set(round(v, 12) for v in reps[:, 0].tolist())
    assert vals <= {0.0, 0.75, 1.0} and 0.75 in vals


def test_order_is_paired_and_unresolved_within_the_noise():
    """A constant per-request shift 7x below each setting's own s.e. is resolved (the settings ran
    the same requests: paired); a shift under the spread of the paired differences is not."""
    n = 200
    base = RNG.exponential(1e-2, size=n)  # s.e. of each setting ~7e-4
    shift = 1e-4
    reps = kl_bootstrap([base.tolist(), (base + shift).tolist(), base.tolist()], [[1] * n] * 3, resamples=2000)
    assert float(reps.std(0)[0]) > 5 * shift  # unpaired, the shift would be lost in the noise
    assert kl_order(reps) == ["<", ">"]
    alt = 2e-3 * np.where(np.arange(n) % 2 == 0, 1.0, -1.0)  # paired differences: mean -shift, s.e. 1.4e-4
    reps = kl_bootstrap([(base + shift).tolist(), (base + alt).tolist()], [[1] * n] * 2, resamples=2000)
    diff = reps[:, 1] - reps[:, 0]
    assert kl_order(reps) == ["?"] and float(diff.quantile(0.025)) < 0 < float(diff.quantile(0.975))
    flat = kl_bootstrap([[1e-3] * 10, [1e-3] * 10], [[4] * 10] * 2, resamples=100)
    assert kl_order(flat) == ["?"]  # equal settings: never an order


def test_bootstrap_rejects_bad_shapes():
    with pytest.raises(ValueError, match="kl_bootstrap"):
        kl_bootstrap([[1.0, 2.0]], [[1, 1, 1]])
    with pytest.raises(ValueError, match="kl_bootstrap"):
        kl_bootstrap([[1.0]], [[1]])


def _metrics(kls: list) -> dict:
    return {f"s{i}": {"kl": float(np.mean(k)), "kl_per_request": list(k), "tokens_per_request": [1] * len(k)}
            for i, k in enumerate(kls)}


def test_bench_verdict_needs_the_order_resolved_beyond_the_noise():
    """The goal benchmark's verdict per (seed, scope): point estimates in the paper's order are not
    enough (the old rows said 'yes' for them); the verdict is 'yes' only when both steps are
    resolved, 'no' when one is resolved the wrong way, else 'unresolved'."""
    kl_verdict = _bench().kl_verdict
    n = 64
    base = RNG.exponential(1e-3, size=n)
    noise = 5e-3 * np.where(np.arange(n) % 2 == 0, 1.0, -1.0)
    noisy = base + 4e-3 + noise + 1e-4  # point estimate above base + 4e-3, paired difference within the noise
    names = ["s0", "s1", "s2"]
    kl, se, step_se, order, verdict = kl_verdict(_metrics([base, base + 4e-3, noisy]), names, 2000, 0)
    assert kl[0] < kl[1] < kl[2] and order == ["<", "?"] and verdict == "unresolved"
    assert se[2] > se[0] and step_se[0] == pytest.approx(0, abs=1e-12)  # a constant paired step has no noise
    assert step_se[1] == pytest.approx(5e-3 / np.sqrt(n), rel=0.1)  # the ±5e-3 paired differences
    assert kl_verdict(_metrics([base, base + 4e-3, base + 8e-3]), names, 2000, 0)[3:] == (["<", "<"], "yes")
    assert kl_verdict(_metrics([base, base + 8e-3, base + 4e-3]), names, 2000, 0)[3:] == (["<", ">"], "no")


def test_consistency_report_table_gives_the_kl_with_its_standard_error():
    from tools.consistency_report import COLUMNS, markdown

    x = RNG.exponential(1e-3, size=400)
    row = {"gap": "g", "scope": "experts", "setting": "s", "train_mode": "fp4", "rollout_mode": "fp4", "num_tokens": 400,
           **{c: 0.5 for c in COLUMNS}, "kl": float(x.mean()), "kl_per_request": x.tolist(),
           "tokens_per_request": [1] * 400}
    line = [ln for ln in markdown([row]).splitlines() if ln.startswith("| experts")][0]
    kl_cell = line.split("|")[1 + 4 + COLUMNS.index("kl")].strip()
    value, se = kl_cell.split(" ± ")
    assert float(value) == pytest.approx(x.mean(), rel=5e-3)
    assert float(se) == pytest.approx(x.std() / np.sqrt(400), rel=0.1)
    assert " ± " not in markdown([{k: v for k, v in row.items() if k != "kl_per_request"}])


@pytest.mark.parametrize("flags", [["--kl-prompts", "1"], ["--kl-resamples", "0"]])
def test_bench_rejects_kl_samples_too_small_for_an_error(flags, capsys):
    with pytest.raises(SystemExit) as e:
        _bench().main(["--only", "kl", *flags])
    assert e.value.code == 2 and "--kl-prompts must be >= 2" in capsys.readouterr().err
