"""The GRPO example runs a few steps: versions advance, rollout and trainer log-probs agree before
the first update, rewards are check_answer of the decoded completions, TensorBoard gets scalars."""
import importlib.util
from pathlib import Path

import pytest
import torch

from megatron_fp4.training.data import check_answer

ROOT = Path(__file__).resolve().parents[2]


def load_example():
    spec = importlib.util.spec_from_file_location("grpo_moeresq", ROOT / "examples" / "grpo_moeresq.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_grpo_advantages_reference():
    ex = load_example()
    adv = ex.grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]), group_size=3)
    g1 = torch.tensor([1.0, 0, 0])
    ref1 = (g1 - g1.mean()) / (g1.std(unbiased=False) + 1e-6)
    torch.testing.assert_close(adv[:3], ref1)
    g2 = torch.tensor([0.0, 1, 1])
    torch.testing.assert_close(adv[3:], (g2 - g2.mean()) / (g2.std(unbiased=False) + 1e-6))


def test_grpo_example_mechanics(tmp_path):
    ex = load_example()
    args = ex.parse_args(["--steps", "3", "--sft-steps", "0", "--num-prompts", "3", "--group-size", "3",
                          "--max-new-tokens", "4", "--eval-size", "10", "--eval-every", "2",
                          "--kl-coef", "0.05", "--ppo-epochs", "2", "--minibatches", "2",
                          "--logdir", str(tmp_path / "tb")])
    history = ex.run(args)
    assert [h["rollout_version"] for h in history] == [0, 1, 2]
    assert [h["published_version"] for h in history] == [1, 2, 3] and history[-1]["final_rollout_version"] == 3
    # before the first update both sides hold the same weights and both run fp4_resq: differences are
    # fp32 noise, amplified by FP4 rounding flips on rare tokens (tests/unit/test_rollout_engine.py)
    d = history[0]["lp_diffs"]
    assert d.median() <= 1e-6 and (d <= 1e-5).double().mean() >= 0.9
    assert history[0]["consistency/pearson"] > 0.999
    for h in history:
        assert h["rewards"] == [float(check_answer(t, c)) for t, c in zip(h["texts"], h["completions"])]
        assert h["weight_sync/snapshot_s"] > 0 and h["weight_sync/load_s"] > 0
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    assert (tmp_path / "tb" / "reward_curve.png").stat().st_size > 0
    # greedy eval before RL, after step 1 (--eval-every 2) and after the last step
    assert [("eval_acc" in h) for h in history] == [False, True, True]
    assert all(0.0 <= h["eval_acc"] <= 1.0 for h in history if "eval_acc" in h)
    assert 0.0 <= history[-1]["eval_before"] <= 1.0
    # PPO: 2 epochs x 2 minibatches = 4 optimizer steps per rollout batch, k3 KL to the SFT policy >= 0
    assert all(h["num_updates"] == 4 and h["kl"] >= 0.0 for h in history)


def test_grpo_example_on_verl_parquet_with_an_hf_tokenizer(tmp_path):
    """--tokenizer DIR --train-data FILE.parquet: prompts rendered by the tokenizer's chat template,
    rewards by data_source (training.rewards), the first --eval-size rows held out of RL."""
    from megatron_fp4.training import rewards
    from megatron_fp4.training.data.math_task import build_math_tokenizer, write_math_dataset
    from megatron_fp4.training.data.rl_dataset import RLDataset

    tok = build_math_tokenizer(tmp_path / "tok", max_operand=5)
    paths = write_math_dataset(tmp_path / "data", num_train=12, num_test=2, max_operand=5)
    ex = load_example()
    args = ex.parse_args(["--tokenizer", str(tmp_path / "tok"), "--train-data", str(paths["train"]), "--steps", "2",
                          "--num-prompts", "2", "--group-size", "3", "--max-new-tokens", "6", "--eval-size", "4",
                          "--eval-every", "0", "--micro-batch-size", "3", "--logdir", ""])
    history = ex.run(args)
    assert args.sft_steps == 0 and [h["rollout_version"] for h in history] == [0, 1]
    data = RLDataset(str(paths["train"]), tok, max_prompt_length=256)
    held_out = {tok.decode(data[i]["prompt_ids"]) for i in range(4)}
    sources = {data[i]["data_source"] for i in range(len(data))}
    for h in history:
        assert not held_out & set(h["texts"])  # RL never samples the eval rows
        assert h["rewards"] == [rewards.compute_score(source, c, truth)
                                for (source, truth), c in zip(h["references"], h["completions"])]
        assert {source for source, _ in h["references"]} <= sources
    assert 0.0 <= history[-1]["eval_acc"] <= 1.0
    with pytest.raises(ValueError, match="--sft-steps 0"):
        ex.run(ex.parse_args(["--tokenizer", str(tmp_path / "tok"), "--train-data", str(paths["train"]),
                              "--sft-steps", "5", "--eval-size", "4"]))
