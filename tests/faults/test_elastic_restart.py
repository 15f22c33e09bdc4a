"""Issue 17 rows 1-2: `train.sh 2 --max-restarts 1 -- ...`, one rank SIGKILLed at step 5 of 8.

torchrun restarts both workers; they resume from the newest checkpoint (step 4; the launcher's
default `checkpoint.load=auto`) and the finished run's losses are bit-identical to an uninterrupted
run of the same layout on the same machine (same ops in the same order, so bitwise by
construction). Before, the restarted workers read the dead attempt's gloo addresses from torchrun's
shared store and hung or failed, and train.sh passed `--max-restarts` to the trainer.
"""
import pytest

from megatron_fp4.parallel import mesh as mesh_mod
from tests.faults._launchers import train_sh

pytestmark = [pytest.mark.faults, pytest.mark.distributed]


def test_killed_rank_restarts_and_ends_with_the_uninterrupted_losses(tmp_path, tiny_reference):
    killed, losses = train_sh(tmp_path, "killed", ["--max-restarts", "1"], fault="kill:0:5")
    assert killed.returncode == 0, killed.stderr[-3000:]
    assert "exitcode: -9" in killed.stderr  # the first attempt really lost a rank
    assert "resumed from" in killed.stderr and "at step 4" in killed.stderr
    assert losses == tiny_reference  # every step, including step 4 computed by both attempts


def test_each_restart_attempt_keys_its_groups_apart(monkeypatch):
    import torch.distributed as dist

    from tests.distributed.launch import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 1, is_master=True)  # torchrun's agent store
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    mesh_mod._restart_store(10.0).set("default_pg/0/rank_0", "dead worker's address")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not mesh_mod._restart_store(10.0).check(["default_pg/0/rank_0"])
    assert server.check(["megatron_fp4/attempt_0/default_pg/0/rank_0"])
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    assert mesh_mod._restart_store(10.0) is None  # plain env:// rendezvous: a fresh store per attempt
