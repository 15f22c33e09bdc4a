"""benchmarks/bench_async_rl.py's rollout kinds: a vLLM kind without the vLLM environment stops at
once (before the SFT warm-up) with an error naming it; the rollout's processes are found for the
CPU-time rows. The benchmark's vLLM run itself takes minutes (docs/rl.md has its numbers)."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("bench_async_rl")


@pytest.mark.parametrize("kind", ["vllm", "vllm-serve"])
def test_a_vllm_rollout_without_the_vllm_environment_is_a_clear_error(kind, monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("MEGATRON_FP4_VLLM_PYTHON", raising=False)
    b = bench(monkeypatch)
    monkeypatch.setattr(b, "load_example", lambda: pytest.fail("the error must come before any work"))
    with pytest.raises(SystemExit):
        b.main(["--rollout", kind, "--vllm-python", str(tmp_path / "no-python"), "--quick"])
    err = capsys.readouterr().err
    assert f"--rollout {kind} needs the vLLM environment" in err and "no-python" in err


def test_the_rollout_process_tree_is_measured(monkeypatch):
    """`RolloutProcess`: the started process and its children's CPU (vllm serve's engine core), the
    main thread of the busiest one."""
    b = bench(monkeypatch)
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'while True: pass']); "
            "time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        rollout = type("R", (), {"server": type("S", (), {"proc": parent})()})()  # vllm-serve's shape
        proc = b.RolloutProcess(rollout)
        for _ in range(200):  # until the child exists and has run a little
            tree = b.process_tree(parent.pid)
            if len(tree) == 2 and b.process_cpu_s(tree[1]) > 0.2:
                break
            __import__("time").sleep(0.05)
        assert len(tree) == 2 and tree[0] == parent.pid
        total, main_cpu, _ = proc.sample()
        assert proc.main == tree[1]  # the busy child, not the sleeping parent
        assert total >= main_cpu > 0.2 and total >= b.process_cpu_s(parent.pid)
    finally:
        for pid in b.process_tree(parent.pid)[1:]:
            os.kill(pid, 9)
        parent.kill()
        parent.wait()
