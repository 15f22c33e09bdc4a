"""The overlapped GRPO loop with the rollout engine in a process of its own (``--rollout
engine-process``, `rl.RemoteRollout` for a single-process trainer): the same bits as the engine in
process (float.hex of the losses, the completions, the versions; ``--check-sync`` too), and a rollout process that dies
with batches in flight gives the trainer one clear RuntimeError within the sync timeout, no hang."""
import time

import pytest

from megatron_fp4.rl import loop, make_rollout
from tests.unit.test_async_rl import STEPS, hexes, settings, tiny

TIMEOUT_S = 30  # parallel.timeout_s of the killed run: the error must come well before a hang


def run(process: bool, check_sync: bool = False):
    trainer, task = tiny("rl.max_staleness=1")
    rollout = make_rollout("engine-process" if process else "engine", trainer, task.tok.pad_id, 1 << 20)
    try:
        return loop.run_grpo(trainer, task, rollout, settings(check_sync=check_sync))
    finally:
        rollout.close()


def test_engine_process_equals_in_process():
    """Also with ``check_sync`` (wait for each load, compare the served weights' SHA-256): every
    published version is the trainer's, bit for bit, and the history does not change."""
    remote, local = run(True, check_sync=True), run(False)
    assert all(h["weight_sync/served_sha"] for h in remote.history)
    assert hexes(remote) == hexes(local)
    assert [h["completions"] for h in remote.history] == [h["completions"] for h in local.history]
    assert remote.sample_versions == local.sample_versions == [0, 0, 1, 2][:STEPS]


def test_rollout_process_death_is_one_clear_error(monkeypatch):
    """The process is killed as batch 2 is requested, while the trainer updates on batch 1."""
    trainer, task = tiny("rl.max_staleness=1", f"parallel.timeout_s={TIMEOUT_S}")
    rollout = make_rollout("engine-process", trainer, task.tok.pad_id, 1 << 20)
    real = rollout.fetch

    base = trainer.cfg.schedule.seed * 1_000_003  # `loop.sampling_params`' seeds: base + step · 10_007 + request

    def fetch(prompts, params, *a):  # the rollout's thread, asking for batch 2: the process dies
        if params[0].temperature > 0 and (params[0].seed - base) // 10_007 == 2:
            rollout.proc.kill()
            rollout.proc.wait()
        return real(prompts, params, *a)
    monkeypatch.setattr(rollout, "fetch", fetch)
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="the rollout process exited with code -9 while batch") as err:
            loop.run_grpo(trainer, task, rollout, settings())
        assert time.monotonic() - start < TIMEOUT_S, err.value
    finally:
        with pytest.raises(RuntimeError, match="had exited with code -9 before close"):
            rollout.close()
