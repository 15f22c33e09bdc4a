"""MoE layers under tensor parallel with local tokens (parallel folding), against the single process, fp64.

Each tp rank routes only its chunk of the sequence (`parallel/moe/tp_moe.py`, ``moe_tokens='local'``),
with sequence parallel (the rank is given its chunk) and without (the layer cuts the chunk and
all-gathers its outputs). The experts are FP4 MoEResQ (NVFP4, and MXFP4 in one case) held by an
expert-parallel group folded onto the tp ranks (``AllToAllDispatcher(fold=tp)``):

- tp2 with ep2 on the same 2 processes;
- tp2 × dp2 (4 processes) with ep2 (ep groups = the tp groups, edp = the dp groups) and ep4.

The single-process reference runs each dp rank's batch as a micro-batch of its own (gradients
accumulated), as the dp tests define it: FP4 wgrad quantizes along a micro-batch's tokens, and the
folded dispatcher hands each expert a micro-batch's rows from both tp ranks as one run in the
single process's token order. Outputs, input gradients, the router gradient (partial per tp rank:
`TPPlan.finish_grads`; summed over dp here, as the trainer's dp reduction would) and the expert
gradients (summed over edp here) must agree within FP64_REL of their scale (tests/numerics.py:
sums in another order, ~1e-16 relative). The auxiliary losses are the micro-batch's, not the
chunk's (`MoELayer.token_sum`).
"""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.fp4 import Recipe
from megatron_fp4.model.moe import MoELayer, init_moe_params
from tests.distributed.launch import run_distributed
from tests.numerics import FP64_REL

pytestmark = pytest.mark.distributed

HIDDEN, FFN, E, K, B, T = 32, 32, 4, 2, 2, 32  # ~32 rows per expert: 2+ wgrad blocks along tokens


def make_layer(fmt="nvfp4"):
    recipe = Recipe(mode="bf16") if fmt == "bf16" else Recipe.for_format("fp4_resq", fmt)
    layer = MoELayer(HIDDEN, E, K, FFN, recipe, aux_loss_coef=0.05, z_loss_coef=0.01)
    init_moe_params(layer, 0.5, 0.3, torch.Generator().manual_seed(4))
    return layer.double().train()


def data(dp_rank: int, padded: bool):
    g = torch.Generator().manual_seed(100 + dp_rank)
    x = torch.randn(B, T, HIDDEN, generator=g, dtype=torch.float64)
    gy = torch.randn(B, T, HIDDEN, generator=g, dtype=torch.float64)
    valid = None
    if padded:
        valid = torch.ones(B, T, dtype=torch.long)
        valid[1, :9] = 0
    return x, gy, valid


def reference(dp: int, padded: bool, fmt: str):
    layer = make_layer(fmt)
    outs, dxs = [], []
    for d in range(dp):  # one micro-batch per dp rank
        x, gy, valid = data(d, padded)
        x.requires_grad_(True)
        y = layer(x, valid=valid)
        (y * gy).sum().backward()
        outs.append(y.detach())
        dxs.append(x.grad)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return outs, dxs, grads


def _rank(rank, world, tp, ep, sp, padded, fmt):
    import torch.distributed as dist

    from megatron_fp4.parallel.moe.alltoall import AllToAllDispatcher
    from megatron_fp4.parallel.moe.expert_parallel import shard_experts
    from megatron_fp4.parallel.tensor_parallel import TPPlan
    from megatron_fp4.parallel.moe.tp_moe import moe_local_tokens
    dp = world // tp
    groups = {}  # every rank creates every group, in the same order
    for name, members in (("tp", [[d * tp + t for t in range(tp)] for d in range(dp)]),
                          ("dp", [[d * tp + t for d in range(dp)] for t in range(tp)]),
                          ("ep", [list(range(s, s + ep)) for s in range(0, world, ep)]),
                          ("edp", [list(range(e, world, ep)) for e in range(ep)])):
        for ranks in members:
            g = dist.new_group(ranks) if len(ranks) < world else dist.group.WORLD
            if rank in ranks:
                groups[name] = g
    tp_rank, dp_rank = rank % tp, rank // tp
    layer = make_layer(fmt)
    shard_experts(layer, ep, rank % ep)
    if ep > 1:  # ep 1: the local dispatcher, every rank all experts
        layer.set_dispatcher(AllToAllDispatcher(groups["ep"], ep, E, fold=tp))
    plan = TPPlan(groups["tp"], tp_rank, tp, sp)
    moe_local_tokens(layer, plan)
    x, gy, valid = data(dp_rank, padded)
    chunk = slice(tp_rank * T // tp, (tp_rank + 1) * T // tp)
    if sp:
        x, gy = x[:, chunk], gy[:, chunk]
        valid = None if valid is None else valid[:, chunk]
    x = x.clone().requires_grad_(True)
    y = layer(x, valid=valid)
    (y * gy).sum().backward()
    plan.finish_grads()
    grads = {}
    for n, p in layer.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=groups["edp"] if n.startswith("experts.") else groups["dp"])
        grads[n] = g
    return y.detach(), x.grad, grads, layer.experts.expert_offset


