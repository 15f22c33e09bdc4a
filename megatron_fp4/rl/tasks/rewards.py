"""Rule-based math rewards and a registry keyed by ``data_source``, as verl's ``default_compute_score``.

    score = compute_score(row["data_source"], completion_text, row["reward_model"]["ground_truth"])

Scorers (1.0 right, 0.0 wrong; verl's DAPO scorer gives -1 for wrong, ours 0, see `dapo_score`):

- `gsm8k_score`: the last ``#### <number>`` of the completion (strict format, commas and ``$``
  removed, last 300 characters) equals the ground truth string. Same verdict as verl's
  ``reward_score.gsm8k.compute_score`` (tests/integration/test_rl_data_verl.py).
- `boxed_score`: the last ``\\boxed{...}`` (balanced braces), else the last ``Answer: ...`` line
  (Minerva), equivalent to the ground truth: by the ``math-verify`` library where installed
  (``1/2`` = ``0.5`` = ``\\frac{1}{2}``), else by the Minerva/DAPO normalisation and exact match.

Registry: ``openai/gsm8k`` and our generated sets (`math_task.DATA_SOURCE`, `carry_task.DATA_SOURCE`) use
`gsm8k_score`;
MATH/DAPO/AIME sources use `boxed_score`. `register` adds a source; an unknown source is a
ValueError that lists the known ones.
"""
from __future__ import annotations

import re
from typing import Callable, Optional

__all__ = ["compute_score", "register", "registered_sources", "gsm8k_score", "boxed_score", "dapo_score",
           "extract_hash_answer", "last_boxed", "normalize_answer", "answers_equivalent"]

_CLIP_CHARS = 300  # verl's scorers look at the tail only (the final answer is at the end)
_HASH_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
_MINERVA_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

Scorer = Callable[[str, str], float]
_REGISTRY: dict[str, Scorer] = {}


def extract_hash_answer(text: str) -> Optional[str]:
    """GSM8K's final answer: the number after the last ``#### `` (commas and ``$`` dropped), or None."""
    found = _HASH_ANSWER.findall(text[-_CLIP_CHARS:])
    return found[-1].replace(",", "").replace("$", "") if found else None


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None (unclosed counts as none)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len("\\boxed{"):i]
    return None


# The Minerva normalisation (Lewkowycz et al. 2022; lm-eval-harness hendrycks_math, verl's math_dapo).
_SUBSTITUTIONS = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
                  (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]
_REMOVED = ["square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
            r",\!", "{,}", '"', "\\dots"]


def normalize_answer(answer: str) -> str:
    """Minerva normalisation of a final answer: units, spaces, ``\\text``, ``$`` and thousands commas go."""
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in _REMOVED:
        answer = answer.replace(expr, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    for command in ("text", "textbf", "overline"):
        answer = re.sub(r"(\\" + command + r"\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def _math_verify():
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


def answers_equivalent(pred: str, ground_truth: str, use_math_verify: Optional[bool] = None) -> bool:
    """Normalised exact match, or (math-verify installed, or asked for) mathematical equivalence.

    math-verify's own timeouts use SIGALRM, which exists only in the main thread: off the main thread
    it runs without them (``parsing_timeout=None``)."""
    if normalize_answer(pred) == normalize_answer(ground_truth):
        return True
    mv = _math_verify() if use_math_verify in (None, True) else None
    if mv is None:
        if use_math_verify:
            raise ValueError("use_math_verify=True but math-verify is not installed: pip install math-verify "
                             "(the 'rl' extra)")
        return False
    import threading

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = mv.parse("\\boxed{" + ground_truth + "}", parsing_timeout=timeout)
    guess = mv.parse("\\boxed{" + pred + "}", parsing_timeout=timeout)
    return bool(gold and guess and mv.verify(gold, guess, timeout_seconds=timeout))


def gsm8k_score(solution: str, ground_truth: str) -> float:
    """1.0 when the last ``#### <number>`` equals the ground truth string (verl's gsm8k, strict)."""
    answer = extract_hash_answer(solution)
    return 1.0 if answer is not None and answer == ground_truth else 0.0


def _final_answer(solution: str) -> Optional[str]:
    """The prediction a boxed-answer scorer reads: ``Answer: ...`` (Minerva) first, else the last box."""
    tail = solution[-_CLIP_CHARS:]
    minerva = _MINERVA_ANSWER.findall(tail)
    if minerva:
        return minerva[-1]
    return last_boxed(tail[-100:])


def boxed_score(solution: str, ground_truth: str, use_math_verify: Optional[bool] = None) -> float:
    """1.0 when the final answer (`_final_answer`) is equivalent to the ground truth."""
    pred = _final_answer(solution)
    return 1.0 if pred is not None and answers_equivalent(pred, ground_truth, use_math_verify) else 0.0


def dapo_score(solution: str, ground_truth: str) -> float:
    """DAPO-Math's reward scale: +1 right, -1 wrong (verl's math_dapo), by normalised exact match."""
    return 1.0 if boxed_score(solution, ground_truth, use_math_verify=False) else -1.0


def register(data_source: str, scorer: Scorer) -> None:
    """Score rows of `data_source` with ``scorer(solution_text, ground_truth) -> float``."""
    if not isinstance(data_source, str) or not data_source:
        raise ValueError(f"data_source={data_source!r} must be a non-empty string (a verl row's data_source)")
    _REGISTRY[data_source] = scorer


def registered_sources() -> list[str]:
    return sorted(_REGISTRY)


def compute_score(data_source: str, solution: str, ground_truth, extra_info: Optional[dict] = None) -> float:
    """The reward of `solution` for a row of `data_source` (verl's ``default_compute_score`` signature)."""
    scorer = _REGISTRY.get(data_source)
    if scorer is None and isinstance(data_source, str) and data_source.startswith("aime"):
        scorer = boxed_score
    if scorer is None:
        raise ValueError(f"no reward function for data_source={data_source!r}; known: {registered_sources()} "
                         "(and aime*). Register one with megatron_fp4.rl.tasks.rewards.register")
    return float(scorer(solution, str(ground_truth)))


for _source in ("openai/gsm8k", "megatron_fp4/arith_gsm8k", "megatron_fp4/carry_add"):
    register(_source, gsm8k_score)
for _source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math_dapo", "math",
                "math_dapo_reasoning", "BytedTsinghua-SIA/DAPO-Math-17k"):
    register(_source, boxed_score)


def digit_match_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A rule reward for smoke runs of verl's trainer (its `custom_reward_function`,
    `examples/verl/ppo_vllm.py`): 1 if the response's digits are the ground truth, else 0.1 x the fraction of its characters that are letters, digits or spaces (a random tiny model
    almost never answers right; this keeps a group's rewards apart, so GRPO has an advantage and the
    update moves the weights that the sync check then compares)."""
    digits = "".join(c for c in solution_str if c.isdigit())
    if digits == str(ground_truth):
        return 1.0
    return 0.1 * sum(c.isalnum() or c == " " for c in solution_str) / max(1, len(solution_str))
