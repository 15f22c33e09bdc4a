"""ZeroAdamW in one process: bucket planning, ownership, and Adam math vs torch.optim.AdamW."""
import copy

import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.model import build_model
from megatron_fp4.parallel.mesh import ParallelMesh
from megatron_fp4.parallel.zero import ZeroAdamW, owned_ranges, plan_buckets
from megatron_fp4.training.optim import MasterWeightAdamW


def test_plan_buckets_pads_to_group_size_and_never_splits_a_param():
    offsets, buckets = plan_buckets([5, 3, 10, 1], bucket_numel=8, group_size=4)
    assert offsets == [0, 5, 8, 20]
    assert buckets == [(0, 8), (8, 20), (20, 24)]
    for start, end in buckets:
        assert (end - start) % 4 == 0


def test_owned_ranges_partition_every_bucket():
    _, buckets = plan_buckets([7, 9, 30], bucket_numel=10, group_size=3)
    covered = sorted(r for rank in range(3) for r in owned_ranges(buckets, 3, rank))
    flat = [i for lo, hi in covered for i in range(lo, hi)]
    assert flat == list(range(buckets[-1][1]))


def _random_grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 0.1


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
@pytest.mark.parametrize("bucket_mb", [1e-3, 4.0])
def test_zero_adamw_matches_torch_adamw(zero_stage, bucket_mb):
    """Three steps with clipping against MasterWeightAdamW (= torch.optim.AdamW per param):
    the same elementwise ops on a flat shard, so the results are bitwise equal."""
    cfg = Config()
    ref_model = build_model(cfg)
    model = copy.deepcopy(ref_model)
    ref = MasterWeightAdamW(ref_model.named_parameters(), cfg.optimizer)
    opt = ZeroAdamW(model.named_parameters(), cfg.optimizer, ParallelMesh.single(), zero_stage, bucket_mb)
    for step in range(3):
        ref.zero_grad()
        opt.zero_grad()
        _random_grads(ref_model, step)
        g = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad.copy_(torch.randn(p.shape, generator=g) * 0.1)  # into the buffer views
        opt.finish_grad_sync()
        assert opt.grad_norm() == pytest.approx(ref.grad_norm(), rel=1e-6)
        ref.step(1e-2, 0.5)
        opt.step(1e-2, 0.5)
    for (name, a), (_, b) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert torch.equal(a, b), name
