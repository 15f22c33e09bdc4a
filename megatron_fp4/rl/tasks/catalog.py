"""RL tasks for the GRPO loop (`rl.loop.run_grpo`): where prompts come from, how answers are rewarded,
and the fixed held-out set the greedy eval (`rl.evaluate`) decodes.

A task has ``tok`` (``encode``/``decode``/``pad_id``/``vocab_size``), ``stop_token_ids``,
``eval_tokens`` (new tokens of a greedy answer), ``description``, and

- ``sample(num)``: ``num`` RL prompts as items ``(prompt ids, prompt text, reference)``, never an
  eval prompt; the draws come from the task's own RNG (the same on every trainer rank)
- ``eval_items()``: the held-out items, in a fixed order
- ``eval_groups()``: a group name per eval item (or None for an item in no group), or None
- ``reward(item, completion)``: the scalar reward of a decoded completion

Tasks: `ArithmeticTask` (the embedded one-digit corpus, `check_answer`), `DatasetTask` (verl-format
rows, rewards by data_source: `rl.tasks.rewards`), `CarryTask` (the generated carry task of
docs/ablation.md, with its BPE tokenizer and the rows for the SFT warm-up).
"""
from __future__ import annotations

import hashlib
import random
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import torch

from megatron_fp4.rl.tasks import rewards
from megatron_fp4.rl.tasks import carry_task
from megatron_fp4.rl.tasks.rl_dataset import RLDataset
from megatron_fp4.training.data.arithmetic import ArithmeticTokenizer, check_answer, make_problem


