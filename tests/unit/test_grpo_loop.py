"""The GRPO loop (`rl.loop.run_grpo`): the rollout correction option reaches the loss (its weights,
checked against a float64 evaluation of the corrected surrogate, and away from the plain-TIS one),
verl's batch metrics are logged, and the GRPO example and the ablation run this one loop."""
import random
import sys
from pathlib import Path

import pytest
import torch

from megatron_fp4.config import default_config_path, load_config
from megatron_fp4.rl import loop, make_rollout, switch_to_rl
from megatron_fp4.rl.algo.rollout_correction import correct_batch, correction_from_args, from_verl_config
from megatron_fp4.rl.tasks.catalog import ArithmeticTask
from megatron_fp4.rollout.scoring import log_probs_from_logits
from megatron_fp4.training.trainer import Trainer
from tests.numerics import gamma

ROOT = Path(__file__).resolve().parents[2]
TINY = ["logging.tensorboard_dir=null", "checkpoint.dir=null", "model.num_layers=1", "model.hidden_size=32",
        "model.num_heads=2", "model.num_kv_heads=1", "model.moe_ffn_hidden_size=32", "model.num_experts=4"]


class LengthTask(ArithmeticTask):
    """Rewards that vary inside every group (the completion's length), so advantages are not 0."""

    def reward(self, item, completion: str) -> float:
        return float(len(completion))


def tiny_run(correction, monkeypatch):
    """Two loop steps on a tiny model; every micro-batch the loss saw, with its policy log-probs."""
    task = LengthTask(eval_size=6, max_operand=9, ops="+", seed=0)
    cfg = load_config(str(default_config_path()),
                      TINY + [f"model.vocab_size={task.tok.vocab_size}"])
    trainer = Trainer(cfg, build_data=False)
    switch_to_rl(trainer, 1e-2, 0.0, 0.0)
    seen = []

    class RecordingLoss(loop.PolicyLoss):
        def loss(self, logits, mb):
            out = super().loss(logits, mb)
            lp, _ = log_probs_from_logits(logits.detach(), mb["input_ids"], mb["response_mask"])
            seen.append((self.tis_cap, self.correction, lp, {k: v.clone() for k, v in mb.items()}, float(out[0].detach())))
            return out
    monkeypatch.setattr(loop, "PolicyLoss", RecordingLoss)
    batches = []
    real = loop.correct_batch
    monkeypatch.setattr(loop, "correct_batch", lambda batch, cfg: (batches.append(batch), real(batch, cfg))[1])
    # two epochs: the second update's policy has moved (ratio != 1), so the surrogate is not 0
    settings = loop.GRPOSettings(steps=2, num_prompts=2, group_size=4, max_new_tokens=4, micro_batch_size=8,
                                 ppo_epochs=2, eval_every=0, correction=correction)
    rollout = make_rollout("engine", trainer, task.tok.pad_id, 1 << 20)
    try:
        run = loop.run_grpo(trainer, task, rollout, settings)
    finally:
        rollout.close()
    return run, seen, batches


def surrogate64(lp, mb, clip_eps=0.2):
    """Per-token clipped surrogate -A·r (r clipped to [1 - eps, 1 + eps], the worse of the two), float64."""
    ratio = (lp.double() - mb["old_log_probs"].double()).exp()
    adv = mb["advantages"].double()[:, None]
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))


def weights64(mb, level: str, cap: float):
    """verl's TIS weights by hand: min(exp(log r), C), log r = old - rollout per token, or its sum
    over the response for the sequence level."""
    mask = mb["response_mask"].double()
    log_r = (mb["old_log_probs"].double() - mb["rollout_log_probs"].double()) * mask
    if level == "sequence":
        log_r = log_r.sum(1, keepdim=True).expand_as(mask)
    return log_r.clamp(-20, 20).exp().clamp(max=cap)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_correction_option_reaches_the_loss(level, monkeypatch):
    """With ``rollout_is=<level>, threshold 0.5`` every weight is min(r, 0.5) = 0.5 (r ~ 1 here), so
    the loss is about half of plain token TIS (cap 2: weight r): an ignored option shows at once.
    Tolerance: the fp32 loss against float64 of the same inputs, each term (ratio, weight, product)
    within a few u of |term| and the masked mean within γ_n of the sum of |terms|."""
    correction = from_verl_config({"rollout_is": level, "rollout_is_threshold": 0.5})
    run, seen, batches = tiny_run(correction, monkeypatch)
    assert len(seen) == 4 and all(cap is None and corr == correction for cap, corr, *_ in seen)
    u = torch.finfo(torch.float32).eps / 2
    for i, (_, _, lp, mb, loss) in enumerate(seen):
        mask = mb["response_mask"].double()
        surr = surrogate64(lp, mb)
        corrected = (surr * weights64(mb, level, 0.5) * mask).sum() / mask.sum()
        plain_tis = (surr * weights64(mb, "token", 2.0) * mask).sum() / mask.sum()
        n = int(mask.sum())
        tol = float((8 * u + gamma(n)) * (surr.abs() * mask).sum() / mask.sum())
        assert abs(loss - float(corrected)) <= tol, (loss, float(corrected), tol)
        if i % 2:  # a moved policy: the test tells the two apart
            assert abs(float(plain_tis) - float(corrected)) > 10 * tol, (float(plain_tis), float(corrected), tol)
    # verl's batch metrics of the same correction, per step, under rollout_corr/
    assert len(batches) == 2
    for h, batch in zip(run.history, batches):
        metrics = correct_batch(batch, correction)
        assert metrics and {k: h[k] for k in metrics} == metrics


