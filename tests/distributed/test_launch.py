import pytest
import torch
import torch.distributed as dist

from tests.distributed.launch import run_distributed


def _allreduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _boom(rank, world_size):
    raise ValueError(f"boom on {rank}")


def test_all_reduce_two_ranks():
    assert run_distributed(_allreduce, 2) == [3.0, 3.0]


def test_child_error_is_reported():
    with pytest.raises(RuntimeError, match="boom on"):
        run_distributed(_boom, 2)


def _die(rank, world_size):
    import os
    if rank == 1:
        os._exit(3)  # dies without reporting
    import time
    time.sleep(120)  # rank 0 never reports in time: only the launcher's liveness check can end this


def test_dead_child_is_reported_not_hung():
    with pytest.raises(RuntimeError, match="died without reporting"):
        run_distributed(_die, 2, timeout_s=60)
