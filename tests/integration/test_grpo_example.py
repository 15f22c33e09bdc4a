"""The GRPO example runs a few steps: versions advance, rollout and trainer log-probs are the same
bits at every step, rewards and greedy eval accuracies are check_answer (arithmetic) or the
data_source scorer (carry task, verl parquet) of the decoded completions, the k3 KL is the frozen
reference's, TensorBoard gets scalars; the SFT loss against float64."""
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from megatron_fp4.rl import grpo_advantages, loop
from megatron_fp4.rollout.scoring import log_probs_from_logits
from megatron_fp4.training.data import check_answer

ROOT = Path(__file__).resolve().parents[2]


def load_example():
    spec = importlib.util.spec_from_file_location("grpo_moeresq", ROOT / "examples" / "grpo_moeresq.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def spy_evals(ex, monkeypatch) -> tuple:
    """Record every greedy eval of `ex.run` as (tokenizer, eval items, generation): the items the
    task handed out (`eval_items`) and what the rollout generated for them at temperature 0."""
    items, gens = [], []
    for cls in (ex.ArithmeticTask, ex.CarryTask, ex.DatasetTask):
        def eval_items(self, real=cls.eval_items):
            items.append((self.tok, real(self)))
            return items[-1][1]
        monkeypatch.setattr(cls, "eval_items", eval_items)
    real_make = ex.make_rollout

    def make_rollout(*a, **k):
        rollout = real_make(*a, **k)
        real_generate = rollout.generate

        def generate(prompts, params, **kw):
            out = real_generate(prompts, params, **kw)
            if all(p.temperature == 0 for p in params):
                gens.append(out)
            return out
        rollout.generate = generate
        return rollout
    monkeypatch.setattr(ex, "make_rollout", make_rollout)
    return items, gens


def expected_accuracies(evals) -> list:
    """The greedy accuracy of each recorded eval, recomputed: check_answer (arithmetic) or the
    data_source scorer (rows with a reference) of the decoded greedy completions."""
    from megatron_fp4.rl.tasks import rewards
    items, gens = evals
    assert len(items) == len(gens)
    out = []
    for (tok, its), gen in zip(items, gens):
        assert gen.prompt_ids == [ids for ids, _, _ in its]
        texts = [tok.decode(r, stop_at_eos=True) for r in gen.response_ids]
        scores = [check_answer(it[1], c) if it[2] is None else rewards.compute_score(it[2][0], c, it[2][1])
                  for it, c in zip(its, texts)]
        out.append(sum(s > 0 for s in scores) / len(its))
    return out


def test_grpo_advantages_reference():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]), group_size=3)
    g1 = torch.tensor([1.0, 0, 0])
    ref1 = (g1 - g1.mean()) / (g1.std(unbiased=False) + 1e-6)
    torch.testing.assert_close(adv[:3], ref1)
    g2 = torch.tensor([0.0, 1, 1])
    torch.testing.assert_close(adv[3:], (g2 - g2.mean()) / (g2.std(unbiased=False) + 1e-6))


