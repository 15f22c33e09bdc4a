"""CI (`.ci/run`) installs and tests as the README and docs/usage.md show (the quick subset shuffled, its seed
printed), and fails on a skip that is not "needs a GPU" / "runs in the vLLM venv" (`tools/check_skips.py`)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = [sys.executable, str(ROOT / "tools" / "check_skips.py")]


def _report(tmp_path, reasons) -> str:
    cases = "".join(f'<testcase classname="tests.unit.test_x" name="t{i}"><skipped type="pytest.skip" '
                    f'message="{reason}">skip</skipped></testcase>' for i, reason in enumerate(reasons))
    path = tmp_path / "report.xml"
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{cases}'
                    '<testcase classname="tests.unit.test_x" name="ran"/></testsuite></testsuites>')
    return str(path)


SHOWN = ["README.md", "docs/usage.md"]  # the pages that show test commands
SHUFFLE = re.compile(r"\s+--random-order-bucket=module\s+--random-order-seed=\S+")


def _shown_pytest_commands() -> set[str]:
    """Every `python -m pytest ...` the docs show (shuffle flags dropped: any seed replays a run)."""
    text = "\n".join((ROOT / page).read_text() for page in SHOWN)
    found = re.findall(r"python -m pytest [^\n`&#]*?(?=\s*(?:\n|`|&&|#|$))", text)
    return {SHUFFLE.sub("", command) for command in found}


# The whole suite as CI runs it, each test once: the quick subset, the rest of tests/unit (the
# complement of the quick subset's marker expression) and every other directory.
WHOLE_SUITE = "python -m pytest tests -q"
PARTITION = ('python -m pytest tests/unit -q -m "not slow and not distributed"',
             'python -m pytest tests/unit -q -m "slow or distributed"',
             "python -m pytest tests -q --ignore=tests/unit")


def test_ci_runs_every_test_command_the_docs_show():
    ci = (ROOT / ".ci" / "run").read_text()
    runs = [SHUFFLE.sub("", line.strip()).split(None, 2)[2] for line in ci.splitlines() if line.startswith("run_pytest ")]
    if set(PARTITION) <= set(runs):
        runs.append(WHOLE_SUITE)
    shown = _shown_pytest_commands()
    assert shown, "README.md / docs/usage.md show no test command"
    assert not shown - set(runs), f"the docs show test commands CI does not run: {shown - set(runs)}"
    shuffled = [line for line in ci.splitlines() if line.startswith("run_pytest ") and "--random-order-seed" in line]
    assert len(shuffled) == 1 and "tests/unit" in shuffled[0] and re.search(r'echo "shuffled unit run, seed \$seed', ci)
    assert re.search(r'"\$@" -rEfs --junitxml=', ci) and "python tools/check_skips.py" in ci


def test_ci_installs_as_the_readme_says():
    """The README's test command at the top is what CI runs on a fresh machine: its installs, then
    the pytest commands checked above."""
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    first_block = readme[readme.index("```bash") + 7:readme.index("```", readme.index("```bash") + 7)]
    line = next((line for line in first_block.splitlines() if "python -m pytest" in line), None)
    assert line, "README.md's first code block has no test command"
    installs = [step.strip() for step in line.split("&&") if step.strip().startswith("pip install")]
    ci_installs = [line.strip().replace("python -m pip", "pip", 1) for line in ci.splitlines()
                   if line.startswith("python -m pip install")]
    assert installs and installs == ci_installs, (installs, ci_installs)


def test_the_shown_tools_exist():
    for tool in ("tools/check_portability.sh", "tools/check_skips.py", ".ci/run"):
        assert (ROOT / tool).is_file(), tool
    assert os.access(ROOT / "tools" / "check_portability.sh", os.X_OK) and os.access(ROOT / ".ci" / "run", os.X_OK)


def test_the_test_extra_installs_the_references_and_the_shuffler():
    setup = (ROOT / "setup.py").read_text()
    extra = setup[setup.index('EXTRAS["test"]'):]
    for package in ("scipy", "pytest-random-order", "verl"):
        assert f'"{package}' in extra[:extra.index("\n\n")], package


def test_accepted_skips_pass_and_are_counted(tmp_path):
    path = _report(tmp_path, ["needs vLLM and a GPU",
                              "vllm is not importable; run in the vLLM environment: tools/vllm_env.sh",
                              "needs Transformer Engine with NVFP4 on a sm_100+ GPU (not importable)",
                              "Slurm (slurm-wlm) and munge are not installed"])
    proc = subprocess.run(CHECK + [path], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "skipped 2: needs a GPU" in proc.stdout and "skipped 1: runs in the vLLM venv" in proc.stdout


def test_a_skip_that_hides_a_reference_fails(tmp_path):
    path = _report(tmp_path, ["needs vLLM and a GPU", "could not import 'scipy.stats': No module named 'scipy'"])
    proc = subprocess.run(CHECK + [path], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "UNEXPECTED SKIP tests.unit.test_x::t1: could not import 'scipy.stats'" in proc.stdout
    assert "1 skip(s) are neither" in proc.stderr


def test_an_unreadable_report_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.xml"
    bad.write_text("<testsuite><testcase")
    for args in ([str(tmp_path / "missing.xml")], [str(bad)], []):
        proc = subprocess.run(CHECK + args, capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "Traceback" not in proc.stderr
