"""ZeroAdamW in one process: bucket planning, ownership, and Adam math vs torch.optim.AdamW."""
import copy

import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.model import build_model
from megatron_fp4.parallel.mesh import ParallelMesh
from megatron_fp4.parallel.zero import ZeroAdamW, owned_ranges, plan_buckets


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


class _ReferenceAdamW:
    """The update the trainer's optimizer must compute in one process: torch.optim.AdamW per
    parameter (decayed and not decayed groups as `model.specs.no_weight_decay` splits them), the
    gradient scaled by the clip coefficient; the global norm in float64."""

    def __init__(self, model, opt_cfg):
        from megatron_fp4.model.specs import no_weight_decay

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if not no_weight_decay(n, p)], "weight_decay": opt_cfg.weight_decay},
                  {"params": [p for n, p in named if no_weight_decay(n, p)], "weight_decay": 0.0}]
        self.params = [p for _, p in named]
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=opt_cfg.lr,
                                     betas=(opt_cfg.beta1, opt_cfg.beta2), eps=opt_cfg.eps)

    def grad_norm(self) -> float:
        return float(torch.cat([p.grad.double().flatten() for p in self.params]).norm())

    @torch.no_grad()
    def step(self, lr, clip_coef):
        for p in self.params:
            p.grad.mul_(clip_coef)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
@pytest.mark.parametrize("bucket_mb", [1e-3, 4.0])
def test_zero_adamw_matches_torch_adamw(zero_stage, bucket_mb):
    """Three steps with clipping against torch.optim.AdamW per param: at dp=1 (the trainer's
    single process) ZeroAdamW runs the same elementwise ops on a flat buffer, so the weights are
    bitwise equal; its norm (a float32 sum of squares) is within float32 rounding of float64."""
    cfg = Config()
    ref_model = build_model(cfg)
    model = copy.deepcopy(ref_model)
    ref = _ReferenceAdamW(ref_model, cfg.optimizer)
    opt = ZeroAdamW(model.named_parameters(), cfg.optimizer, ParallelMesh.single(), zero_stage, bucket_mb)
    for step in range(3):
        opt.zero_grad()
        _random_grads(ref_model, step)
        g = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad.copy_(torch.randn(p.shape, generator=g) * 0.1)  # into the buffer views
        opt.finish_grad_sync()
        assert opt.grad_norm() == pytest.approx(ref.grad_norm(), rel=1e-6)  # float32 sum of ~1e5 squares
        ref.step(1e-2, 0.5)
        opt.step(1e-2, 0.5)
    for (name, a), (_, b) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_one_process_fp32_keeps_no_master_copy(zero_stage):
    """A group of one owns its whole buffer: an fp32 buffer is its own master (no 4 bytes/param more
    than torch AdamW on the params); a bf16 one keeps an fp32 master."""
    cfg = Config()
    model = build_model(cfg)
    opt = ZeroAdamW(model.named_parameters(), cfg.optimizer, ParallelMesh.single(), zero_stage)
    assert all(m.data_ptr() == b.data.data_ptr() for m, b in zip(opt.masters, opt.buffers))
    bf16 = ZeroAdamW(build_model(cfg).to(torch.bfloat16).named_parameters(), cfg.optimizer, ParallelMesh.single(),
                     zero_stage)
    assert all(m.dtype == torch.float32 and m.data_ptr() != b.data.data_ptr() for m, b in zip(bf16.masters, bf16.buffers))
