"""CI (`.ci/run`) runs the README's test commands as written (the quick subset shuffled, its seed printed), and
fails on a skip that is not "needs a GPU" / "runs in the vLLM venv" (`tools/check_skips.py`)."""
from __future__ import annotations

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


def test_ci_runs_the_readme_test_commands_as_written():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    commands = set(re.findall(r"python -m pytest [^\n`&]*?(?=\s*(?:\n|`|&&|$))", readme))
    assert 'python -m pytest tests/unit -q -m "not slow and not distributed"' in commands
    assert "python -m pytest tests -q" in commands
    runs = [line.strip() for line in ci.splitlines() if line.startswith("run_pytest ")]
    shuffle = ' --random-order-bucket=module --random-order-seed="$seed"'
    for command in commands:  # as written; the quick subset may carry the shuffle flags after it
        assert any(run.split(None, 2)[2] in (command, command + shuffle) for run in runs), command
    shuffled = [run for run in runs if "--random-order-seed" in run]
    assert len(shuffled) == 1 and "tests/unit" in shuffled[0] and re.search(r'echo "shuffled unit run, seed \$seed', ci)
    assert re.search(r'"\$@" -rEfs --junitxml=', ci) and "python tools/check_skips.py" in ci


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
