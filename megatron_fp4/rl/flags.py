"""Range checks for the RL examples' command lines (examples/grpo_moeresq.py, ablation_moeresq.py):
every flag is checked before any work, so a bad value is the parser's one-line error (exit 2)
instead of a traceback after minutes of SFT warm-up.

    check_ranges(ap, args, ints={"steps": 1, "eval_every": 0}, positive=("lr",), nonnegative=("kl_coef",))
"""
from __future__ import annotations

import math


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def range_error(args, ints: dict | None = None, positive=(), nonnegative=(), fractions=()) -> str | None:
    """The first problem among `args`' flags, or None. ints: {name: minimum}; positive: finite floats
    > 0; nonnegative: finite floats >= 0; fractions: floats in [0, 1]. A None value (an optional flag
    left unset) is not checked."""
    for name, low in (ints or {}).items():
        value = getattr(args, name)
        if value is not None and value < low:
            return f"{_flag(name)} {value} must be >= {low}"
    for names, ok, what in ((positive, lambda v: 0 < v < math.inf, "a finite number > 0"),
                            (nonnegative, lambda v: 0 <= v < math.inf, "a finite number >= 0"),
                            (fractions, lambda v: 0 <= v <= 1, "a probability in [0, 1]")):
        for name in names:
            value = getattr(args, name)
            if value is not None and not ok(value):  # NaN fails every comparison: refused too
                return f"{_flag(name)} {value} must be {what}"
    return None


def check_ranges(ap, args, **kinds) -> None:
    """`range_error` as the parser's error (one line, exit 2)."""
    problem = range_error(args, **kinds)
    if problem is not None:
        ap.error(problem)
