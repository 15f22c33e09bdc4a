"""Rollout correction against verl 0.9.1's own `rollout_corr_helper` on the same tensors: every IS
level x mode x threshold, every rejection option (alone and chained), verl's presets through its
config fields, the mismatch metrics, and the weights entering the PPO loss as in verl's
`compute_policy_loss_vanilla` (loss and gradient). Our code runs verl's formulas op for op, on the
same dtype, so the results are compared bitwise (NaN equal to NaN); padding is the one place we
differ by design: our weights are 0 there even where the log-probs hold NaN/inf garbage (verl: NaN).
"""
import math

import pytest
import torch

from megatron_fp4.rl.algo.is_correction import (REJECTIONS, Rejection, RolloutCorrection, policy_loss,
                                                rollout_correction, truncated_is_weights)
from megatron_fp4.rl.algo.policy_loss import PolicyLoss
from megatron_fp4.rl.algo.rollout_correction import correct_batch, from_verl_config
from megatron_fp4.rollout.scoring import log_probs_from_logits


def verl_helper():
    from verl.trainer.ppo import rollout_corr_helper  # the [test] extra installs verl: never a skip
    return rollout_corr_helper


def tensors(seed, dtype=torch.float32, spread=0.4, extreme=False):
    """[B, T] old/rollout log-probs in the project's layout (left prompt, right padding, one empty row),
    garbage (NaN, +-inf, huge) at masked positions; `extreme` puts |log r| = 60 and +-inf log r on valid tokens."""
    g = torch.Generator().manual_seed(seed)
    B, T = 7, 10
    old = (torch.randn(B, T, generator=g) * 0.7 - 1.5).to(dtype)
    roll = old + (torch.randn(B, T, generator=g) * spread).to(dtype)
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, (start, n) in enumerate([(2, 8), (2, 3), (3, 7), (2, 0), (4, 1), (2, 6), (5, 5)]):
        mask[i, start:start + n] = 1
    garbage = torch.tensor([math.nan, math.inf, -math.inf, 1e30], dtype=dtype)
    pad = ~mask.bool()
    old[pad] = garbage[torch.arange(int(pad.sum())) % 4]
    roll[pad] = garbage[(torch.arange(int(pad.sum())) + 1) % 4]
    if extreme:
        old[0, 3], roll[0, 3] = -1.0, -61.0  # log r = +60, beyond the +-20 safety bound
        old[2, 4], roll[2, 4] = -61.0, -1.0  # log r = -60
        roll[5, 2] = -math.inf  # log r = +inf (the rollout gave the sampled token zero probability)
        old[6, 6] = -math.inf  # log r = -inf
    return old, roll, mask


def same(a, b):
    return a == b or (math.isnan(a) and math.isnan(b))


def assert_like_verl(ours, verl_out, mask, skip_metrics=()):
    (w, m, met), (vw, vm, vmet) = ours, verl_out
    valid = mask.bool()
    if vw is None:
        assert w is None
    else:
        vw = vw.batch["rollout_is_weights"]
        assert w.dtype == vw.dtype
        torch.testing.assert_close(w[valid], vw[valid], rtol=0, atol=0, equal_nan=True)
        assert not w[~valid].any()
    assert m.dtype == mask.dtype and torch.equal(m, vm.to(m.dtype))
    vmet = {k.removeprefix("rollout_corr/"): v for k, v in vmet.items()}
    assert set(met) == set(vmet), set(met) ^ set(vmet)  # every metric verl reports, no other
    for key, value in met.items():
        if key not in skip_metrics:
            assert same(value, vmet[key]), (key, value, vmet[key])
    assert {"kl", "k3_kl", "ppl_ratio", "chi2_token", "chi2_seq", "log_ppl_diff"} <= set(met)


def verl_run(old, roll, mask, level, is_spec, rs=None, rs_spec=None):
    return verl_helper().compute_rollout_correction_and_rejection_mask(
        old, roll, mask, rollout_is=level, rollout_is_threshold=is_spec, rollout_rs=rs, rollout_rs_threshold=rs_spec)


