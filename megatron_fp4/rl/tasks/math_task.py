"""A generated GSM8K-style word-problem set in verl's format, and a tokenizer trained on it.

Nothing is downloaded: problems are drawn from templates with ``random.Random`` seeded by a string
(same problems on every platform), answers are computed, and rows are laid out as verl's
``examples/data_preprocess/gsm8k.py`` writes GSM8K: a chat ``prompt`` ending in the instruction to
give the final answer after ``####``, ``reward_model.ground_truth`` the number as a string. The
reference solution (``extra_info.answer``) is ``"12+7=19\\n#### 19"``: the SFT target.

    write_math_dataset("data/arith", num_train=2000, num_test=200)   # train.parquet, test.parquet
    build_math_tokenizer("data/arith/tokenizer")                      # BPE + ChatML template

Train and test problems never overlap (the test split is drawn first; train skips its questions).
"""
from __future__ import annotations

import random
from pathlib import Path

from megatron_fp4.rl.tasks.rl_dataset import write_parquet

__all__ = ["DATA_SOURCE", "INSTRUCTION", "make_math_problem", "math_rows", "write_math_dataset",
           "build_math_tokenizer", "sft_text", "disjoint_splits"]

DATA_SOURCE = "megatron_fp4/arith_gsm8k"
INSTRUCTION = ' Give the final answer after "####".'
NAMES = ("Tom", "Ann", "Lee", "Mia", "Sam", "Eva")
ITEMS = ("apples", "pens", "coins", "books", "cards", "eggs")
# (question template, op): a and b are drawn with a >= b for '-'.
TEMPLATES = (
    ("{name} has {a} {item} and gets {b} more. How many {item} does {name} have?", "+"),
    ("{name} had {a} {item} and gave away {b}. How many {item} are left?", "-"),
    ("A box holds {a} {item}. {name} adds {b}. How many {item} are in the box?", "+"),
    ("{name} needs {a} {item} and has {b}. How many more {item} are needed?", "-"),
)


def make_math_problem(rng: random.Random, max_operand: int = 20) -> dict:
    """One problem: {"question", "answer" (the number as a string), "solution" ('a+b=c\\n#### c')}."""
    if not isinstance(max_operand, int) or max_operand < 1:
        raise ValueError(f"max_operand={max_operand!r} must be an integer >= 1")
    template, op = TEMPLATES[rng.randrange(len(TEMPLATES))]
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    if op == "-" and a < b:
        a, b = b, a
    answer = a + b if op == "+" else a - b
    question = template.format(name=rng.choice(NAMES), item=rng.choice(ITEMS), a=a, b=b)
    return {"question": question, "answer": str(answer), "solution": f"{a}{op}{b}={answer}\n#### {answer}"}


def verl_row(data_source: str, instruction: str, problem: dict, split: str, index: int, **extra) -> dict:
    """A verl RL row (chat prompt, rule-based ground truth, `extra_info`) of a generated problem."""
    return {"data_source": data_source,
            "prompt": [{"role": "user", "content": problem["question"] + instruction}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": problem["answer"]},
            "extra_info": {"split": split, "index": index, "answer": problem["solution"],
                           "question": problem["question"], **extra}}


def _row(problem: dict, split: str, index: int) -> dict:
    return verl_row(DATA_SOURCE, INSTRUCTION, problem, split, index)


def math_rows(num_train: int, num_test: int, seed: int = 0, max_operand: int = 20) -> tuple[list, list]:
    """(train rows, test rows) with distinct questions; the test split does not depend on num_train."""
    space = len(TEMPLATES) * len(NAMES) * len(ITEMS) * (max_operand + 1) ** 2
    if num_train + num_test > space // 2:
        raise ValueError(f"{num_train}+{num_test} problems is too many for max_operand={max_operand} "
                         f"(~{space} distinct questions); raise max_operand or ask for fewer")
    return disjoint_splits(lambda rng: make_math_problem(rng, max_operand), _row, num_train, num_test,
                           f"megatron_fp4.math_task:{seed}")


def disjoint_splits(make_problem, make_row, num_train: int, num_test: int, stream: str) -> tuple[list, list]:
    """(train rows, test rows) of distinct questions: ``make_problem(rng)`` draws from a
    ``random.Random`` seeded by ``f"{stream}:{split}"``; the test split is drawn first, so it does not
    depend on num_train, and the train split skips its questions."""
    seen = set()

    def draw(split: str, num: int) -> list:
        rng, rows = random.Random(f"{stream}:{split}"), []
        while len(rows) < num:
            problem = make_problem(rng)
            if problem["question"] not in seen:
                seen.add(problem["question"])
                rows.append(make_row(problem, split, len(rows)))
        return rows

    test = draw("test", num_test)
    return draw("train", num_train), test


def write_math_dataset(out_dir, num_train: int = 2000, num_test: int = 200, seed: int = 0,
                       max_operand: int = 20) -> dict:
    """Write train.parquet and test.parquet under `out_dir`; returns {"train": path, "test": path}."""
    train, test = math_rows(num_train, num_test, seed, max_operand)
    out = Path(out_dir)
    return {"train": write_parquet(train, out / "train.parquet"), "test": write_parquet(test, out / "test.parquet")}


def sft_text(row: dict, tokenizer) -> tuple[list, list]:
    """(prompt ids, response ids) of a row's reference solution: the chat prompt with the generation
    prompt, then the solution and the eos token (the turn end), as the SFT target."""
    prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True)
    return prompt, tokenizer.encode(row["extra_info"]["answer"], add_special_tokens=False) + [tokenizer.eos_id]


def build_math_tokenizer(out_dir, vocab_size: int = 320, seed: int = 0, max_operand: int = 20):
    """Train a byte-level BPE (ChatML template, eos <|im_end|>) on generated problems and their
    solutions and save it HF-style in `out_dir`; returns the loaded `HFTokenizer`."""
    from megatron_fp4.training.data.tokenizer import build_bpe_tokenizer

    train, _ = math_rows(1000, 0, seed=f"tokenizer:{seed}", max_operand=max_operand)
    texts = [r["prompt"][0]["content"] + "\n" + r["extra_info"]["answer"] for r in train]
    texts += ["user", "assistant", "system"]
    return build_bpe_tokenizer(out_dir, texts, vocab_size=vocab_size)