def test_grpo_example_mechanics(tmp_path, monkeypatch):
    ex = load_example()
    evals = spy_evals(ex, monkeypatch)
    batches, updates = [], []
    real_ppo = loop.ppo_updates  # the example runs the loop of megatron_fp4.rl.loop
    monkeypatch.setattr(loop, "ppo_updates", lambda trainer, batch, *a: (batches.append(batch), real_ppo(trainer, batch, *a))[1])

    class RecordingLoss(loop.PolicyLoss):  # each update's policy log-probs, reference and reported k3
        def loss(self, logits, mb):
            loss, metrics = super().loss(logits, mb)
            lp, _ = log_probs_from_logits(logits.detach(), mb["input_ids"], mb["response_mask"])
            updates.append((lp, mb["ref_log_probs"], mb["response_mask"], metrics["kl"]))
            return loss, metrics
    monkeypatch.setattr(loop, "PolicyLoss", RecordingLoss)
    args = ex.parse_args(["--task", "arithmetic", "--steps", "3", "--sft-steps", "0", "--num-prompts", "3", "--group-size", "3",
                          "--max-new-tokens", "4", "--eval-size", "10", "--eval-every", "2",
                          "--kl-coef", "0.05", "--ppo-epochs", "2", "--minibatches", "2",
                          "--logdir", str(tmp_path / "tb"), "--seed", "1"])
    history = ex.run(args)
    assert [h["rollout_version"] for h in history] == [0, 1, 2]
    assert [h["published_version"] for h in history] == [1, 2, 3] and history[-1]["final_rollout_version"] == 3
    # At every step the rollout serves the weights the trainer then scores with, and both run the
    # batch-invariant numerics (numerics.invariance: batch, the default): the same bits, the same experts.
    assert history[0]["lp_diffs"].numel() > 0 and torch.equal(history[0]["lp_diffs"],
                                                               torch.zeros_like(history[0]["lp_diffs"]))
    for h in history:
        assert (h["consistency/max_abs_diff"], h["consistency/expert_agreement"], h["consistency/kl"]) == (0, 1, 0)
        assert h["rewards"] == [float(check_answer(t, c)) for t, c in zip(h["texts"], h["completions"])]
        assert h["weight_sync/snapshot_s"] > 0 and h["weight_sync/load_s"] > 0
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    assert (tmp_path / "tb" / "reward_curve.png").stat().st_size > 0
    # greedy eval before RL, after step 1 (--eval-every 2) and after the last step: the recomputed accuracies
    assert [("eval_acc" in h) for h in history] == [False, True, True]
    acc = expected_accuracies(evals)
    assert [history[-1]["eval_before"]] + [h["eval_acc"] for h in history if "eval_acc" in h] == acc
    # PPO: 2 epochs x 2 minibatches = 4 optimizer steps per rollout batch; the k3 KL to the SFT
    # policy, frozen: its log-probs are the sampling policy's bits before the first update and
    # differ from the policy's once it moved
    assert len(batches) == 3 and len(updates) == 12 and all(h["num_updates"] == 4 for h in history)
    assert torch.equal(batches[0]["ref_log_probs"], batches[0]["old_log_probs"])
    keep = [b["response_mask"].bool() for b in batches]
    # (with every advantage 0 an update leaves the weights bit-identical: the policy moved after the
    # first batch with a reward signal, and only then; seed 1 has one, so both branches are checked)
    moved = [any(bool(earlier["advantages"].any()) for earlier in batches[:i]) for i in range(len(batches))]
    assert any(moved) and not all(moved), moved
    assert [not torch.equal(b["ref_log_probs"][m], b["old_log_probs"][m]) for b, m in zip(batches, keep)] == moved
    for i, (h, (lp, ref, mask, kl)) in enumerate(zip(history, updates[3::4])):  # each step: its last update's KL
        assert h["kl"] == kl
        assert_k3_matches_float64(lp, ref, mask, kl)
        # after >= 3 optimizer steps the policy is not the reference any more, once a batch had a signal
        assert (kl > 0) == any(bool(b["advantages"].any()) for b in batches[:i + 1]), (i, kl)


def assert_k3_matches_float64(lp, ref, mask, kl):
    """`kl` = mean over response tokens of exp(d) - d - 1, d = ref - lp, by hand in float64.
    fp32: d has one rounding (u·|d|, moving k3 by <= u·|d|·exp(d)), each term exp(d) - d - 1 a
    few more of its parts' magnitude (<= 4u·(exp(d) + |d| + 1)), the masked sum of n terms γ_n of
    Σ k3 (the masked-out zeros add exactly) and the division by n one more u."""
    from tests.numerics import gamma
    m = mask.bool()
    d = (ref.double() - lp.double())[m]
    ref_kl = float((d.exp() - d - 1).mean())
    u, n = torch.finfo(torch.float32).eps / 2, int(m.sum())
    tol = float((4 * u * (d.exp() + d.abs() + 1) + u * d.abs() * d.exp()).mean()) + (gamma(n) + u) * ref_kl
    assert abs(kl - ref_kl) <= tol, (kl, ref_kl, tol)


def test_grpo_example_on_verl_parquet_with_an_hf_tokenizer(tmp_path, monkeypatch):
    """--tokenizer DIR --train-data FILE.parquet: prompts rendered by the tokenizer's chat template,
    rewards by data_source (rl.tasks.rewards), the first --eval-size rows held out of RL."""
    from megatron_fp4.rl.tasks import rewards
    from megatron_fp4.rl.tasks.math_task import build_math_tokenizer, write_math_dataset
    from megatron_fp4.rl.tasks.rl_dataset import RLDataset

    tok = build_math_tokenizer(tmp_path / "tok", max_operand=5)
    paths = write_math_dataset(tmp_path / "data", num_train=12, num_test=2, max_operand=5)
    ex = load_example()
    evals = spy_evals(ex, monkeypatch)
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
    assert [history[-1]["eval_before"], history[-1]["eval_acc"]] == expected_accuracies(evals)
    with pytest.raises(ValueError, match="--sft-steps 0"):
        ex.run(ex.parse_args(["--tokenizer", str(tmp_path / "tok"), "--train-data", str(paths["train"]),
                              "--sft-steps", "5", "--eval-size", "4"]))