def test_without_correction_the_loss_is_token_tis(monkeypatch):
    run, seen, batches = tiny_run(None, monkeypatch)
    assert not batches and not any(k.startswith("rollout_corr/") for k in run.history[0])
    assert all(cap == 2.0 and corr is None for cap, corr, *_ in seen)


def load_example(name):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "examples"))


def test_the_example_and_the_ablation_run_the_one_loop(tmp_path, monkeypatch):
    """Both examples call `rl.loop.run_grpo` (no loop of their own), and the ablation's result for one
    setting and seed is the loop's, bit for bit: the same run called directly gives the same history."""
    grpo, ablation = load_example("grpo_moeresq"), load_example("ablation_moeresq")
    assert grpo.run_grpo is loop.run_grpo and ablation.run_grpo is loop.run_grpo
    for module in (grpo, ablation):  # the loops and evals they used to carry are gone
        assert not {"grpo_loop", "greedy_accuracy", "greedy_eval", "rl_step"} & set(vars(module))
    args = ablation.parse_args([
        "--out", str(tmp_path), "--seeds", "0", "--sft-steps", "2", "--sft-batch", "4", "--steps", "2",
        "--eval-every", "1", "--num-prompts", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-size", "4",
        "--num-train", "24", "--num-test", "4", "--micro-batch-size", "4", *[a for o in TINY[2:] for a in ("--override", o)]])
    tok, train, test = ablation.prepare_data(args)
    state = ablation.sft(args, tok, train, 0)
    calls = []

    def spy(*a, **k):
        calls.append(a)
        return loop.run_grpo(*a, **k)
    monkeypatch.setattr(ablation, "run_grpo", spy)
    setting = ablation.SETTINGS[3]  # MoEResQ both sides
    out = ablation.run_setting(args, tok, train, test, state, 0, setting)
    (trainer, task, rollout, settings), = calls
    assert settings == ablation.settings_of(args) and trainer.cfg.schedule.seed == 0

    # the same run by hand: a fresh trainer from the SFT state, the setting's rollout and task
    cfg = ablation.make_config(args, tok, 0, setting[1], setting[2], args.lr, args.steps)
    cfg.optimizer.min_lr, cfg.optimizer.weight_decay, cfg.schedule.warmup_steps = args.lr, 0.0, 0
    cfg.model.router_aux_loss_coef = cfg.model.router_z_loss_coef = 0.0
    trainer = Trainer(cfg, build_data=False)
    trainer.model.load_state_dict(state)
    rollout = loop.EngineCopyRollout(trainer, tok.pad_id, setting[2], torch.bfloat16, "standard")
    task = type(task)(tok, train, test, range(len(test)), range(len(train)), random.Random("ablation-rl:0"),
                      args.max_new_tokens)
    try:
        direct = loop.run_grpo(trainer, task, rollout, settings)
    finally:
        rollout.close()
    assert [(s, a) for s, a, _ in direct.evals] == out["evals"]
    assert [(s, g) for s, _, g in direct.evals] == out["eval_groups"]
    assert [h["loss"] for h in direct.history] == [h["loss"] for h in out["history"]]
    for h, mine in zip(direct.history, out["history"]):
        assert {k: h[f"consistency/{k}"] for k in ablation.CONSISTENCY} == {k: mine[k] for k in ablation.CONSISTENCY}


@pytest.mark.parametrize("flags, message", [
    (["--rollout-is", "token", "--rollout-is-threshold", "abc"], "--rollout-is-threshold='abc' is not a number"),
    (["--rollout-rs", "token_k1"], "--rollout-rs is set but rollout_rs_threshold is not"),
    (["--rollout-rs", "nope", "--rollout-rs-threshold", "1"], "--rollout-rs option 'nope' must be one of")])
def test_bad_rollout_correction_flags_are_one_line_and_exit_2(flags, message, capsys):
    for module in (load_example("grpo_moeresq"), load_example("ablation_moeresq")):
        with pytest.raises(SystemExit) as exit_info:
            module.parse_args(flags)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err.splitlines()[-1]
    args = load_example("grpo_moeresq").parse_args(["--rollout-is", "sequence", "--rollout-is-threshold", "0.5_2"])
    corr = correction_from_args(args)  # MIS: 'lower_upper'
    assert (corr.level, corr.mode, corr.threshold, corr.lower_threshold) == ("sequence", "mask", 2.0, 0.5)


@pytest.mark.parametrize("field, value", [("steps", 0), ("group_size", 0), ("ppo_epochs", 0), ("eval_every", -1)])
def test_settings_refuse_what_the_loop_cannot_run(field, value):
    with pytest.raises(ValueError, match=f"GRPOSettings.{field}={value} must be"):
        loop.GRPOSettings(**{field: value})
