"""EP layers (ep2, ep4; all-to-all and GC-MoE) against the single-process MoELayer, same init.

Each rank runs the single-process reference on the global batch (the ranks' batches concatenated in
rank order) and its EP layer on its own slice. Expert GEMMs then see the same rows in the same
order, but not the same memory: the EP side reads a received buffer, the reference a slice of the
gathered batch, and MKL may take another code path for other alignments (seen with
``MKL_CBWR=COMPATIBLE`` under ``ATEN_CPU_CAPABILITY=default``: 5e-6 in fp32). So the layers run in
float64 and outputs, input grads and expert weight grads must agree within ``FP64_REL`` of their
scale (tests/numerics.py); FP4 operands are still quantized from fp32. The router grad is a
per-rank partial sum (all-reduced over ep here, as the dp grad reduction would): the same T products
dl·x summed in another order, so every element lies within 2·γ_T·Σ_t |dl_t|·|x_t| of the reference
(``sum_order_bound``, tests/numerics.py), with dl the router-logit gradient captured from the reference.

Expert weight grads are compared with a second reference that runs the ranks' batches as
consecutive micro-batches (gradients accumulated), as the single-process trainer runs the
micro-batches that dp ranks run at once: FP4 wgrad quantizes along tokens, and the EP experts
quantize each source rank's rows apart (`DispatchPlan.expert_segments`) to equal exactly that.
Without FP4 both references give the same expert grads up to sum order.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_fp4.fp4 import Recipe
from megatron_fp4.model.moe import MoELayer, init_moe_params
from megatron_fp4.parallel.moe.expert_parallel import apply_expert_parallel, gather_expert_params, is_expert_param
from megatron_fp4.parallel.mesh import ParallelMesh
from tests.distributed.launch import run_distributed
from tests.numerics import FP64_REL, sum_order_bound

HIDDEN, FFN = 32, 32


def make_layer(num_experts, top_k, mode="bf16", seed=0, force_expert=None):
    layer = MoELayer(HIDDEN, num_experts, top_k, FFN, Recipe(mode=mode))
    init_moe_params(layer, 0.5, 0.3, torch.Generator().manual_seed(seed))
    if force_expert is not None:  # with positive inputs every token picks `force_expert` first
        with torch.no_grad():
            layer.router.weight.fill_(-0.1)
            layer.router.weight[force_expert] = 0.1
    return layer


def make_batch(world, tokens, seed, positive=False):
    """Global batch [sum(tokens), H] and per-output grad; `tokens` is a list (per rank) or an int."""
    tokens = tokens if isinstance(tokens, list) else [tokens] * world
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(sum(tokens), HIDDEN, generator=g)
    x = x.abs() + 0.1 if positive else x
    return x, torch.randn(sum(tokens), HIDDEN, generator=g), tokens


def run_layer(layer, x, gy):
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    (y * gy).sum().backward()
    return y.detach(), x.grad


def micro_batch_expert_grads(layer, x, gy, tokens):
    """Expert weight grads of `layer` run on each rank's rows as a micro-batch of its own."""
    layer.zero_grad(set_to_none=True)
    lo = 0
    for n in tokens:
        if n:
            (layer(x[lo:lo + n]) * gy[lo:lo + n]).sum().backward()
        lo += n
    return layer.experts.w13.grad, layer.experts.w2.grad


def max_diff(a, b):
    return (a - b).abs().max().item() if a.numel() else 0.0


def _capture_router_terms(router) -> dict:
    """Record the router's input and its logits' gradient (the terms of the router weight grad)."""
    seen, forward = {}, router.forward

    def capture(x):
        out = forward(x)
        seen["x"] = x.detach().to(out[0].dtype)
        out[0].register_hook(lambda g: seen.__setitem__("dl", g.detach()))
        return out

    router.forward = capture
    return seen