def carry_args(ex, *extra):
    return ex.parse_args(["--sft-batch", "4", "--num-prompts", "2", "--group-size", "2", "--max-new-tokens", "8",
                          "--eval-size", "4", "--num-train", "24", "--num-test", "4", "--set", "model.num_layers=1",
                          "--set", "model.hidden_size=32", "--set", "model.num_heads=2",
                          "--set", "model.num_kv_heads=1",
                          "--logdir", "", *extra])


def test_carry_task_is_the_default_and_runs_end_to_end(monkeypatch):
    """`--task carry` (the default): SFT on the sloppy teacher in high precision, GRPO steps with
    the carry scorer's rewards on train prompts only, held-out greedy accuracy before and after."""
    from megatron_fp4.rl.tasks import rewards
    from megatron_fp4.rl.tasks import carry_task

    ex = load_example()
    defaults = ex.parse_args([])
    assert defaults.task == "carry" and (defaults.steps, defaults.sft_steps, defaults.lr, defaults.kl_coef) == \
        (20, 800, 3e-4, 0.0)
    assert ex.parse_args(["--task", "arithmetic"]).sft_steps == 200
    evals = spy_evals(ex, monkeypatch)
    args = carry_args(ex, "--sft-steps", "2", "--steps", "2", "--eval-every", "1")
    history = ex.run(args)
    assert [h["rollout_version"] for h in history] == [0, 1] and history[-1]["final_rollout_version"] == 2
    _, test_rows = carry_task.carry_rows(24, 4)
    held_out = {row["prompt"][0]["content"] for row in test_rows}
    for h in history:
        assert not any(q in t for q in held_out for t in h["texts"])  # RL never samples the eval problems
        assert all(source == carry_task.DATA_SOURCE for source, _ in h["references"])
        assert h["rewards"] == [rewards.compute_score(source, c, truth)
                                for (source, truth), c in zip(h["references"], h["completions"])]
    assert [history[-1]["eval_before"]] + [h["eval_acc"] for h in history] == expected_accuracies(evals)
    assert len(evals[0][0][1]) == 4  # --eval-size 4 held-out problems


def test_carry_sft_learns_the_teacher_in_high_precision():
    """The warm-up runs response NLL with fp4 off, then hands RL the config's train mode; on the
    teacher's solutions (a handful of token patterns) the loss falls well below its start."""
    ex = load_example()
    args = carry_args(ex, "--sft-steps", "40", "--sft-batch", "8", "--sft-lr", "1e-2")
    seen = []
    real = ex.sft_step

    def spy(trainer, *a, **k):
        seen.append(trainer.model.fp4_mode)
        return real(trainer, *a, **k)
    ex.sft_step = spy
    trainer, task = ex.build(args)
    assert seen == ["bf16"] * 40 and trainer.model.fp4_mode == trainer.cfg.fp4.train_mode == "fp4_resq"
    assert len(trainer.model.layers) == 1
    losses = task.sft_losses
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses


def test_response_nll_matches_float64_reference():
    """`rl.ResponseNLL` (the SFT loss) = mean over response tokens of -log softmax, by hand in float64
    from the same logits. Tolerance: fp32 log-softmax is within a few units of roundoff of
    (|logit| + log V) per token, and the mean's fp32 sum within γ_N of Σ|log p| (tests/numerics.py)."""
    from megatron_fp4.config import default_config_path, load_config
    from megatron_fp4.model import build_model
    from megatron_fp4.rl import ResponseNLL
    from megatron_fp4.rollout.engine import pad_prompt_response, positions_from_mask
    from tests.numerics import gamma

    cfg = load_config(str(default_config_path()),
                      ["logging.tensorboard_dir=null", "checkpoint.dir=null", "model.num_layers=1"])
    torch.manual_seed(0)
    model = build_model(cfg)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 30, (n,), generator=g).tolist() for n in (3, 5, 4)]
    responses = [torch.randint(3, 30, (n,), generator=g).tolist() for n in (4, 1, 6)]
    mb = pad_prompt_response(prompts, responses, 0)
    loss, _ = ResponseNLL()(model, mb)
    with torch.no_grad():
        logits = model(mb["input_ids"], positions_from_mask(mb["attention_mask"]), mb["attention_mask"]).logits
    lp = torch.log_softmax(logits.double()[:, :-1], -1).gather(-1, mb["input_ids"][:, 1:, None]).squeeze(-1)
    keep = mb["response_mask"][:, 1:].bool()
    ref = -lp[keep].mean()
    n, u = int(keep.sum()), torch.finfo(torch.float32).eps / 2
    assert n == sum(len(r) for r in responses)
    tol = (16 * u * (float(logits.abs().max()) + math.log(logits.shape[-1]))
           + 2 * gamma(n) * float(lp[keep].abs().mean()))
    loss = float(loss.detach())
    assert abs(loss - float(ref)) <= tol, (loss, float(ref), tol)
