"""Generated math set, verl-format files and rewards (without verl; tests/integration/test_rl_data_verl.py
compares with verl's own dataset class and scorers)."""
import json
import threading

import pytest

from megatron_fp4.rl.tasks import rewards
from megatron_fp4.rl.tasks.math_task import (DATA_SOURCE, build_math_tokenizer, math_rows, sft_text,
                                             write_math_dataset)
from megatron_fp4.rl.tasks.rl_dataset import RLDataset, read_rows, write_parquet


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_math_tokenizer(tmp_path_factory.mktemp("tok"))


def test_generated_set_is_verl_format_deterministic_and_split_disjoint(tmp_path):
    train, test = math_rows(300, 50, seed=1, max_operand=9)
    assert (train, test) == math_rows(300, 50, seed=1, max_operand=9)
    assert test == math_rows(10, 50, seed=1, max_operand=9)[1]  # the test split does not depend on num_train
    assert not {r["extra_info"]["question"] for r in train} & {r["extra_info"]["question"] for r in test}
    for row in train + test:
        solution, truth = row["extra_info"]["answer"], row["reward_model"]["ground_truth"]
        assert row["data_source"] == DATA_SOURCE and row["reward_model"]["style"] == "rule"
        assert rewards.compute_score(DATA_SOURCE, solution, truth) == 1.0  # the reference solution is right
        assert rewards.compute_score(DATA_SOURCE, solution.replace(f"#### {truth}", "#### x"), truth) == 0.0
    paths = write_math_dataset(tmp_path, 20, 5)
    assert read_rows(paths["train"]) == math_rows(20, 5)[0]


def test_rl_dataset_files_filtering_truncation_and_errors(tmp_path, tok):
    train, _ = math_rows(12, 0)
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in train[:6]))
    (tmp_path / "b.json").write_text(json.dumps(train[6:]))
    write_parquet(train, tmp_path / "all.parquet")
    both = RLDataset([tmp_path / "a.jsonl", tmp_path / "b.json"], tok)
    ref = RLDataset(tmp_path / "all.parquet", tok)
    assert [both[i] for i in range(12)] == [ref[i] for i in range(12)]
    item = ref[3]
    assert item["raw_prompt"] == train[3]["prompt"] and item["index"] == 3
    assert item["prompt_ids"] == sft_text(train[3], tok)[0] and item["prompt_ids"][-1] != tok.eos_id
    limit = sorted(len(p) for p in ref.prompt_ids)[5]
    assert len(RLDataset(tmp_path / "all.parquet", tok, max_prompt_length=limit)) == \
        sum(len(p) <= limit for p in ref.prompt_ids) < 12
    assert len(RLDataset(tmp_path / "all.parquet", tok, max_samples=4)) == 4
    short = 8
    left = RLDataset(tmp_path / "all.parquet", tok, max_prompt_length=short, filter_overlong_prompts=False,
                     truncation="left")
    assert left[0]["prompt_ids"] == ref[0]["prompt_ids"][-short:]
    with pytest.raises(ValueError, match="truncation='left'"):
        RLDataset(tmp_path / "all.parquet", tok, max_prompt_length=short, filter_overlong_prompts=False)[0]
    with pytest.raises(ValueError, match="fits max_prompt_length"):
        RLDataset(tmp_path / "all.parquet", tok, max_prompt_length=short)
    bad = dict(train[0], reward_model={"style": "rule"})
    write_parquet([bad], tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="ground_truth"):
        RLDataset(tmp_path / "bad.parquet", tok)
    with pytest.raises(ValueError, match="does not exist"):
        RLDataset(tmp_path / "missing.parquet", tok)
    (tmp_path / "a.csv").write_text("prompt,data_source\n")
    with pytest.raises(ValueError, match="unsupported"):
        RLDataset(tmp_path / "a.csv", tok)


def test_sft_target_ends_with_the_turn_end(tok):
    row = math_rows(1, 0)[0][0]
    prompt, response = sft_text(row, tok)
    assert response[-1] == tok.eos_id and tok.stop_token_ids == (tok.eos_id,)
    assert tok.decode(prompt + response, skip_special_tokens=False).endswith(row["extra_info"]["answer"] + "<|im_end|>")


def test_boxed_answers_and_registry():
    assert rewards.last_boxed("a \\boxed{x} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert rewards.last_boxed("\\boxed{1") is None and rewards.last_boxed("none") is None
    assert rewards.boxed_score("so \\boxed{1,000 dollars}", "1000", use_math_verify=False) == 1.0
    assert rewards.boxed_score("so \\boxed{0.5}", "\\frac{1}{2}", use_math_verify=False) == 0.0
    assert rewards.compute_score("aime2024", "\\boxed{7}", 7) == 1.0  # ground truths may be ints
    with pytest.raises(ValueError, match="no reward function for data_source='nope'"):
        rewards.compute_score("nope", "x", "1")
    rewards.register("my/source", lambda s, gt: float(s.strip() == gt))
    assert rewards.compute_score("my/source", " 4 ", "4") == 1.0
    with pytest.raises(ValueError, match="non-empty string"):
        rewards.register("", rewards.gsm8k_score)


def test_math_verify_equivalence_in_and_off_the_main_thread():
    import math_verify  # noqa: F401 - the test extra installs it (without it boxed_score falls back)
    assert rewards.boxed_score("so \\boxed{0.5}", "\\frac{1}{2}") == 1.0
    assert rewards.boxed_score("so \\boxed{0.6}", "\\frac{1}{2}") == 0.0
    out = []
    worker = threading.Thread(target=lambda: out.append(rewards.boxed_score("\\boxed{2/4}", "\\frac{1}{2}")))
    worker.start()
    worker.join()
    assert out == [1.0]
