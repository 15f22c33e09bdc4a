"""The embedded default corpus: procedurally generated arithmetic, and its character tokenizer.

Every sample is a line ``<bos>a+b=c<eos>``. Nothing is downloaded, the task is verifiable (the RL
example grades completions with `check_answer`), and a tiny model learns it fast enough to show a
loss curve on a laptop.

Randomness comes from ``random.Random`` seeded with a string, whose seeding (sha512 of the string)
and Mersenne Twister stream are fixed by the Python language, so the same seed gives the same
tokens on every platform. The torch global RNG is never touched.
"""
from __future__ import annotations

import random
import re
from typing import Sequence

import numpy as np
import torch

DEFAULT_OPS = "+-*"
_SPECIAL_NAMES = ("<pad>", "<bos>", "<eos>")
_CHARS = "0123456789+-*= "
# Longest digit run check_answer will convert; int() refuses > 4300 digits and no answer is this long.
_MAX_ANSWER_DIGITS = 64
_PROBLEM_AT_END = re.compile(r"(\d+)\s*([+\-*])\s*(\d+)\s*=\s*$")
_LEADING_NUMBER = re.compile(r"\s*(\d+)")


class ArithmeticTokenizer:
    """Character-level tokenizer with a fixed vocabulary: pad, bos, eos, ``0``-``9``, ``+-*=`` and space."""

    pad_id = 0
    bos_id = 1
    eos_id = 2

    def __init__(self):
        self._id_to_char = list(_SPECIAL_NAMES) + list(_CHARS)
        self._char_to_id = {c: i + len(_SPECIAL_NAMES) for i, c in enumerate(_CHARS)}
        # Byte -> id lookup table for fast encoding; -1 marks characters outside the vocabulary.
        self._lut = np.full(256, -1, dtype=np.int64)
        for char, token_id in self._char_to_id.items():
            self._lut[ord(char)] = token_id
        # The dataset writes bos/eos as control bytes inside one big string, then encodes it at once.
        self._packed_lut = self._lut.copy()
        self._packed_lut[1] = self.bos_id
        self._packed_lut[2] = self.eos_id

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_char)

    @property
    def eq_id(self) -> int:
        return self._char_to_id["="]

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        """Token ids of ``text``, optionally framed by bos/eos."""
        ids = self._encode_array(text, self._lut).tolist()
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True, stop_at_eos: bool = False) -> str:
        """Text of ``ids``. Special tokens are dropped (or written as ``<bos>`` etc. when
        ``skip_special=False``); with ``stop_at_eos`` everything from the first eos on is ignored."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        out = []
        for token_id in ids:
            token_id = int(token_id)
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"token id {token_id} is outside the arithmetic vocabulary [0, {self.vocab_size}); "
                    "were these ids produced by a different tokenizer?"
                )
            if stop_at_eos and token_id == self.eos_id:
                break
            if token_id < len(_SPECIAL_NAMES) and skip_special:
                continue
            out.append(self._id_to_char[token_id])
        return "".join(out)

    def _encode_array(self, text: str, lut: np.ndarray) -> np.ndarray:
        try:
            raw = text.encode("ascii")
        except UnicodeEncodeError as err:
            raise ValueError(
                f"character {text[err.start]!r} at position {err.start} is not in the arithmetic "
                f"vocabulary (digits, '+-*=' and space)"
            ) from None
        ids = lut[np.frombuffer(raw, dtype=np.uint8)]
        bad = np.flatnonzero(ids < 0)
        if bad.size:
            pos = int(bad[0])
            raise ValueError(
                f"character {text[pos]!r} at position {pos} is not in the arithmetic vocabulary "
                f"(digits, '+-*=' and space)"
            )
        return ids


def _validate_task(max_operand: int, ops: str) -> None:
    if not isinstance(max_operand, int) or max_operand < 1:
        raise ValueError(f"max_operand={max_operand!r} must be an integer >= 1 (data.max_operand)")
    if not ops or any(op not in DEFAULT_OPS for op in ops):
        raise ValueError(f"ops={ops!r} must be a non-empty string made of {DEFAULT_OPS!r}")


def _randint(rng, low: int, high: int) -> int:
    """Uniform integer in [low, high] from a ``random.Random`` or a numpy ``Generator``."""
    if hasattr(rng, "integers"):
        return int(rng.integers(low, high + 1))
    return rng.randint(low, high)


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


def make_problem(rng, max_operand: int = 99, ops: str = DEFAULT_OPS) -> tuple[str, str]:
    """One problem: ``("12+7=", "19")``. Operands are in [0, max_operand]; subtraction puts the
    larger operand first so every answer is a non-negative digit string."""
    _validate_task(max_operand, ops)
    a = _randint(rng, 0, max_operand)
    b = _randint(rng, 0, max_operand)
    op = ops[_randint(rng, 0, len(ops) - 1)]
    if op == "-" and a < b:
        a, b = b, a
    return f"{a}{op}{b}=", str(_apply(a, op, b))


def check_answer(prompt: str, completion_text: str) -> bool:
    """True when the completion starts with the correct value of the problem that ends ``prompt``.

    The number is read up to the first non-digit (eos, space, ``<eos>`` text all end it), so
    ``"19<eos>"`` and ``"19 junk"`` are right and ``"190"`` or ``""`` are wrong. The prompt may carry
    earlier solved examples (few-shot); only the last ``a op b=`` is graded.
    """
    match = _PROBLEM_AT_END.search(prompt)
    if match is None:
        raise ValueError(f"prompt {prompt!r} does not end with a problem like '12+7='")
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    answer = _LEADING_NUMBER.match(completion_text)
    if answer is None or len(answer.group(1)) > _MAX_ANSWER_DIGITS:
        return False
    return int(answer.group(1)) == _apply(a, op, b)


def sample_index(index: int, num_samples: int, dataset: str) -> int:
    """Python-style index (negatives count from the end) checked against `num_samples`."""
    index = int(index)
    if index < 0:
        index += num_samples
    if not 0 <= index < num_samples:
        raise IndexError(f"sample {index} out of range for {dataset} of {num_samples}")
    return index


class ArithmeticDataset(torch.utils.data.Dataset):
    """``num_samples`` packed sequences of ``seq_len + 1`` tokens of arithmetic problems.

    Sample ``i`` is its own problem stream, seeded by ``(seed, i)``: problems are encoded,
    concatenated and cut at ``seq_len + 1`` tokens. Samples are therefore built on demand in any
    order with O(1) memory, and the same ``(seed, i)`` always gives the same tokens. Training uses
    ``inputs = t[:-1]`` and ``labels = t[1:]`` (see `get_batch`).
    """

    def __init__(self, num_samples: int, seq_len: int, seed: int, max_operand: int = 99, ops: str = DEFAULT_OPS):
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples={num_samples!r} must be an integer >= 1 (data.num_samples)")
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len={seq_len!r} must be an integer >= 1")
        _validate_task(max_operand, ops)
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.seed = int(seed)
        self.max_operand = max_operand
        self.ops = ops
        self.tokenizer = ArithmeticTokenizer()

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        index = sample_index(index, self.num_samples, "ArithmeticDataset")
        rng = random.Random(f"megatron_fp4.arithmetic:{self.seed}:{index}")
        needed = self.seq_len + 1
        parts, total = [], 0
        while total < needed:
            prompt, answer = make_problem(rng, self.max_operand, self.ops)
            line = f"\x01{prompt}{answer}\x02"  # bos/eos as control bytes, mapped by the packed LUT
            parts.append(line)
            total += len(line)
        ids = self.tokenizer._encode_array("".join(parts), self.tokenizer._packed_lut)[:needed]
        return torch.from_numpy(ids)