IS_CASES = [("truncate", 2.0, None), ("truncate", 3.0, None), ("truncate", 0.8, None), ("mask", 2.0, 0.5),
            ("mask", 1.5, 0.6), ("mask", 3.0, None)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode,upper,lower", IS_CASES)
def test_is_weights_match_verl(mode, upper, lower, level, extreme, dtype):
    old, roll, mask = tensors(1, dtype, spread=0.8 if level == "token" else 0.3, extreme=extreme)
    cfg = RolloutCorrection(level=level, mode=mode, threshold=upper, lower_threshold=lower)
    # mask mode without a lower bound is verl's IcePop with a lower bound below exp(-20), the least weight
    spec = upper if mode == "truncate" else f"{lower if lower is not None else 1e-30}_{upper}"
    verl_out = verl_run(old, roll, mask, level, spec)
    ours = rollout_correction(old, roll, mask, cfg, metrics=True)
    # the "low" fractions report against 1 / threshold when there is no lower bound; verl's stand-in has 1e-30
    skip = ("rollout_is_ratio_fraction_low", "rollout_is_seq_fraction_low") if lower is None and mode == "mask" else ()
    assert_like_verl(ours, verl_out, mask, skip)
    if skip:  # ... and verl's TIS run on the same raw weights reports them against 1 / threshold too
        tis = verl_run(old, roll, mask, level, upper)[2]
        assert all(same(ours[2][k], tis["rollout_corr/" + k]) for k in skip)
    uncut = rollout_correction(old, roll, mask, RolloutCorrection(level=level, threshold=1e30))[0]
    cut = int((ours[0] != uncut)[mask.bool()].sum())
    assert 0 < cut < int(mask.sum()) or extreme  # the bounds bite, but not on every token


RS_SPECS = {"k1": [2.0, "0.5_1.5", "0.9_4.0"], "k2": [0.02, 0.5], "k3": [0.02, 0.5]}


@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("option", REJECTIONS)
def test_each_rejection_option_matches_verl(option, extreme):
    old, roll, mask = tensors(2, spread=0.3, extreme=extreme)
    dropped = []
    for spec in RS_SPECS[option[-2:]]:
        upper, lower = (float(spec.split("_")[1]), float(spec.split("_")[0])) if isinstance(spec, str) else (spec, None)
        cfg = RolloutCorrection(level=None, rejection=(Rejection(option, upper, lower),))
        ours = rollout_correction(old, roll, mask, cfg, metrics=True)
        assert_like_verl(ours, verl_run(old, roll, mask, None, None, option, spec), mask)
        dropped.append(int(mask.sum() - ours[1].sum()))
    assert max(dropped) > 0  # some spec rejects something


def test_chained_rejection_with_is_matches_verl():
    old, roll, mask = tensors(3, spread=0.3, extreme=True)
    rules = (Rejection("token_k1", 3.0, 0.4), Rejection("seq_mean_k3", 0.05), Rejection("seq_max_k2", 0.5))
    for level in ("token", "sequence"):
        cfg = RolloutCorrection(level=level, threshold=2.0, rejection=rules)
        verl_out = verl_run(old, roll, mask, level, 2.0, "token_k1,seq_mean_k3,seq_max_k2", "0.4_3.0,0.05,0.5")
        assert_like_verl(rollout_correction(old, roll, mask, cfg, metrics=True), verl_out, mask)
    # a repeated option counts once (verl drops repeats; one threshold is then shared)
    cfg = RolloutCorrection(level=None, rejection=(Rejection("seq_sum_k3", 0.3),) * 2)
    verl_out = verl_run(old, roll, mask, None, None, "seq_sum_k3,seq_sum_k3", 0.3)
    assert_like_verl(rollout_correction(old, roll, mask, cfg, metrics=True), verl_out, mask)


def test_all_weights_masked_gives_zero_sample_size():
    """verl divides by zero here (ZeroDivisionError in compute_is_metrics); the batch step must not crash."""
    old, roll, mask = tensors(1, spread=0.8)
    cfg = RolloutCorrection(level="sequence", mode="mask", threshold=1.0001, lower_threshold=1.0)
    w, _, met = rollout_correction(old, roll, mask, cfg, metrics=True)
    assert not w.any() and met["rollout_is_eff_sample_size"] == 0.0 and met["rollout_is_mean"] == 0.0


def test_verl_presets_through_verl_config_fields():
    H = verl_helper()
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    old, roll, mask = tensors(4, spread=0.2)
    presets = [n for n in vars(RolloutCorrectionConfig) if n.startswith("decoupled_")]
    assert len(presets) >= 8
    for name in presets:
        vcfg = getattr(RolloutCorrectionConfig, name)()
        ours = rollout_correction(old, roll, mask, from_verl_config(vcfg), metrics=True)
        verl_out = H.compute_rollout_correction_and_rejection_mask(
            old, roll, mask, rollout_is=vcfg.rollout_is, rollout_is_threshold=vcfg.rollout_is_threshold,
            rollout_rs=vcfg.rollout_rs, rollout_rs_threshold=vcfg.rollout_rs_threshold)
        assert_like_verl(ours, verl_out, mask)
    with pytest.raises(ValueError, match="bypass_mode"):
        from_verl_config(RolloutCorrectionConfig.bypass_pg_is())
    with pytest.raises(ValueError, match="rollout_is_batch_normalize"):
        from_verl_config(RolloutCorrectionConfig(rollout_is_batch_normalize=True))


def test_mismatch_metrics_of_a_batch_match_verl():
    H = verl_helper()
    old, roll, mask = tensors(5, spread=0.3, extreme=True)
    ours = correct_batch({"old_log_probs": old, "rollout_log_probs": roll, "response_mask": mask}, None)
    want = H.compute_rollout_corr_metrics_from_logprobs(old, roll, mask)
    assert set(ours) == set(want) and len(ours) == 13
    assert all(same(ours[k], want[k]) for k in want), {k: (ours[k], want[k]) for k in want}


class _ActorCfg:
    """What verl's `compute_policy_loss_vanilla` reads from its ActorConfig; clip_ratio_c this large
    turns off verl's dual clip, which the project's loss does not have."""
    clip_ratio, clip_ratio_low, clip_ratio_high, global_batch_info = 0.2, None, None, {}

    def get(self, key, default=None):
        return {"clip_ratio_c": 1e9}.get(key, default)


@pytest.mark.parametrize("cfg,spec", [(RolloutCorrection.tis(1.5), (1.5, None, None)),
                                      (RolloutCorrection("sequence", "mask", 4.0, 0.3,
                                                         (Rejection("seq_mean_k1", 1.3, 0.8),)),
                                       ("0.3_4.0", "seq_mean_k1", "0.8_1.3")),
                                      (RolloutCorrection(None, rejection=(Rejection("token_k3", 0.05),)),
                                       (None, "token_k3", 0.05))])
def test_policy_loss_applies_the_weights_as_verl(cfg, spec):
    """Through the GRPO step loss (`PolicyLoss.loss`, logits in): loss and logits gradient equal to
    verl's vanilla PPO loss fed verl's rollout-IS weights and rejected mask."""
    from verl.trainer.ppo import core_algos
    g = torch.Generator().manual_seed(6)
    _, roll, mask = tensors(6, spread=0.3)
    B, T, V = mask.shape[0], mask.shape[1], 11
    tokens = torch.randint(0, V, (B, T), generator=g)
    logits = torch.randn(B, T, V, generator=g, requires_grad=True)
    lp = log_probs_from_logits(logits, tokens, mask)[0]
    old = torch.where(mask.bool(), lp.detach() + 0.3 * torch.randn(B, T, generator=g), 0.0)
    roll = torch.where(mask.bool(), old + 0.3 * torch.randn(B, T, generator=g), 0.0)
    adv = torch.randn(B, generator=g)
    mb = {"input_ids": tokens, "response_mask": mask, "old_log_probs": old, "rollout_log_probs": roll,
          "advantages": adv}
    loss, metrics = PolicyLoss(clip_eps=0.2, tis_cap=None, correction=cfg).loss(logits, mb)
    grad, = torch.autograd.grad(loss, logits)

    level = None if spec[0] is None else ("token" if cfg.level == "token" else "sequence")
    vw, vmask, _ = verl_run(old, roll, mask, level, spec[0], spec[1], spec[2])
    vw = None if vw is None else vw.batch["rollout_is_weights"]
    vlp = log_probs_from_logits(logits, tokens, mask)[0]
    want, _ = core_algos.compute_policy_loss_vanilla(old, vlp, adv[:, None].expand(B, T), vmask, "token-mean",
                                                     _ActorCfg(), rollout_is_weights=vw)
    want_grad, = torch.autograd.grad(want, logits)
    assert 0 < int(vmask.sum()) and loss.item() != 0
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=0)
    assert ("tis_weight_mean" in metrics) == (cfg.level is not None)
    assert ("rs_masked_fraction" in metrics) == bool(cfg.rejection)


