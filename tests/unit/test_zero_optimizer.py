"""ZeroAdamW in one process: bucket planning, ownership, and Adam math vs torch.optim.AdamW (float64
reference, and its fused kernel bit for bit)."""
import copy

import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.model import build_model
from megatron_fp4.parallel.flat_buffer import CHUNK_NUMEL, merge_ranges, owned_ranges, plan_buckets, sum_of_squares
from megatron_fp4.parallel.mesh import ParallelMesh
from megatron_fp4.parallel.zero import ZeroAdamW


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
    parameter in float64 (decayed and not decayed groups as `model.specs.no_weight_decay` splits
    them) on the same gradients scaled by the clip coefficient; the global norm in float64."""

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
    def step(self, lr, clip_coef) -> list:
        """Steps; returns each param's update |Δ| (for the error bound)."""
        before = [p.detach().clone() for p in self.params]
        for p in self.params:
            p.grad.mul_(clip_coef)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        return [(p - b).abs() for p, b in zip(self.params, before)]


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
@pytest.mark.parametrize("bucket_mb", [1e-3, 4.0])
def test_zero_adamw_matches_float64_adamw(zero_stage, bucket_mb):
    """Three steps with clipping against torch.optim.AdamW per param in float64 on the same fp32
    gradients. Error bound of the fp32 update, per element and step t (u = 2^-24): the decay
    multiply and the final add round the weight (<= 3u|p|); the update Δ = lr·m̂/(sqrt(v̂)+eps) is
    formed in ~10 roundings (lerp, mul+fma, sqrt, division, eps, step size, addcdiv), on moments
    carrying the earlier steps' errors (<= 5u per step): |err| <= Σ_t 3u|p_t| + 32u|Δ_t| (twice
    the count). The norm (float32 squares, pairwise sums) is within float32 rounding of float64."""
    cfg = Config()
    ref_model = build_model(cfg)
    model = copy.deepcopy(ref_model)
    ref_model.double()
    ref = _ReferenceAdamW(ref_model, cfg.optimizer)
    opt = ZeroAdamW(model.named_parameters(), cfg.optimizer, ParallelMesh.single(), zero_stage, bucket_mb)
    u = 2.0 ** -24
    bound = [torch.zeros_like(p) for p in ref.params]
    for step in range(3):
        opt.zero_grad()
        g = torch.Generator().manual_seed(step)
        for p, r in zip(model.parameters(), ref_model.parameters()):
            p.grad.copy_(torch.randn(p.shape, generator=g) * 0.1)  # into the buffer views
            r.grad = p.grad.double()
        opt.finish_grad_sync()
        assert opt.grad_norm() == pytest.approx(ref.grad_norm(), rel=1e-6)  # float32 sum of ~1e5 squares
        for b, p, d in zip(bound, ref.params, ref.step(1e-2, 0.5)):
            b += 3 * u * p.abs() + 32 * u * d
        opt.step(1e-2, 0.5)
    for (name, a), b, p in zip(model.named_parameters(), bound, ref.params):
        assert ((a.double() - p).abs() <= b).all(), (name, ((a.double() - p).abs() / b).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("clip_coef", [1.0, 0.37])
def test_step_is_torch_fused_adamw_on_the_whole_master(dtype, clip_coef):
    """The step feeds torch's fused AdamW the clipped gradient piece by piece (`CHUNK_NUMEL` elements):
    the same bits as one ``torch.optim.AdamW(fused=True)`` step on the whole master with
    ``grad.to(master dtype) * clip_coef`` (pieces are multiples of the SIMD width, so the kernel's
    vector/scalar split does not move). A buffer of several pieces and a ragged tail; a bf16 param
    keeps an fp32 master. The unclipped gradient stays in p.grad."""
    from megatron_fp4.config import OptimizerConfig

    shape = ((2 * CHUNK_NUMEL + 12345) // 3, 3)  # 2-D: weight-decayed; several pieces and a ragged tail
    g = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter((torch.randn(shape, generator=g) * 0.05).to(dtype))
    o = OptimizerConfig()
    opt = ZeroAdamW([("w", weight)], o, ParallelMesh.single(), zero_stage=1)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    master = weight.detach().to(wide).clone().requires_grad_()
    ref = torch.optim.AdamW([master], lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                            fused=True)
    for step in range(3):
        opt.zero_grad()
        grad = (torch.randn(shape, generator=g) * 0.1).to(dtype)
        weight.grad.copy_(grad)
        opt.finish_grad_sync()
        opt.step(1e-2 * (step + 1), clip_coef)
        master.grad = grad.to(wide) * clip_coef
        for group in ref.param_groups:
            group["lr"] = 1e-2 * (step + 1)
        ref.step()
        assert torch.equal(weight.grad, grad)
    assert opt.buffers[0].weight_decay > 0
    assert torch.equal(opt.masters[0], master.detach().flatten())
    assert torch.equal(weight.detach(), master.detach().to(dtype))
    state = opt.adam_state(0)
    assert torch.equal(state["exp_avg"], ref.state[master]["exp_avg"].flatten()) and state["step"] == 3.0


def test_gather_ranges_is_a_view_for_contiguous_ranges():
    """A group of one owns every bucket back to back: its gradient is the buffer itself, not a copy
    (the copy cost a pass over all gradients per step at 100M+ parameters, issue 37)."""
    cfg = Config()
    opt = ZeroAdamW(build_model(cfg).named_parameters(), cfg.optimizer, ParallelMesh.single(), 1, bucket_size_mb=1e-3)
    buf = opt.buffers[0]
    assert len(buf.owned) > 1
    assert opt._local_grad(0).data_ptr() == buf.grad.data_ptr() and opt._local_grad(0).numel() == buf.grad.numel()
    flat = torch.arange(10.0)
    assert torch.equal(buf.gather_ranges(flat, [(0, 2), (5, 7)]), torch.tensor([0.0, 1.0, 5.0, 6.0]))
    assert merge_ranges([(0, 2), (2, 4), (6, 8), (8, 9)]) == [(0, 4), (6, 9)]


@pytest.mark.parametrize("dtype,wide", [(torch.float32, torch.float32), (torch.float64, torch.float64),
                                        (torch.bfloat16, torch.float32)])
def test_sum_of_squares_matches_float64(dtype, wide):
    """Rows of `NORM_ROW` squares (a gradient in its wide dtype) or pieces of squares (bf16, cast),
    summed pairwise: error ~ log2(n)·u relative plus a row's ~NORM_ROW/lanes terms, like one torch sum
    (a running float32 sum over 3M elements, e.g. a dot product, is off by ~1e-3). A ragged tail
    past the last whole row; an inf or a NaN anywhere propagates (the trainer's non-finite vote)."""
    x = (torch.randn(3 * (1 << 20) + 77, generator=torch.Generator().manual_seed(1)) * 0.01).to(dtype)
    ref = float(x.double().pow(2).sum())
    assert float(sum_of_squares(x, wide)) == pytest.approx(ref, rel=32 * torch.finfo(wide).eps / 2)
    assert float(sum_of_squares(x[:0], wide)) == 0.0
    for bad, at in ((float("inf"), 5), (float("nan"), 5), (float("nan"), x.numel() - 3)):
        y = x.clone()
        y[at] = bad
        got = float(sum_of_squares(y, wide))
        assert got == bad if bad == bad else got != got


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_reports_whether_the_updated_weights_are_finite(dtype):
    """`step` returns the trainer's post-update check (no extra pass where the param buffer is the
    master): an infinite lr makes weights non-finite; finite weights whose sum overflows float32
    are finite (the exact scan decides); a bf16 param is checked as written (a finite fp32 master
    above bf16's range is an infinite bf16 weight)."""
    from megatron_fp4.config import OptimizerConfig

    def one_step(values, lr, master_value=None):
        weight = torch.nn.Parameter(values.to(dtype))
        opt = ZeroAdamW([("w", weight)], OptimizerConfig(weight_decay=0.0), ParallelMesh.single(), zero_stage=1)
        if master_value is not None:
            opt.masters[0].data.fill_(master_value)
        weight.grad.fill_(1e-3)
        opt.finish_grad_sync()
        return opt.step(lr)

    rows = torch.ones(4, 3)
    assert one_step(rows, 1e-2) is True
    assert one_step(rows, float("inf")) is False
    if dtype == torch.float32:
        assert one_step(torch.full((4, 3), 3e38), 0.0) is True  # Σ overflows, every value finite
    else:
        assert one_step(rows, 0.0, master_value=3.3999e38) is False  # rounds to inf in bf16
