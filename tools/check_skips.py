"""List a pytest run's skips by reason and fail on any that CI does not accept (``.ci/run``).

    python -m pytest tests -q -rs --junitxml=/tmp/run.xml; python tools/check_skips.py /tmp/run.xml

A skip in CI is either a test for hardware or an environment this run cannot have (a GPU, the
separate vLLM venv that ``tools/vllm_env.sh`` builds, a Slurm cluster that needs root and system
packages) or a failure: a reference the ``[test]`` extra should install, a compiler the machine
should have. A skip that hides a comparison is how a check silently stops running, so it is named
here with its count and makes the run fail (exit 1). Exit 2: the report cannot be read.
"""
from __future__ import annotations

import collections
import re
import sys
import xml.etree.ElementTree as ElementTree

# (why a run may skip, what the skip reason says). The reasons are the tests' own skip messages.
ACCEPTED = (
    ("needs a GPU", re.compile(r"\bGPU\b|Transformer Engine|TE is available")),
    ("runs in the vLLM venv (tools/vllm_env.sh)",
     re.compile(r"tools/vllm_env\.sh|vllm (is )?not importable|vLLM is importable here")),
    ("needs a Slurm cluster (root, slurm-wlm, munge: tools/slurm_local_test.sh)", re.compile(r"Slurm|slurmd")),
)
MAX_REPORT_BYTES = 1 << 28  # a JUnit report of the whole suite is a few MB


def skips(path: str) -> list:
    """(test id, reason) of every skipped test case in the JUnit XML report at ``path``."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_REPORT_BYTES + 1)
    except OSError as err:
        raise ValueError(f"{path}: cannot read the pytest report ({err.strerror}); run pytest with --junitxml={path}")
    if len(data) > MAX_REPORT_BYTES:
        raise ValueError(f"{path}: larger than {MAX_REPORT_BYTES} bytes, not a pytest JUnit report")
    try:
        root = ElementTree.fromstring(data)
    except ElementTree.ParseError as err:
        raise ValueError(f"{path}: not a JUnit XML report ({err}); write it with pytest --junitxml={path}")
    found = []
    for case in root.iter("testcase"):
        for skip in case.findall("skipped"):
            test = f"{case.get('classname', '')}::{case.get('name', '')}"
            found.append((test, re.sub(r"^Skipped: ", "", skip.get("message", ""))))
    return found


def classify(reason: str):
    """The accepted kind of a skip reason, or None (a skip CI counts as a failure)."""
    return next((kind for kind, pattern in ACCEPTED if pattern.search(reason)), None)


def main(argv: list) -> int:
    if len(argv) != 1:
        print("usage: python tools/check_skips.py REPORT.xml  (pytest --junitxml=REPORT.xml)", file=sys.stderr)
        return 2
    try:
        found = skips(argv[0])
    except ValueError as err:
        print(f"check_skips: {err}", file=sys.stderr)
        return 2
    kinds = collections.Counter(classify(reason) for _, reason in found)
    for kind, count in sorted(kinds.items(), key=lambda kv: str(kv[0])):
        if kind is not None:
            print(f"skipped {count}: {kind}")
    bad = [(test, reason) for test, reason in found if classify(reason) is None]
    for test, reason in bad:
        print(f"UNEXPECTED SKIP {test}: {reason}")
    if bad:
        print(f"check_skips: {len(bad)} skip(s) are neither 'needs a GPU', 'runs in the vLLM venv' nor 'needs "
              "Slurm': install what they need (the [test] extra) or make them run", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