def test_tis_cap_is_token_tis():
    old, roll, mask = tensors(7, spread=0.8)
    old, roll = torch.where(mask.bool(), old, 0.0), torch.where(mask.bool(), roll, 0.0)
    w = truncated_is_weights(old, roll, cap=2.0)
    ref = torch.exp((old.double() - roll.double()).clamp(-20, 20)).clamp(max=2.0)
    torch.testing.assert_close(w.double(), ref, rtol=2 ** -23, atol=0)  # one fp32 exp rounding
    lp = old + 0.1
    a = policy_loss(lp, old, torch.ones_like(old), mask, 0.2, roll, tis_cap=2.0)
    b = policy_loss(lp, old, torch.ones_like(old), mask, 0.2, roll, correction=RolloutCorrection.tis(2.0))
    assert a == b and a[1]["tis_weight_mean"] < 2.0


@pytest.mark.parametrize("kwargs,field", [
    (dict(threshold=-1.0), "RolloutCorrection.threshold"), (dict(threshold=0), "RolloutCorrection.threshold"),
    (dict(threshold=math.nan), "RolloutCorrection.threshold"),
    (dict(threshold=math.inf), "RolloutCorrection.threshold"),
    (dict(threshold=True), "RolloutCorrection.threshold"), (dict(threshold="2"), "RolloutCorrection.threshold"),
    (dict(mode="mask", threshold=1.0, lower_threshold=2.0), "RolloutCorrection.lower_threshold"),
    (dict(mode="mask", lower_threshold=-0.5), "RolloutCorrection.lower_threshold"),
    (dict(lower_threshold=0.5), "RolloutCorrection.lower_threshold"),
    (dict(mode="clip"), "RolloutCorrection.mode"), (dict(level="seq"), "RolloutCorrection.level"),
    (dict(rejection=[Rejection("token_k2", 1.0)]), "RolloutCorrection.rejection"),
    (dict(rejection=(Rejection("token_k2", 1.0), Rejection("token_k2", 2.0))), "RolloutCorrection.rejection"),
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        RolloutCorrection(**kwargs)


@pytest.mark.parametrize("args,field", [
    (("token_k4", 1.0), "Rejection.option"), (("seq_max_k1", 1.0), "Rejection.option"),
    (("token_k2", -1.0), "Rejection.threshold"), (("token_k2", 1.0, 0.5), "Rejection.lower_threshold"),
    (("seq_sum_k1", 2.0, 3.0), "Rejection.lower_threshold"), (("token_k1", 0.5), "Rejection.lower_threshold"),
])
def test_bad_rejection_names_the_field(args, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        Rejection(*args)


def test_bad_loss_and_verl_config_values():
    with pytest.raises(ValueError, match="tis_cap"):
        PolicyLoss(tis_cap=0.0)
    with pytest.raises(ValueError, match="tis_cap=2.0 and correction are both set"):
        PolicyLoss(correction=RolloutCorrection.tis(3.0))
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(torch.zeros(2), torch.zeros(2), cap=-1)
    for fields, match in [(dict(rollout_is="token", rollout_is_threshold="a_2"), "rollout_is_threshold"),
                          (dict(rollout_is="token", rollout_is_threshold="3_2"), "lower_threshold"),
                          (dict(rollout_rs="seq_sum_k9", rollout_rs_threshold=1.0), "rollout_rs option"),
                          (dict(rollout_rs="token_k1"), "rollout_rs_threshold"),
                          (dict(rollout_rs="token_k1,token_k3", rollout_rs_threshold="2,1,1"), "rollout_rs_threshold"),
                          (dict(rollout_is="tokens"), "RolloutCorrection.level"),
                          # not strings: an AttributeError from str.split before (verl's helper: ValueError)
                          (dict(rollout_rs=5, rollout_rs_threshold=1.0), "rollout_rs=5 must be None or a string"),
                          (dict(rollout_rs=["token_k1"], rollout_rs_threshold=1.0), "rollout_rs=\\['token_k1'\\]"),
                          (dict(rollout_rs="token_k1", rollout_rs_threshold=[1.0]), "rollout_rs_threshold")]:
        with pytest.raises(ValueError, match=match):
            from_verl_config(fields)
    with pytest.raises(ValueError, match="must match"):
        rollout_correction(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), RolloutCorrection())


def test_kl_penalty_skips_rejected_tokens():
    """With a rejection rule the reference-KL term, like verl's, averages over the loss mask only."""
    from megatron_fp4.rl.algo.policy_loss import kl_k3
    g = torch.Generator().manual_seed(8)
    _, _, mask = tensors(8)
    B, T, V = mask.shape[0], mask.shape[1], 7
    tokens, logits = torch.randint(0, V, (B, T), generator=g), torch.randn(B, T, V, generator=g)
    lp = log_probs_from_logits(logits, tokens, mask)[0]
    old = torch.where(mask.bool(), lp + 0.2 * torch.randn(B, T, generator=g), 0.0)
    roll = torch.where(mask.bool(), old + 0.4 * torch.randn(B, T, generator=g), 0.0)
    ref = torch.where(mask.bool(), lp + 0.5 * torch.randn(B, T, generator=g), 0.0)
    mb = {"input_ids": tokens, "response_mask": mask, "old_log_probs": old, "rollout_log_probs": roll,
          "advantages": torch.randn(B, generator=g), "ref_log_probs": ref}
    cfg = RolloutCorrection(level=None, rejection=(Rejection("token_k2", 0.02),))
    kept = rollout_correction(old, roll, mask, cfg)[1]
    assert 0 < int(kept.sum()) < int(mask.sum())
    pg = PolicyLoss(0.2, None, 0.0, cfg).loss(logits, mb)[0]
    loss, metrics = PolicyLoss(0.2, None, 0.5, cfg).loss(logits, mb)
    assert metrics["kl"] == float(kl_k3(lp, ref, kept)) != float(kl_k3(lp, ref, mask))
    torch.testing.assert_close(loss, pg + 0.5 * kl_k3(lp, ref, kept), rtol=0, atol=0)


def test_grpo_update_takes_the_correction():
    """`policy_update` with `PolicyLoss(correction=...)` on the tiny trainer: a rule that rejects every
    token moves nothing; sequence MIS that keeps every row trains and reports its weights."""
    from megatron_fp4.rl import policy_update, switch_to_rl
    from tests.unit.test_rl_policy_loss import rl_batch, tiny_trainer
    trainer = tiny_trainer()
    switch_to_rl(trainer, lr=1e-3, weight_decay=0.0, aux_coef=0.0)
    batch = rl_batch(trainer, torch.tensor([1.0, -1.0, 1.0, -1.0]))
    reject_all = RolloutCorrection(level=None, rejection=(Rejection("token_k1", 1.0 + 1e-9, 1.0),))
    result = policy_update(trainer, batch, PolicyLoss(0.2, None, 0.0, reject_all), 2)
    assert result["grad_norm"] == 0.0 and result["rs_masked_fraction"] == 1.0
    keep_all = RolloutCorrection(level="sequence", mode="mask", threshold=1e9, lower_threshold=1e-9)
    result = policy_update(trainer, batch, PolicyLoss(0.2, None, 0.0, keep_all), 2)
    assert result["grad_norm"] > 0 and result["tis_weight_mean"] > 0
