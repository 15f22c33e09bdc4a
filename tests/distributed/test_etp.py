"""Expert-tensor parallel (etp2, ep2 × etp2) against the single-process MoE layer, float64, FP4 MoEResQ.

Every rank holds a micro-batch of its own; the reference runs them one after the other (gradients
accumulated), as the dp tests define FP4 layouts (wgrad quantizes along a micro-batch's tokens,
and the etp exchange keeps each (etp rank, source) run a segment of its own). Each expert's w13
is column-cut and its w2 row-cut over the etp group (`parallel/moe/expert_tensor_parallel.py`), the
FP4 amaxes spanning the cut max-reduced over it. Outputs, input gradients, the router gradient
(summed over all ranks here, as the dp reduction would) and every expert slice's gradient (whole
on each etp rank: edp is one rank in these layouts) must agree within FP64_REL of their scale
(tests/numerics.py: the same products summed in another order, ~1e-16 relative). A run with the
amax reduction left out misses by far more (the equality rests on it).
"""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.fp4 import Recipe
from megatron_fp4.model.moe import MoELayer, init_moe_params
from tests.distributed.test_tensor_parallel_moe import run_by_world
from tests.numerics import FP64_REL

pytestmark = pytest.mark.distributed

HIDDEN, FFN, E, K, N = 32, 64, 4, 2, 40


def make_layer(fmt):
    layer = MoELayer(HIDDEN, E, K, FFN, Recipe.for_format("fp4_resq", fmt), aux_loss_coef=0.05, z_loss_coef=0.01)
    init_moe_params(layer, 0.5, 0.3, torch.Generator().manual_seed(6))
    return layer.double().train()


def data(rank):  # rank: the micro-batch (the dp coordinate where etp ranks share tokens)
    g = torch.Generator().manual_seed(200 + rank)
    return (torch.randn(N, HIDDEN, generator=g, dtype=torch.float64),
            torch.randn(N, HIDDEN, generator=g, dtype=torch.float64))


def reference(micro_batches, fmt):
    layer = make_layer(fmt)
    outs, dxs = [], []
    for r in range(micro_batches):
        x, gy = data(r)
        x.requires_grad_(True)
        y = layer(x)
        (y * gy).sum().backward()
        outs.append(y.detach())
        dxs.append(x.grad)
    return outs, dxs, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _rank(rank, world, ep, fmt, reduce, replicated=False):
    import torch.distributed as dist

    from megatron_fp4.fp4.tensor_cut import TensorCut
    from megatron_fp4.parallel.moe.alltoall import AllToAllDispatcher
    from megatron_fp4.parallel.moe.expert_parallel import shard_experts
    from megatron_fp4.parallel.moe.expert_tensor_parallel import apply_expert_tensor_parallel
    etp = world // ep
    groups = {}
    for name, members in (("etp", [list(range(s, s + etp)) for s in range(0, world, etp)]),
                          ("ep", [list(range(t, world, etp)) for t in range(etp)])):
        for ranks in members:  # every rank creates every group, in the same order
            g = dist.new_group(ranks) if len(ranks) < world else dist.group.WORLD
            if rank in ranks:
                groups[name] = g
    layer = make_layer(fmt)
    if ep > 1:
        shard_experts(layer, ep, rank // etp)
        layer.set_dispatcher(AllToAllDispatcher(groups["ep"], ep, E))
    apply_expert_tensor_parallel(layer, groups["etp"], replicated=replicated)
    if not reduce:
        ex = layer.experts
        ex.w13_cut, ex.w2_cut = (TensorCut(c.kind, c.size, lambda a: a) for c in (ex.w13_cut, ex.w2_cut))
    x, gy = data(rank // etp if replicated else rank)
    x.requires_grad_(True)
    y = layer(x)
    (y * gy).sum().backward()
    grads = {}
    for n, p in layer.named_parameters():
        g = p.grad.clone()
        if not n.startswith("experts."):  # the router: a dp reduction (the ep group is the dp group if replicated)
            dist.all_reduce(g, group=groups["ep"] if replicated else None)
        grads[n] = (g, getattr(p, "etp_shard", None))
    return y.detach(), x.grad, grads, layer.experts.expert_offset, layer.experts.num_local_experts


# name: (world, ep, format, replicated); replicated: tp2 x dp2 with moe_tokens='whole', etp = the tp
# group (ranks 2d, 2d+1 hold dp rank d's micro-batch), ep over the dp ranks
CASES = {"etp2": (2, 1, "nvfp4", False), "etp2_mxfp4": (2, 1, "mxfp4", False), "ep2_etp2": (4, 2, "nvfp4", False),
         "tp2_dp2_ep2_etp2_whole": (4, 2, "nvfp4", True)}


def _all(rank, world, names):
    out = {n: _rank(rank, world, *CASES[n][1:3], True, CASES[n][3]) for n in names}
    if world == 2:
        out["unreduced"] = _rank(rank, world, 1, "nvfp4", False)
    return out


@pytest.fixture(scope="module")
def results():
    return run_by_world(_all, CASES)


def _err(got, want):
    return float((got - want).abs().max()), float(want.abs().max()) or 1.0


@pytest.mark.parametrize("name", list(CASES))
def test_etp_equals_single_process(name, results):
    world, ep, fmt, replicated = CASES[name]
    etp = world // ep
    outs, dxs, ref = reference(world // etp if replicated else world, fmt)
    for rank, (y, dx, grads, offset, local) in enumerate(results[name]):
        mb = rank // etp if replicated else rank
        for got, want, what in ((y, outs[mb], "output"), (dx, dxs[mb], "input grad")):
            err, scale = _err(got, want)
            assert err <= FP64_REL * scale, (rank, what, err, scale)
        assert local == E // ep
        for n, (g, shard) in grads.items():
            want = ref[n]
            if n.startswith("experts."):
                want = want[offset:offset + local]
                assert shard is not None, n
                want = want.index_select(shard[0], shard[1])
            err, scale = _err(g, want)
            assert g.shape == want.shape and err <= FP64_REL * scale, (rank, n, err, scale)


def test_etp_without_amax_reduction_misses(results):
    outs, _, _ = reference(2, "nvfp4")
    for rank, (y, *_rest) in enumerate(results["unreduced"]):
        err, scale = _err(y, outs[rank])
        assert err > 1e4 * FP64_REL * scale, (rank, err)
