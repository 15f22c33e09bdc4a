"""Bad RL settings are refused before any work: the GRPO example's and the ablation's flags (one
line, exit 2, naming the flag), the loop's settings and the policy loss (a ValueError naming the
field) — not a clamp to another objective (clip_eps -1: ratio.clamp(2, 0)), an accuracy over no
problems, or a ZeroDivisionError after the SFT warm-up."""
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_fp4.rl import loop
from megatron_fp4.rl.evaluate import greedy_eval
from megatron_fp4.rl.algo.is_correction import policy_loss
from megatron_fp4.rl.algo.policy_loss import PolicyLoss
from megatron_fp4.rl.tasks.catalog import ArithmeticTask

ROOT = Path(__file__).resolve().parents[2]


def load_example(name):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "examples"))


GRPO_BAD = [(["--minibatches", "0"], "--minibatches 0 must be >= 1"),
            (["--group-size", "0"], "--group-size 0 must be >= 1"),
            (["--lr", "-1"], "--lr -1.0 must be a finite number > 0"),
            (["--bucket-mb", "0"], "--bucket-mb 0 must be >= 1"),
            (["--temperature", "nan"], "--temperature nan must be a finite number >= 0"),
            (["--tis-cap", "-1"], "--tis-cap -1.0 must be a finite number > 0"),
            (["--clip-eps", "-1"], "--clip-eps -1.0 must be a finite number > 0"),
            (["--eval-size", "0"], "--eval-size 0 must be >= 1"),
            (["--drop-carry", "1.5"], "--drop-carry 1.5 must be a probability in [0, 1]"),
            (["--kl-coef", "inf"], "--kl-coef inf must be a finite number >= 0"),
            (["--num-prompts", "2", "--group-size", "2", "--minibatches", "5"],
             "--minibatches 5 is more than the 4 rows of a rollout batch")]


@pytest.mark.parametrize("flags, message", GRPO_BAD)
def test_grpo_example_checks_every_flag_in_the_parser(flags, message, capsys):
    ex = load_example("grpo_moeresq")
    with pytest.raises(SystemExit) as exit_info:
        ex.parse_args(flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and message in err[-1] and "Traceback" not in "\n".join(err)


@pytest.mark.parametrize("flags, message", [(["--clip-eps", "0"], "--clip-eps 0.0 must be a finite number > 0"),
                                            (["--eval-size", "0"], "--eval-size 0 must be >= 1"),
                                            (["--group-size", "0"], "--group-size 0 must be >= 1"),
                                            (["--temperature", "-1"], "--temperature -1.0 must be a finite")])
def test_ablation_checks_its_flags_in_the_parser(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_example("ablation_moeresq").parse_args(flags)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_defaults_still_parse():
    args = load_example("grpo_moeresq").parse_args([])
    assert (args.minibatches, args.eval_size, args.clip_eps) == (1, 128, 0.2)
    assert load_example("grpo_moeresq").parse_args(["--task", "arithmetic", "--temperature", "0"]).minibatches == 2


@pytest.mark.parametrize("kw, message", [
    (dict(clip_eps=-1.0), "clip_eps"), (dict(clip_eps=0.0), "clip_eps"), (dict(clip_eps=math.nan), "clip_eps"),
    (dict(temperature=math.nan), "temperature"), (dict(tis_cap=-1.0), "tis_cap"),
    (dict(kl_coef=-0.1), "kl_coef"), (dict(num_prompts=2, group_size=2, minibatches=5), "minibatches=5")])
def test_loop_settings_refuse_other_objectives(kw, message):
    with pytest.raises(ValueError, match=message):
        loop.GRPOSettings(**kw)


def test_policy_loss_refuses_a_clip_range_that_is_not_one():
    with pytest.raises(ValueError, match="clip_eps"):
        PolicyLoss(clip_eps=-1.0)
    lp = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="clip_eps"):  # the function verl's adapter calls, too
        policy_loss(lp, lp, torch.ones(1, 1), torch.ones(1, 3), clip_eps=-1.0)
    loss, _ = policy_loss(lp, lp, torch.ones(1, 1), torch.ones(1, 3), clip_eps=0.2)
    assert float(loss) == -1.0  # ratio 1, advantage 1: the surrogate -A r


def test_no_eval_problems_is_an_error_not_an_accuracy():
    with pytest.raises(ValueError, match="eval_size=0 must be an integer >= 1"):
        ArithmeticTask(eval_size=0, max_operand=9, ops="+", seed=0)
    empty = SimpleNamespace(eval_items=lambda: [], description="0 problems")
    with pytest.raises(ValueError, match="no eval problems"):
        greedy_eval(None, empty)
