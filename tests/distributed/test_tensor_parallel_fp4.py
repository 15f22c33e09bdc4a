"""FP4 on the linears tensor parallelism cuts (tp2, ±SP), against the single process in float64.

Scope experts+attention and a dense FP4 MLP layer, MoEResQ (``fp4_resq``) in NVFP4 and MXFP4: q/k/v
and gate/up are column-parallel, o and down row-parallel, each an FP4 linear with its
`fp4.tensor_cut.TensorCut`. The loss, the gathered logits and every gradient must agree with the
single process within FP64_REL of their scale (tests/numerics.py): with the global amaxes reduced
over the group every slice quantizes to the single process's codes, and the partial GEMM sums add
the same products in another order (~1e-16 relative in float64). Without the reduction the NVFP4
global scales of the slices differ, and the same run misses the reference by orders of magnitude
more (checked: the reduction is what the equality rests on). At one layer the codes themselves
are compared: ``Q(W)`` of this rank's q_proj rows and o_proj columns equals the slice of the
single process's ``Q(W)`` bit for bit (codes, block scales, global scale).

The weight cache (``Numerics.cached_weights``): a slice's cached ``Q(W)`` holds the group's amax;
two micro-batches reuse it, then every rank scales its weights in place (as an optimizer step
does, on all shards at once) and the next micro-batch recomputes it: loss and gradients of that
micro-batch equal the single process's doing the same.
"""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.fp4 import quantize_mxfp4, quantize_nvfp4
from megatron_fp4.model.transformer import build_model, lm_loss
from tests.distributed.launch import run_distributed
from tests.distributed.test_tensor_parallel import batch, check_equal, make_cfg, run_tp
from tests.numerics import FP64_REL

pytestmark = pytest.mark.distributed

CASES = {
    "nvfp4": dict(scope="experts+attention", dense_layers=[0], num_kv_heads=2, sp=False),
    "nvfp4_sp": dict(scope="experts+attention", dense_layers=[0], num_kv_heads=2, sp=True),
    # MXFP4's 32-element blocks: one 16-wide kv head per rank would straddle ranks, so 4 kv heads
    "mxfp4": dict(scope="experts+attention", dense_layers=[0], num_kv_heads=4, sp=False, format="mxfp4"),
    "mxfp4_sp": dict(scope="experts+attention", dense_layers=[0], num_kv_heads=4, sp=True, format="mxfp4"),
}
CODE_LAYERS = ("layers.1.self_attn.q_proj", "layers.1.self_attn.o_proj")


def _quantize(w: torch.Tensor, fmt, amax_reduce=None):
    if fmt.format == "mxfp4":
        return quantize_mxfp4(w.float(), scale_mode=fmt.mx_scale_mode)
    return quantize_nvfp4(w.float(), scale=fmt.scale, block=fmt.block, amax_reduce=amax_reduce)


def _fields(q) -> tuple:
    return q.codes, q.block_scales.view(torch.uint8), q.global_scale


def _cached_steps(cfg, model, plan):
    """Two micro-batches under one weight cache, an in-place weight change, a third: its result."""
    store: dict = {}
    with model.numerics.cached_weights(store):
        run_tp(cfg, model, plan, False)
        held = len(store)
        run_tp(cfg, model, plan, False)
        assert held and len(store) == held  # the second micro-batch hit the cache
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)
        model.zero_grad(set_to_none=True)
        return run_tp(cfg, model, plan, False)


