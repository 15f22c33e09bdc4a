"""Column addition with carries, in verl's format: an RL task where GRPO has something to learn.

A problem is ``"Add 47 and 38."``; the reference solution adds the columns from the right and
writes the carry explicitly, then the answer after ``####`` (the GSM8K convention, so the
``#### <number>`` scorer of `rl.tasks.rewards` checks it)::

    7+8=15
    4+3+1=8
    #### 85

Why this task (docs/ablation.md): RL on a tiny policy raises held-out accuracy only where the
policy already *samples* the right behaviour sometimes and the behaviour is a rule that carries
over to unseen problems. The SFT target comes from a *sloppy teacher* (`teacher_solution`) that
forgets the carry (writes ``4+3=7``, answer 75) with probability ``drop_carry`` — a decision made
at one token per carry column, conditioned on the line above. The SFT policy learns that mixture:
greedy decoding follows the majority (forgets the carry, so it solves only carry-free problems),
while samples carry the one sometimes and are rewarded for it. Held-out exact-match accuracy then
measures whether GRPO learned the *rule* (carry after a two-digit column sum), on problems never
used as RL prompts.

Problems come from ``random.Random`` seeded by a string (the same problems on every platform);
the test split is drawn first and the train split skips its questions, so the two are disjoint.
"""
from __future__ import annotations

import random
from pathlib import Path

from megatron_fp4.rl.tasks.math_task import disjoint_splits, verl_row
from megatron_fp4.rl.tasks.rl_dataset import write_parquet

__all__ = ["DATA_SOURCE", "INSTRUCTION", "make_carry_problem", "column_solution", "teacher_solution",
           "carry_rows", "write_carry_dataset", "build_carry_tokenizer", "num_carries"]

DATA_SOURCE = "megatron_fp4/carry_add"
INSTRUCTION = ' Give the final answer after "####".'


def _digits(n: int, width: int) -> list[int]:
    return [(n // 10 ** k) % 10 for k in range(width)]  # least significant first


def num_carries(a: int, b: int) -> int:
    """Columns that receive a carry when adding `a` and `b` (the sloppy teacher's decision points;
    the carry out of the leftmost column is the answer's leading 1, never forgotten)."""
    carries, carry = 0, 0
    width = max(len(str(a)), len(str(b)))
    for x, y in list(zip(_digits(a, width), _digits(b, width)))[:-1]:
        carry = int(x + y + carry >= 10)
        carries += carry
    return carries


def column_solution(a: int, b: int, forget=lambda column: False) -> str:
    """The column-by-column working for ``a + b``; ``forget(column)`` True drops the carry into that
    column (the sloppy teacher). The last line is ``#### <the sum the working arrives at>``."""
    width = max(len(str(a)), len(str(b)))
    lines, out, carry = [], [], 0
    for column, (x, y) in enumerate(zip(_digits(a, width), _digits(b, width))):
        if carry and forget(column):
            carry = 0
        total = x + y + carry
        lines.append(f"{x}+{y}" + ("+1" if carry else "") + f"={total}")
        out.append(total % 10)
        carry = total // 10
    digits = ([1] if carry else []) + out[::-1]
    return "\n".join(lines) + f"\n#### {int(''.join(map(str, digits)))}"


def teacher_solution(problem: dict, drop_carry: float, rng: random.Random) -> str:
    """The sloppy teacher's SFT target: `column_solution` forgetting each carry with probability
    `drop_carry` (independently per column, drawn from `rng`). 0 gives the reference solution."""
    if not 0.0 <= drop_carry <= 1.0:
        raise ValueError(f"drop_carry={drop_carry!r} must be a probability in [0, 1]")
    return column_solution(problem["a"], problem["b"], lambda column: rng.random() < drop_carry)


def make_carry_problem(rng: random.Random, num_digits: int = 2) -> dict:
    """Two operands of exactly `num_digits` digits: {"a", "b", "question", "answer", "solution"}."""
    if not isinstance(num_digits, int) or not 1 <= num_digits <= 6:
        raise ValueError(f"num_digits={num_digits!r} must be an integer in 1..6")
    lo, hi = (0 if num_digits == 1 else 10 ** (num_digits - 1)), 10 ** num_digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    return {"a": a, "b": b, "question": f"Add {a} and {b}.", "answer": str(a + b),
            "solution": column_solution(a, b)}


def _row(problem: dict, split: str, index: int) -> dict:
    return verl_row(DATA_SOURCE, INSTRUCTION, problem, split, index, a=problem["a"], b=problem["b"],
                    carries=num_carries(problem["a"], problem["b"]))


def carry_rows(num_train: int, num_test: int, seed: int = 0, num_digits: int = 2) -> tuple[list, list]:
    """(train rows, test rows), questions distinct within and across splits; the test split does not
    depend on num_train."""
    size = 10 ** num_digits - (10 ** (num_digits - 1) if num_digits > 1 else 0)
    if num_train + num_test > size * size // 2:
        raise ValueError(f"{num_train}+{num_test} problems is too many for num_digits={num_digits} "
                         f"({size * size} distinct pairs); raise num_digits or ask for fewer")
    return disjoint_splits(lambda rng: make_carry_problem(rng, num_digits), _row, num_train, num_test,
                           f"megatron_fp4.carry_task:{seed}")


def write_carry_dataset(out_dir, num_train: int = 2000, num_test: int = 200, seed: int = 0,
                        num_digits: int = 2) -> dict:
    """Write train.parquet and test.parquet under `out_dir`; returns {"train": path, "test": path}."""
    train, test = carry_rows(num_train, num_test, seed, num_digits)
    out = Path(out_dir)
    return {"train": write_parquet(train, out / "train.parquet"), "test": write_parquet(test, out / "test.parquet")}


def build_carry_tokenizer(out_dir, vocab_size: int = 300, seed: int = 0, num_digits: int = 2):
    """A byte-level BPE (ChatML template, eos ``<|im_end|>``, one token per digit) trained on
    generated problems and both teachers' solutions, saved HF-style in `out_dir`; returns it loaded."""
    from megatron_fp4.training.data.tokenizer import build_bpe_tokenizer

    rows, _ = carry_rows(500, 0, seed=f"tokenizer:{seed}", num_digits=num_digits)
    texts = [r["prompt"][0]["content"] + "\n" + r["extra_info"]["answer"] for r in rows]
    texts += [column_solution(r["extra_info"]["a"], r["extra_info"]["b"], lambda c: True) for r in rows[:100]]
    texts += ["user", "assistant", "system"]
    return build_bpe_tokenizer(out_dir, texts, vocab_size=vocab_size)
