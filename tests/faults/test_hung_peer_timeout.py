"""Row 6 of issue 10: a peer that stops participating ends the job after parallel.timeout_s.

Before, only the default group had a (fixed, 300 s) timeout and every `new_group` got torch's
30-minute default, so a stopped rank blocked the others for half an hour. Here every mesh group
gets `timeout_s`; with 2 s, rank 0's collectives on the mesh's groups fail while rank 1 sits idle
(it waits for rank 0 to say it is done, so nothing here depends on timing). Only that it errors is
asserted, never how long it took.
"""
import os
import time

import pytest

from tests.distributed.launch import run_distributed

pytestmark = [pytest.mark.faults, pytest.mark.distributed]


def _worker(rank, world_size, done_file):
    import torch
    import torch.distributed as dist

    from megatron_fp4.parallel.mesh import ParallelMesh

    mesh = ParallelMesh.build(1, world_size, 1, timeout_s=2.0)
    if rank == 1:  # the hung peer: alive, but never joins another collective
        deadline = time.monotonic() + 120
        while not os.path.exists(done_file) and time.monotonic() < deadline:
            time.sleep(0.1)
        return None
    errors = {}
    try:
        dist.all_reduce(torch.ones(4), group=mesh.group("dp"))
    except RuntimeError as err:
        errors["dp"] = str(err)
    from megatron_fp4.parallel.mesh import PeerFailureError

    try:
        mesh.ranks_with(True)  # the NaN guard's vote, over the whole mesh
    except PeerFailureError as err:
        errors["vote"] = str(err)
    open(done_file, "w").close()
    return errors


def test_hung_peer_fails_collectives_within_the_mesh_timeout(tmp_path):
    results = run_distributed(_worker, 2, args=(str(tmp_path / "done"),), timeout_s=180)
    errors = results[0]
    assert set(errors) == {"vote", "dp"}, errors
    assert "rank 0" in errors["vote"] and "parallel.timeout_s=2" in errors["vote"], errors["vote"]
    assert "dp [0, 1]" in errors["vote"], errors["vote"]


def test_timeout_is_a_validated_config_field():
    from megatron_fp4.config import ConfigError, load_config

    assert load_config(None, ["parallel.timeout_s=7.5"]).validate().parallel.timeout_s == 7.5
    for bad in ("0", "-1", "inf"):
        with pytest.raises(ConfigError, match="parallel.timeout_s"):
            load_config(None, [f"parallel.timeout_s={bad}"]).validate()