def compare_case(rank, world, mesh, case):
    """One case -> dict of diffs (0.0 == bitwise) for this rank."""
    E, k, mode, seed = case["experts"], case["top_k"], case.get("mode", "bf16"), case["seed"]
    force = case.get("force_expert")
    ref = make_layer(E, k, mode, seed, force).double()
    seen = _capture_router_terms(ref.router)
    ep_layer = apply_expert_parallel(make_layer(E, k, mode, seed, force).double(), mesh, case["dispatcher"],
                                     chunk_tokens=case.get("chunk", 64))
    x, gy, tokens = make_batch(world, case["tokens"], seed, positive=force is not None)
    x, gy = x.double(), gy.double()
    y_ref, dx_ref = run_layer(ref, x, gy)
    w13_ref, w2_ref = micro_batch_expert_grads(make_layer(E, k, mode, seed, force).double(), x, gy, tokens)
    lo = sum(tokens[:rank])
    sl = slice(lo, lo + tokens[rank])
    y, dx = run_layer(ep_layer, x[sl], gy[sl])
    e_lo = ep_layer.experts.expert_offset
    e_sl = slice(e_lo, e_lo + ep_layer.experts.num_experts)
    router_grad = ep_layer.router.weight.grad.clone()
    dist.all_reduce(router_grad, group=mesh.group("ep"))
    x_r, dl = seen["x"], seen["dl"]
    bound = sum_order_bound(dl.abs().t() @ x_r.abs(), x_r.shape[0] + 1, dl.dtype)
    def scaled(a, b):  # max |a − b| relative to b's scale (0 for empty or all-zero b that a matches)
        d = max_diff(a, b)
        return d / max(b.abs().max().item(), 1e-300) if d else 0.0
    return {
        "y": scaled(y, y_ref[sl]), "dx": scaled(dx, dx_ref[sl]),
        "w13": scaled(ep_layer.experts.w13.grad, w13_ref[e_sl]),
        "w2": scaled(ep_layer.experts.w2.grad, w2_ref[e_sl]),
        "router_excess": float(((router_grad - ref.router.weight.grad).abs().double() - bound).max()),
    }


def _worker_vs_single(rank, world, cases):
    mesh = ParallelMesh.build(pp=1, dp=world, ep=world)
    return [compare_case(rank, world, mesh, case) for case in cases]


def _cases(world, dispatchers):
    E = 2 * world
    base = [
        dict(top_k=2, tokens=24),
        dict(top_k=1, tokens=24),
        dict(top_k=1, tokens=16, force_expert=E - 1),   # every token to the last rank's expert
        dict(top_k=2, tokens=16, force_expert=0),       # ranks past 1 receive nothing
        dict(top_k=2, tokens=[5, 0] + [7] * (world - 2)),  # a rank with no tokens of its own
        dict(top_k=2, tokens=24, mode="fp4_resq"),
        dict(top_k=1, tokens=16, mode="fp4"),
    ]
    out = []
    for d in dispatchers:
        for i, c in enumerate(base):
            out.append(dict(c, experts=E, seed=i, dispatcher=d, chunk=5 if d == "gcmoe" else 64))
    return out


def _assert_cases(cases, results):
    for rank, per_rank in enumerate(results):
        for case, diffs in zip(cases, per_rank):
            msg = f"rank {rank} case {case}: {diffs}"
            assert diffs["y"] <= FP64_REL and diffs["dx"] <= FP64_REL, msg
            assert diffs["w13"] <= FP64_REL and diffs["w2"] <= FP64_REL, msg
            assert diffs["router_excess"] <= 0, msg


def _worker_ep2(rank, world, cases):
    """The module's 2-process runs in one spawn: the cases against the single process, then the surgery."""
    return {"cases": _worker_vs_single(rank, world, cases), "surgery": _worker_surgery(rank, world)}


@pytest.fixture(scope="module")
def ep2_results():
    cases = _cases(2, ["alltoall", "gcmoe"])
    return cases, run_distributed(_worker_ep2, 2, (cases,))


def test_ep2_matches_single_process(ep2_results):
    cases, results = ep2_results
    _assert_cases(cases, [r["cases"] for r in results])


def test_ep4_matches_single_process():
    cases = _cases(4, ["alltoall", "gcmoe"])
    cases = [c for c in cases if c.get("mode", "bf16") != "fp4" or c["dispatcher"] == "alltoall"]
    _assert_cases(cases, run_distributed(_worker_vs_single, 4, (cases,)))


def _worker_surgery(rank, world):
    mesh = ParallelMesh.build(pp=1, dp=world, ep=world)
    full = make_layer(4, 2, seed=3)
    layer = apply_expert_parallel(make_layer(4, 2, seed=3), mesh, "gcmoe")
    marked = sorted(n for n, p in layer.named_parameters() if is_expert_param(p))
    groups = {p.expert_group for p in layer.experts.parameters()}
    gathered = gather_expert_params(layer, mesh)
    return {
        "marked": marked, "groups": groups, "local": layer.experts.num_experts,
        "offset": layer.experts.expert_offset, "router_marked": is_expert_param(layer.router.weight),
        "gather_exact": all(torch.equal(gathered[f"experts.{n}"], getattr(full.experts, n)) for n in ("w13", "w2")),
    }


def test_apply_marks_params_and_gather_restores_full_weights(ep2_results):
    results = [r["surgery"] for r in ep2_results[1]]
    for rank, r in enumerate(results):
        assert r["marked"] == ["experts.w13", "experts.w2"] and r["groups"] == {"edp"}
        assert r["local"] == 2 and r["offset"] == 2 * rank and not r["router_marked"]
        assert r["gather_exact"]
