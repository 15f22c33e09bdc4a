"""verl-format data and rewards through verl's own code: `RLHFDataset`, its chat-template helper and
the rule-based scorers in `verl.utils.reward_score`.

The dataset comparison is exact (same rows, same order, same filtering, same prompt token ids);
the scorers must give the same verdicts on a fixed list of completions that covers the format
cases (several answers, commas, no answer, ``Answer:`` lines, nested braces, unclosed boxes).
"""
import pytest

from megatron_fp4.rl.tasks import rewards
from megatron_fp4.rl.tasks.math_task import build_math_tokenizer, write_math_dataset
from megatron_fp4.rl.tasks.rl_dataset import RLDataset, write_parquet

import verl.utils.dataset.rl_dataset as verl_dataset  # the test extra installs it: a missing package fails, never skips
from omegaconf import OmegaConf  # noqa: E402  (a verl dependency)
from transformers import AutoTokenizer  # noqa: E402
from verl.utils.reward_score import default_compute_score, gsm8k, math_dapo  # noqa: E402
from verl.utils.tokenizer.chat_template import apply_chat_template as verl_apply_chat_template  # noqa: E402
from verl.utils.tokenizer.tokenizer import normalize_token_ids  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    paths = write_math_dataset(root / "data", num_train=40, num_test=8, seed=3)
    tok = build_math_tokenizer(root / "tok")
    # A second file with a foreign row: GSM8K's own layout, a system turn and no extra_info index.
    extra = [{"data_source": "openai/gsm8k", "ability": "math",
              "prompt": [{"role": "system", "content": "Think."}, {"role": "user", "content": "2+2?"}],
              "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {"split": "train"}}]
    return root, paths, tok, write_parquet(extra, root / "extra.parquet")


def test_rl_dataset_matches_verl_rlhf_dataset(data, monkeypatch):
    root, paths, tok, extra = data
    monkeypatch.setenv("HF_DATASETS_CACHE", str(root / "hf_cache"))
    files = [str(paths["train"]), str(extra)]
    lengths = sorted(len(ids) for ids in RLDataset(files, tok, max_prompt_length=10_000).prompt_ids)
    limit = lengths[len(lengths) // 2]  # about half the prompts are longer: filtering must agree
    ours = RLDataset(files, tok, max_prompt_length=limit)
    hf_tok = AutoTokenizer.from_pretrained(str(root / "tok"))
    cfg = OmegaConf.create({"max_prompt_length": limit, "filter_overlong_prompts": True,
                            "filter_overlong_prompts_workers": 1, "cache_dir": str(root / "verl_cache")})
    theirs = verl_dataset.RLHFDataset(files, hf_tok, cfg)
    assert 0 < len(ours) == len(theirs) < len(lengths)
    for i in range(len(theirs)):
        want, got = theirs[i], ours[i]
        for key in ("raw_prompt", "data_source", "reward_model", "index", "tools_kwargs", "interaction_kwargs"):
            assert got[key] == want[key], (i, key)
        assert {k: v for k, v in got["extra_info"].items() if v is not None} == \
            {k: v for k, v in want["extra_info"].items() if v is not None}
        assert got["prompt_ids"] == normalize_token_ids(verl_apply_chat_template(hf_tok, want["raw_prompt"]))
        assert len(got["prompt_ids"]) <= limit


GSM8K_CASES = ["3+4=7\n#### 7", "#### 7 and then #### 8", "#### 1,234", "no answer", "####7", "#### -3",
               "#### 7.", "#### $7", "x" * 400 + "#### 7", "#### 7" + "x" * 400]
GSM8K_TRUTHS = ["7", "8", "1234", "-3", "7."]


def test_gsm8k_score_matches_verl():
    for text in GSM8K_CASES:
        for truth in GSM8K_TRUTHS:
            assert rewards.gsm8k_score(text, truth) == float(gsm8k.compute_score(text, truth)), (text, truth)
            assert rewards.compute_score("openai/gsm8k", text, truth) == \
                float(default_compute_score("openai/gsm8k", text, truth)), (text, truth)


DAPO_CASES = ["so \\boxed{5}", "\\boxed{5} then \\boxed{6}", "Answer: 5", "Answer: 1,000 dollars",
              "\\boxed{\\frac{1}{2}}", "\\boxed{\\frac{1}{2}", "nothing", "Answer: \\boxed{7}", "\\boxed{5 }",
              "y" * 200 + "\\boxed{5}"]
DAPO_TRUTHS = ["5", "6", "1000", "\\frac{1}{2}", "7"]


def test_dapo_score_matches_verl_math_dapo():
    """Same verdict as verl's math_dapo (+1/-1) with math-verify off. One documented difference:
    verl compares a boxed prediction to the ground truth without normalising it; we normalise both
    (so ``\\boxed{5 }`` is right for "5" here and wrong there). Only that case may differ. The
    registry's scorer (0/1, math-verify when installed) accepts everything verl accepts."""
    for text in DAPO_CASES:
        for truth in DAPO_TRUTHS:
            want = math_dapo.compute_score(text, truth)["score"]
            got = rewards.dapo_score(text, truth)
            if text == "\\boxed{5 }" and truth == "5":
                assert (got, want) == (1.0, -1.0)
                continue
            assert got == want, (text, truth)
            assert rewards.compute_score("math_dapo", text, truth) >= (1.0 if want > 0 else 0.0), (text, truth)