def eval_problems(num: int, max_operand: int, ops: str) -> list[tuple[str, str]]:
    """A fixed set of distinct problems (its own seed: the same for every run and seed)."""
    rng, seen = random.Random("grpo:eval"), {}
    space = (max_operand + 1) ** 2 * len(ops)
    while len(seen) < min(num, space // 2):  # leave at least half the problems to RL
        prompt, answer = make_problem(rng, max_operand, ops)
        seen.setdefault(prompt, answer)
    return list(seen.items())


def _check_eval_size(eval_size: int) -> None:
    # RLDataset reads max_samples <= 0 as "every row", and an empty eval set has no accuracy
    if isinstance(eval_size, bool) or not isinstance(eval_size, int) or eval_size < 1:
        raise ValueError(f"eval_size={eval_size!r} must be an integer >= 1 (--eval-size: the held-out greedy-eval "
                         "problems)")


class ArithmeticTask:
    """The embedded task: `a+b=` prompts, reward `check_answer`, a fixed held-out greedy-eval set."""

    def __init__(self, eval_size: int, max_operand: int, ops: str, seed: int):
        _check_eval_size(eval_size)
        self.tok = ArithmeticTokenizer()
        self.max_operand, self.ops = max_operand, ops
        self.stop_token_ids = (self.tok.eos_id,)
        self.held_out = eval_problems(eval_size, max_operand, ops)
        self._held_out_prompts = {p for p, _ in self.held_out}
        self.rng = random.Random(f"grpo:{seed}")
        self.eval_tokens = len(str(2 * max_operand if "*" not in ops else max_operand ** 2)) + 1
        self.description = f"{len(self.held_out)} problems ({ops!r}, operands 0..{max_operand})"
        self.fingerprint = ""

    def sample(self, num: int) -> list:
        problems = []
        while len(problems) < num:
            problem = make_problem(self.rng, self.max_operand, self.ops)
            if problem[0] not in self._held_out_prompts:
                problems.append(problem)
        return [(self.tok.encode(p, add_eos=False), p, None) for p, _ in problems]

    def eval_items(self) -> list:
        return [(self.tok.encode(p, add_eos=False), p, None) for p, _ in self.held_out]

    def eval_groups(self) -> Optional[list]:
        return None

    def reward(self, item, completion: str) -> float:
        return float(check_answer(item[1], completion))


class DatasetTask:
    """verl-format prompts (`RLDataset`) and rewards by data_source (`rl.tasks.rewards`). RL prompts are
    drawn (``rng.choice``) from the rows `pool` of `train`; the greedy eval decodes `eval_rows` of
    `test`. Eval groups: carry / no carry where rows carry ``extra_info.carries`` (the carry task)."""

    def __init__(self, tok, train: RLDataset, test: RLDataset, eval_rows: Sequence[int], pool: Sequence[int],
                 rng: random.Random, eval_tokens: int, source: str = ""):
        if not tok.stop_token_ids:
            raise ValueError(f"{tok.name} has no eos_token: the rollout needs it to stop (tokenizer_config.json)")
        self.tok, self.train, self.test = tok, train, test
        self.stop_token_ids = tok.stop_token_ids
        self.eval_rows, self.pool, self.rng = list(eval_rows), list(pool), rng
        self.eval_tokens = eval_tokens
        self.description = f"{len(self.eval_rows)} held-out prompts of {source}"
        self.fingerprint = ""

    @classmethod
    def from_files(cls, tok, train_data: str, test_data: Optional[str], eval_size: int, max_prompt_length: int,
                   seed: int, eval_tokens: int) -> "DatasetTask":
        """`test_data`'s first `eval_size` rows as the eval set, or (without it) the first `eval_size`
        rows of `train_data`, then never RL prompts."""
        _check_eval_size(eval_size)
        kw = dict(max_prompt_length=max_prompt_length)
        train = RLDataset(train_data, tok, **kw)
        if test_data:
            test = RLDataset(test_data, tok, max_samples=eval_size, **kw)
            eval_rows, pool = range(len(test)), range(len(train))
        else:
            if len(train) <= eval_size:
                raise ValueError(f"--train-data has {len(train)} prompts, not more than --eval-size={eval_size} "
                                 "held out for the greedy eval; lower --eval-size or pass --test-data")
            test, eval_rows, pool = train, range(eval_size), range(eval_size, len(train))
        return cls(tok, train, test, eval_rows, pool, random.Random(f"grpo:{seed}"), eval_tokens,
                   test_data or train_data)

    def _item(self, dataset, i: int):
        row = dataset[i]
        return row["prompt_ids"], self.tok.decode(row["prompt_ids"]), (row["data_source"], dataset.ground_truth(i))

    def sample(self, num: int) -> list:
        return [self._item(self.train, self.rng.choice(self.pool)) for _ in range(num)]

    def eval_items(self) -> list:
        return [self._item(self.test, i) for i in self.eval_rows]

    def eval_groups(self) -> Optional[list]:
        carries = [(self.test.rows[i].get("extra_info") or {}).get("carries") for i in self.eval_rows]
        if all(c is None for c in carries):
            return None
        return [None if c is None else "carry" if c else "no carry" for c in carries]

    def reward(self, item, completion: str) -> float:
        data_source, ground_truth = item[2]
        return float(rewards.compute_score(data_source, completion, ground_truth))


class CarryTask(DatasetTask):
    """Column addition with carries (`rl.tasks.carry_task`): generated verl-format problems and their
    BPE tokenizer (deterministic: every process builds the same; `fingerprint` lets a sharded trainer
    check that), held-out greedy eval on the test split (never RL prompts), and `sft_rows` (the train
    split) for the sloppy teacher's warm-up (`rl.algo.sft`)."""

    def __init__(self, num_digits: int, num_train: int, num_test: int, eval_size: int, max_prompt_length: int,
                 seed: int, eval_tokens: int):
        with tempfile.TemporaryDirectory(prefix="grpo-carry-") as tmp:  # everything is read into memory
            tok = carry_task.build_carry_tokenizer(Path(tmp) / "tokenizer", num_digits=num_digits)
            paths = carry_task.write_carry_dataset(Path(tmp) / "data", num_train, num_test, num_digits=num_digits)
            task = DatasetTask.from_files(tok, str(paths["train"]), str(paths["test"]), eval_size, max_prompt_length,
                                          seed, eval_tokens)
            digest = hashlib.sha256((Path(tmp) / "tokenizer" / "tokenizer.json").read_bytes())
        self.__dict__.update(task.__dict__)
        digest.update(repr([self.test.rows[i]["prompt"] for i in self.eval_rows]).encode())
        self.fingerprint = digest.hexdigest()
        self.sft_rows = self.train.rows
        carrying = sum(self.test.rows[i]["extra_info"]["carries"] > 0 for i in self.eval_rows)
        self.description = (f"{len(self.eval_rows)} held-out carry problems ({num_digits} digits, "
                            f"{carrying} with a carry)")


def check_same_on_every_rank(mesh, fingerprint: str) -> None:
    """Every trainer rank built the same task (tokenizer and eval set: `CarryTask.fingerprint`), or a ValueError."""
    if not mesh.is_distributed or not fingerprint:
        return
    h = int(fingerprint[:15], 16)
    both = torch.tensor([h, -h], dtype=torch.int64, device=mesh.device)
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=mesh.group("world"))
    if both.tolist() != [h, -h]:
        raise ValueError("the trainer ranks generated different carry tasks (tokenizer or eval set); check that "
                         "every rank runs the same tokenizers version")


__all__ = ["ArithmeticTask", "DatasetTask", "CarryTask", "eval_problems", "check_same_on_every_rank"]