CASES = {  # name: (world, tp, ep, sp, padded, format)
    "tp2_ep2_sp": (2, 2, 2, True, False, "nvfp4"),
    "tp2_ep2": (2, 2, 2, False, True, "nvfp4"),
    "tp2_ep2_sp_mxfp4": (2, 2, 2, True, True, "mxfp4"),
    # FP4 off: no order to keep, ep 1 (the edp group, all ranks, sums the experts' partial grads)
    "tp2_ep1_sp_bf16": (2, 2, 1, True, False, "bf16"),
    "tp2_dp2_ep2_sp": (4, 2, 2, True, False, "nvfp4"),
    "tp2_dp2_ep4_sp": (4, 2, 4, True, True, "nvfp4"),
    "tp2_dp2_ep4": (4, 2, 4, False, False, "nvfp4"),
}


def _all(rank, world, names):
    out = {n: _rank(rank, world, *CASES[n][1:]) for n in names}
    if world == 2:
        out["refused"] = _refused(rank)
        out.update({("model", key): _model_rank(rank, *key) for key in MODEL_KEYS})
    return out


MODEL_CASE = dict(scope="experts+attention", dense_layers=[0], num_kv_heads=2)
MODEL_KEYS = [(False, True), (True, False), (True, True)]  # (sequence parallel, padded)


def _model_rank(rank, sp, padded):
    """The whole model (FP4 attention, a dense FP4 MLP, FP4 MoEResQ experts, a shared expert) under
    `parallelize_tp(moe_tokens='local')` with ep2 on the two tp ranks."""
    import torch.distributed as dist

    from megatron_fp4.model.transformer import build_model
    from megatron_fp4.parallel.moe.alltoall import AllToAllDispatcher
    from megatron_fp4.parallel.moe.expert_parallel import shard_experts
    from megatron_fp4.parallel.tensor_parallel import parallelize_tp
    from tests.distributed.test_tensor_parallel import make_cfg, run_tp
    cfg = make_cfg(MODEL_CASE)
    model = build_model(cfg, seed=5).double().train()
    for moe in model.moe_layers():
        shard_experts(moe, 2, rank)
        moe.set_dispatcher(AllToAllDispatcher(dist.group.WORLD, 2, cfg.model.num_experts, fold=2))
    plan = parallelize_tp(model, dist.group.WORLD, sequence_parallel=sp, moe_tokens="local")
    assert len(plan.expert_grads) == 2 * len(model.moe_layers())
    per = cfg.model.num_experts // 2

    def shard_of(name, p):  # an expert weight: this rank's experts (edp of ep2 on 2 ranks: one rank)
        return (0, torch.arange(rank * per, (rank + 1) * per)) if getattr(p, "is_expert", False) else \
            getattr(p, "tp_shard", None)
    return run_tp(cfg, model, plan, padded, shard_of)


def _refused(rank):
    """FP4 experts with local tokens and no folding dispatcher (ep 1): one clear error."""
    import torch.distributed as dist

    from megatron_fp4.parallel.tensor_parallel import TPPlan
    from megatron_fp4.parallel.moe.tp_moe import moe_local_tokens
    layer = make_layer()
    moe_local_tokens(layer, TPPlan(dist.group.WORLD, rank, 2, True))
    try:
        layer(data(0, False)[0][:, :T // 2])
    except ValueError as err:
        return str(err)
    return None


def run_by_world(fn, cases: dict) -> dict:
    """``fn(rank, world, names)`` (a dict per rank) once per world size of ``cases`` ({name: (world,
    ...)}): {key: [each rank's value]} over every key the ranks return."""
    out = {}
    for world in sorted({c[0] for c in cases.values()}):
        by_rank = run_distributed(fn, world, args=([n for n, c in cases.items() if c[0] == world],), timeout_s=900)
        out.update({key: [r[key] for r in by_rank] for key in by_rank[0]})
    return out


@pytest.fixture(scope="module")
def results():
    return run_by_world(_all, CASES)


def test_fp4_local_tokens_without_folding_are_refused(results):
    for message in results["refused"]:
        assert message and "needs an expert-parallel all-to-all dispatcher folding the tp ranks" in message, message


@pytest.mark.parametrize("sp,padded", MODEL_KEYS)
def test_model_local_moe_tokens_equal_single_process(sp, padded, results):
    from tests.distributed.test_tensor_parallel import check_equal
    check_equal(MODEL_CASE, padded, results[("model", (sp, padded))])



def _close(got, want, what):
    scale = float(want.abs().max()) or 1.0
    err = float((got - want).abs().max())
    assert got.shape == want.shape and err <= FP64_REL * scale, (what, err, scale)


@pytest.mark.parametrize("name", list(CASES))
def test_moe_local_tokens_equal_single_process(name, results):
    world, tp, ep, sp, padded, fmt = CASES[name]
    outs, dxs, ref = reference(world // tp, padded, fmt)
    per = E // ep
    for rank, (y, dx, grads, offset) in enumerate(results[name]):
        tp_rank, dp_rank = rank % tp, rank // tp
        chunk = slice(tp_rank * T // tp, (tp_rank + 1) * T // tp) if sp else slice(None)
        _close(y, outs[dp_rank][:, chunk], (rank, "output"))
        _close(dx, dxs[dp_rank][:, chunk], (rank, "input grad"))
        assert offset == (rank % ep) * per
        for n, g in grads.items():
            want = ref[n][offset:offset + per] if n.startswith("experts.") else ref[n]
            _close(g, want, (rank, n))