def cached_reference(case: dict):
    cfg = make_cfg(case)
    model = build_model(cfg, seed=5).double().train()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)
    tokens, labels, _ = batch(cfg, False)
    logits = model(tokens).logits
    loss = lm_loss(logits, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, logits.detach()


def _rank(rank, world, key):
    import torch.distributed as dist

    from megatron_fp4.fp4.tensor_cut import TensorCut
    from megatron_fp4.parallel.tensor_parallel import parallelize_tp
    name, padded = key
    case = CASES[name]
    cfg = make_cfg(case)
    model = build_model(cfg, seed=5).double().train()
    plan = parallelize_tp(model, dist.group.WORLD, sequence_parallel=case["sp"])
    modules = dict(model.named_modules())
    cuts = {n: m.tp_cut for n, m in modules.items() if getattr(m, "tp_cut", None) is not None}
    codes = {}
    for layer in CODE_LAYERS:
        lin = modules[layer]
        fmt = lin.recipe.weight
        codes[layer] = (_fields(_quantize(lin.weight.detach(), fmt, lin.tp_cut.reducer(fmt, "weight"))),
                        lin.weight.tp_shard)
    result = run_tp(cfg, model, plan, padded)
    unreduced = None
    if name == "nvfp4":  # the same run with every slice's amax left local
        model = build_model(cfg, seed=5).double().train()
        plan = parallelize_tp(model, dist.group.WORLD, sequence_parallel=case["sp"])
        for n, m in model.named_modules():
            if getattr(m, "tp_cut", None) is not None:
                m.tp_cut = TensorCut(m.tp_cut.kind, m.tp_cut.size, lambda a: a)
        unreduced = run_tp(cfg, model, plan, padded)
    cached = None
    if name == "nvfp4_sp":
        model = build_model(cfg, seed=5).double().train()
        cached = _cached_steps(cfg, model, parallelize_tp(model, dist.group.WORLD, sequence_parallel=True))
    return result, codes, sorted(cuts), unreduced, cached


KEYS = [(name, False) for name in CASES] + [("nvfp4", True)]


def _all(rank, world):
    return {key: _rank(rank, world, key) for key in KEYS}


@pytest.fixture(scope="module")
def fp4_results():
    return run_distributed(_all, 2, timeout_s=900)


@pytest.mark.parametrize("key", KEYS, ids=[f"{n}{'_padded' if p else ''}" for n, p in KEYS])
def test_tp2_fp4_equals_single_process(key, fp4_results):
    name, padded = key
    results = [by_key[key] for by_key in fp4_results]
    for _, _, cut_names, _, _ in results:  # every attention and dense-MLP projection is an FP4 cut
        assert len(cut_names) == 4 + 4 + 3 and all(n.endswith("_proj") for n in cut_names), cut_names
    check_equal(CASES[name], padded, [r[0] for r in results])


@pytest.mark.parametrize("name", list(CASES))
def test_tp2_fp4_weight_codes_are_slices(name, fp4_results):
    cfg = make_cfg(CASES[name])
    ref = dict(build_model(cfg, seed=5).double().named_modules())
    for rank, by_key in enumerate(fp4_results):
        for layer, (fields, (dim, index)) in by_key[(name, False)][1].items():
            fmt = ref[layer].recipe.weight
            whole = _fields(_quantize(ref[layer].weight.detach(), fmt))
            for got, want_full, what in zip(fields, whole, ("codes", "block scales", "global scale")):
                if what == "block scales":  # one scale per tile/block: the slice's blocks
                    step = {0: 16 if fmt.block == "2d" else 1, 1: fmt.block_size}[dim]
                    index = index[::step] // step
                if what == "global scale" and (want_full is None or want_full.dim() == 0):
                    assert (got is None and want_full is None) or torch.equal(got, want_full), (rank, layer, what)
                    continue
                want = want_full.index_select(dim, index)
                assert torch.equal(got, want), (rank, layer, what)


def test_tp2_fp4_cached_weights_follow_the_shards(fp4_results):
    check_equal(CASES["nvfp4_sp"], False, [by_key[("nvfp4_sp", False)][4] for by_key in fp4_results],
                ref=cached_reference(CASES["nvfp4_sp"]))


def test_tp2_fp4_without_amax_reduction_misses(fp4_results):
    """The unreduced run is far off the reference: the test above rests on the reduction."""
    case = CASES["nvfp4"]
    cfg = make_cfg(case)
    model = build_model(cfg, seed=5).double().train()
    tokens, labels, mask = batch(cfg, False)
    ref = model(tokens, attention_mask=mask).logits.detach()
    for by_key in fp4_results:
        _, _, full, _ = by_key[("nvfp4", False)][3]
        assert float((full - ref).abs().max()) > 1e4 * FP64_REL * float(ref.abs().max())
