"""The carry-addition RL task (rl/tasks/carry_task.py): deterministic by seed, disjoint splits,
working checked line by line against Python integers, the sloppy teacher's rate, rewards."""
import random
import re

import pytest

from megatron_fp4.rl.tasks import rewards
from megatron_fp4.rl.tasks import carry_task
from megatron_fp4.rl.tasks.rl_dataset import RLDataset, read_rows

LINE = re.compile(r"^(\d)\+(\d)(\+1)?=(\d+)$")


def check_working(text: str, a: int, b: int) -> int:
    """Each column line is true arithmetic on the operands' digits; returns the #### number."""
    *lines, final = text.split("\n")
    width = max(len(str(a)), len(str(b)))
    assert len(lines) == width and final.startswith("#### ")
    for k, line in enumerate(lines):
        x, y, plus_one, total = LINE.match(line).groups()
        assert (int(x), int(y)) == ((a // 10 ** k) % 10, (b // 10 ** k) % 10)
        assert int(total) == int(x) + int(y) + bool(plus_one)
    return int(final[5:])


def test_rows_deterministic_by_seed_and_splits_disjoint(tmp_path):
    train, test = carry_task.carry_rows(400, 100, seed=3)
    assert (train, test) == carry_task.carry_rows(400, 100, seed=3)
    assert test == carry_task.carry_rows(5, 100, seed=3)[1]  # the test split does not depend on num_train
    assert carry_task.carry_rows(400, 100, seed=4)[1] != test
    pairs = lambda rows: {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in rows}  # noqa: E731
    assert len(pairs(train)) == 400 and len(pairs(test)) == 100 and not pairs(train) & pairs(test)
    for row in train + test:
        a, b = row["extra_info"]["a"], row["extra_info"]["b"]
        assert 10 <= a <= 99 and 10 <= b <= 99 and row["reward_model"]["ground_truth"] == str(a + b)
        assert row["data_source"] == carry_task.DATA_SOURCE and row["prompt"][0]["role"] == "user"
        assert check_working(row["extra_info"]["answer"], a, b) == a + b
        assert row["extra_info"]["carries"] == int(a % 10 + b % 10 >= 10)
    paths = carry_task.write_carry_dataset(tmp_path, 30, 10, seed=3)
    assert read_rows(paths["train"]) == carry_task.carry_rows(30, 10, seed=3)[0]


def test_three_digit_working_and_carry_count():
    rng = random.Random(0)
    for _ in range(200):
        p = carry_task.make_carry_problem(rng, num_digits=3)
        a, b = p["a"], p["b"]
        assert check_working(p["solution"], a, b) == a + b
        units, tens = a % 10 + b % 10 >= 10, (a // 10) % 10 + (b // 10) % 10 + (a % 10 + b % 10 >= 10) >= 10
        assert carry_task.num_carries(a, b) == units + tens


def test_sloppy_teacher_forgets_carries_at_its_rate():
    rng = random.Random(1)
    problems = [carry_task.make_carry_problem(rng) for _ in range(2000)]
    carrying = [p for p in problems if carry_task.num_carries(p["a"], p["b"])]
    for p in carrying[:200]:
        a, b = p["a"], p["b"]
        assert carry_task.teacher_solution(p, 0.0, rng) == p["solution"]
        sloppy = carry_task.teacher_solution(p, 1.0, rng)
        assert check_working(sloppy, a, b) == a + b - 10  # the unit column's carry is lost
        assert rewards.compute_score(carry_task.DATA_SOURCE, sloppy, p["answer"]) == 0.0
    for p in problems:
        if not carry_task.num_carries(p["a"], p["b"]):
            assert carry_task.teacher_solution(p, 1.0, rng) == p["solution"]  # nothing to forget
    n = len(carrying)
    kept = sum(carry_task.teacher_solution(p, 0.6, rng).split("\n")[1].count("+") == 2 for p in carrying)
    # Binomial(n, 0.4): 5 standard deviations either side fails by chance with probability < 1e-6.
    assert abs(kept - 0.4 * n) < 5 * (n * 0.4 * 0.6) ** 0.5, (kept, n)
    with pytest.raises(ValueError, match="drop_carry"):
        carry_task.teacher_solution(problems[0], 1.5, rng)


def test_rewards_verify_answers():
    row = carry_task.carry_rows(1, 0, seed=0)[0][0]
    truth, solution = row["reward_model"]["ground_truth"], row["extra_info"]["answer"]
    score = lambda text: rewards.compute_score(row["data_source"], text, truth)  # noqa: E731
    assert score(solution) == 1.0
    assert score(solution.replace(f"#### {truth}", f"#### {int(truth) + 1}")) == 0.0
    assert score(solution.replace("#### ", "")) == 0.0  # no final answer line
    assert score(f"#### {int(truth) - 1}\n#### {truth}") == 1.0  # the last #### counts (GSM8K rule)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="num_digits"):
        carry_task.make_carry_problem(random.Random(0), num_digits=0)
    with pytest.raises(ValueError, match="too many"):
        carry_task.carry_rows(4000, 100, num_digits=2)


def test_tokenizer_and_verl_dataset(tmp_path):
    tok = carry_task.build_carry_tokenizer(tmp_path / "tok")
    row = carry_task.carry_rows(1, 0)[0][0]
    ids = tok.encode(row["extra_info"]["answer"], add_special_tokens=False)
    assert tok.decode(ids) == row["extra_info"]["answer"]
    assert all(len(tok.decode([i]).strip("\n+=# ")) <= 1 for i in ids)  # one token per digit
    paths = carry_task.write_carry_dataset(tmp_path / "data", 20, 5)
    data = RLDataset(paths["test"], tok)
    assert len(data) == 5 and data.ground_truth(0) == read_rows(paths["test"])[0]["reward_model"]["ground_truth"]
    assert tok.decode(data[0]["prompt_ids"], skip_special_tokens=False).endswith("<|im_start|>assistant\n")
