"""Expert capacity under expert parallelism (ep2, all-to-all and GC-MoE) equals the single process.

Capacity counts the tokens of one forward call, so the single-process equivalent of ep rank r is
its own batch run as a call of its own (the single-process trainer runs the dp ranks' micro-batches
one after another). Outputs and input grads must match that per-rank run, expert weight grads the
sum over the ranks' runs, within FP64_REL of their scale (float64; tests/numerics.py)."""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.fp4 import Recipe
from megatron_fp4.model.moe import MoELayer, init_moe_params
from megatron_fp4.parallel.moe.expert_parallel import apply_expert_parallel
from megatron_fp4.parallel.mesh import ParallelMesh
from tests.distributed.launch import run_distributed
from tests.numerics import FP64_REL

pytestmark = pytest.mark.distributed
H, E, K, FACTOR = 16, 4, 2, 0.75


def make_layer(policy):
    m = MoELayer(H, E, K, H, Recipe(mode="bf16"), capacity_factor=FACTOR, drop_policy=policy)
    init_moe_params(m, 0.5, 0.3, torch.Generator().manual_seed(0))
    return m.double()


def _rank(rank, world, dispatcher, policy):
    mesh = ParallelMesh.build(pp=1, dp=world, ep=world)
    g = torch.Generator().manual_seed(9)
    tokens = [20, 12]
    x = torch.randn(sum(tokens), H, generator=g, dtype=torch.float64)
    gy = torch.randn(sum(tokens), H, generator=g, dtype=torch.float64)
    ref = make_layer(policy)
    outs, lo = [], 0
    for n in tokens:  # each rank's batch as a call of its own, expert grads accumulated
        xi = x[lo:lo + n].clone().requires_grad_(True)
        y = ref(xi)
        (y * gy[lo:lo + n]).sum().backward()
        outs.append((y.detach(), xi.grad))
        lo += n
    ep = apply_expert_parallel(make_layer(policy), mesh, dispatcher, chunk_tokens=4)
    lo = sum(tokens[:rank])
    xr = x[lo:lo + tokens[rank]].clone().requires_grad_(True)
    y = ep(xr)
    (y * gy[lo:lo + tokens[rank]]).sum().backward()
    e0, n_local = ep.experts.expert_offset, ep.experts.num_local_experts

    def rel(a, b):
        return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-300)
    return {"y": rel(y.detach(), outs[rank][0]), "dx": rel(xr.grad, outs[rank][1]),
            "w13": rel(ep.experts.w13.grad, ref.experts.w13.grad[e0:e0 + n_local]),
            "w2": rel(ep.experts.w2.grad, ref.experts.w2.grad[e0:e0 + n_local])}


@pytest.mark.parametrize("dispatcher,policy", [("alltoall", "probs"), ("gcmoe", "position")])
def test_capacity_ep2_equals_single_process(dispatcher, policy):
    for diffs in run_distributed(_rank, 2, args=(dispatcher, policy), timeout_s=240):
        assert max(diffs.values()) <= FP64_REL, diffs
