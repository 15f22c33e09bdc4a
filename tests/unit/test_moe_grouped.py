"""Grouped expert compute (`GroupedExperts.grouped_forward`: two `grouped_mm` GEMMs over all
experts) against a float64 reference, next to the per-expert loop it replaces.

Tolerance: a first-order running error bound, elementwise, in float64. An fp32 GEMM over K terms
is within γ_K·(|A|·|B|) of the exact product in any summation order (Higham), so the bound does not
depend on which kernel or blocking the grouped GEMM picks; SiLU and the products around it add a
few ulps (8u·|value|, generous for ATen's vectorised exp) plus the propagated input errors
(|silu'| ≤ 1.1, |silu''| ≤ 0.5). The bound is doubled for the neglected second-order terms. A
wrong expert, row or group offset is an O(1) error, far outside it.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron_fp4.fp4 import Numerics, Recipe
from megatron_fp4.model import build_model
from megatron_fp4.config import Config
from megatron_fp4.model.moe import GroupedExperts, can_group
from tests.numerics import gamma
from tests.unit.test_moe_expert_grads import _nodes  # autograd node names reachable from a grad_fn

U = 2.0 ** -24


def _experts(E=5, H=48, Fd=24, seed=0):
    torch.manual_seed(seed)
    ex = GroupedExperts(E, H, Fd, Recipe(mode="bf16"))
    with torch.no_grad():
        ex.w13.normal_(0, 0.2)
        ex.w2.normal_(0, 0.2)
    return ex


def _run(ex, x, counts, dy, grouped):
    ex.grouped = grouped
    ex.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = ex(x, counts)
    y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, "dw13": ex.w13.grad.clone(), "dw2": ex.w2.grad.clone()}


def _reference_and_bound(ex, x, counts, dy):
    """Float64 forward/backward per expert and the elementwise fp32 error bound of each result."""
    d = torch.float64
    Fd = ex.ffn
    ref = {"y": [], "dx": [], "dw13": torch.zeros_like(ex.w13, dtype=d), "dw2": torch.zeros_like(ex.w2, dtype=d)}
    err = {"y": [], "dx": [], "dw13": torch.zeros_like(ref["dw13"]), "dw2": torch.zeros_like(ref["dw2"])}
    for e, (xe, dye) in enumerate(zip(x.double().split(counts), dy.double().split(counts))):
        if not xe.shape[0]:
            continue
        w13, w2, n = ex.w13[e].detach().double(), ex.w2[e].detach().double(), xe.shape[0]
        h = xe @ w13.t()
        e_h = gamma(ex.hidden) * (xe.abs() @ w13.abs().t())
        g, u = h.split(Fd, -1)
        e_g, e_u = e_h.split(Fd, -1)
        sg = torch.sigmoid(g)
        s, ds = g * sg, sg * (1 + g * (1 - sg))  # silu, silu'
        a = s * u
        e_a = 1.1 * e_g * u.abs() + s.abs() * e_u + 8 * U * a.abs()
        ref["y"].append(a @ w2.t())
        err["y"].append(gamma(Fd) * (a.abs() @ w2.abs().t()) + e_a @ w2.abs().t())
        da = dye @ w2
        e_da = gamma(ex.hidden) * (dye.abs() @ w2.abs())
        ref["dw2"][e] = dye.t() @ a
        err["dw2"][e] = gamma(n) * (dye.abs().t() @ a.abs()) + dye.abs().t() @ e_a
        dg, du = da * u * ds, da * s
        e_dg = 1.1 * (e_da * u.abs() + da.abs() * e_u) + 0.5 * (da * u).abs() * e_g + 8 * U * dg.abs()
        e_du = e_da * s.abs() + 1.1 * da.abs() * e_g + 8 * U * du.abs()
        dh, e_dh = torch.cat([dg, du], -1), torch.cat([e_dg, e_du], -1)
        ref["dx"].append(dh @ w13)
        err["dx"].append(gamma(2 * Fd) * (dh.abs() @ w13.abs()) + e_dh @ w13.abs())
        ref["dw13"][e] = dh.t() @ xe
        err["dw13"][e] = gamma(n) * (dh.abs().t() @ xe.abs()) + e_dh.t() @ xe.abs()
    for k in ("y", "dx"):
        ref[k], err[k] = torch.cat(ref[k]), torch.cat(err[k])
    return ref, err


@pytest.mark.parametrize("counts", [[7, 0, 13, 1, 9], [0, 0, 30, 0, 0], [6, 6, 6, 6, 6]])
def test_grouped_experts_match_float64_reference_like_the_loop(counts):
    ex = _experts()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(counts), ex.hidden, generator=g)
    dy = torch.randn(sum(counts), ex.hidden, generator=g)
    ref, bound = _reference_and_bound(ex, x, counts, dy)
    for grouped in (True, False):
        got = _run(ex, x, counts, dy, grouped)
        for k in ref:
            diff = (got[k].double() - ref[k]).abs()
            worst = (diff - 2 * bound[k]).max().item()
            assert worst <= 0, f"grouped={grouped} {k}: exceeds the fp32 error bound by {worst:.3e}"
    idle = [e for e, c in enumerate(counts) if c == 0]
    got = _run(ex, x, counts, dy, True)
    assert all(torch.count_nonzero(got["dw13"][e]) == 0 and torch.count_nonzero(got["dw2"][e]) == 0 for e in idle)


def test_grouped_path_runs_only_where_it_keeps_the_numerics():
    x = torch.randn(4, 8)
    assert can_group(Recipe(mode="bf16"), x) is True
    assert not can_group(Recipe(mode="fp4_resq"), x)  # per-expert MoEResQ (SR streams keyed by expert)
    assert not can_group(Recipe(mode="fp4"), x)
    assert not can_group(Recipe(mode="bf16"), x.double())  # the fp64 verification mode keeps the loop
    assert not can_group(Recipe(mode="bf16"), x, Numerics(invariance="exact"))  # per-row exact GEMMs, per expert
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not can_group(Recipe(mode="bf16"), x)


def test_grouped_graph_has_no_per_expert_nodes():
    ex = _experts(E=16)
    y = ex(torch.randn(40, ex.hidden), [3, 0, 2, 5, 1, 0, 4, 2, 3, 3, 3, 3, 3, 3, 3, 2])
    names = _nodes(y.grad_fn)
    assert "UnbindBackward0" not in names and "SelectBackward0" not in names
    assert names.count("MmBackward0") == 0 and len(names) < 20  # two grouped GEMMs, not 2 x 16 linears


def test_model_logits_grouped_equal_loop_within_fp32_bound():
    """Whole model, FP4 off: grouped experts vs the loop. Both are fp32 computations of the same
    function; their logits differ by summation order only (the HF parity test's 1e-5 argument)."""
    cfg = Config()
    cfg.model.num_layers, cfg.model.vocab_size = 2, 64
    model = build_model(cfg, seed=0)
    model.set_fp4_mode("bf16")
    tokens = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(2))
    out = {}
    for grouped in (True, False):
        for m in model.modules():
            if isinstance(m, GroupedExperts):
                m.grouped = grouped
        with torch.no_grad():
            out[grouped] = model(tokens).logits
    err = ((out[True] - out[False]).abs().max() / out[False].abs().max()).item()
    assert err <= 1e-5, err
    assert F.mse_loss(out[True], out[False]).item() < 1e-10


# -- FP4 experts without autograd (rollout / scoring outside the batch-invariant mode) -------------
def _fp4_experts(mode, fmt="nvfp4"):
    torch.manual_seed(0)
    recipe = Recipe(mode=mode) if fmt == "nvfp4" else Recipe.for_format(mode, "mxfp4")
    ex = GroupedExperts(6, 64, 32, recipe)
    ex.quant_name, ex.numerics = "layers.0.mlp.experts", Numerics()
    with torch.no_grad():
        ex.w13.normal_(0, 0.1)
        ex.w2.normal_(0, 0.1)
    return ex


def test_fp4_input_rows_quantize_alone_so_batching_over_experts_keeps_their_codes():
    """The premise of the grouped FP4 path, by construction for row scales, 1-D blocks, nearest."""
    from megatron_fp4.fp4 import resq_quantize
    ex = _fp4_experts("fp4_resq")
    x, counts = torch.randn(20, 64), [3, 0, 7, 1, 0, 9]
    whole = resq_quantize(x, ex.recipe.input, True)
    per = torch.cat([resq_quantize(c, ex.recipe.input, True) for c in x.split(counts) if c.shape[0]])
    assert torch.equal(whole.view(torch.int32), per.view(torch.int32))


@pytest.mark.parametrize("mode,fmt", [("fp4", "nvfp4"), ("fp4_resq", "nvfp4"), ("fp4_resq", "mxfp4")])
def test_grouped_fp4_forward_matches_the_per_expert_moeresq_loop(mode, fmt):
    """Same quantized operands (above), per expert the same fp32 GEMM. Compared GEMM by GEMM on the
    same input, both paths are within Higham's bound of the float64 product of those operands
    (`assert_fp4_gemm`); end to end a one-ulp GEMM difference could flip an FP4 code of the second
    GEMM's input, so the end-to-end outputs are not compared, the forward is checked to be those
    two GEMMs composed (bitwise: the same calls on the same bits)."""
    from megatron_fp4.fp4 import invariant, moeresq_linear
    ex = _fp4_experts(mode, fmt)
    x, counts = torch.randn(40, 64), [5, 0, 17, 1, 0, 17]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)

    def loop(a, w, which):
        return torch.cat([moeresq_linear(c, w[e], recipe=ex.recipe, name=f"{ex.quant_name}.{e}.{which}",
                                         numerics=ex.numerics)
                          for e, c in enumerate(a.split(counts)) if c.shape[0]])

    def act(h):
        gate, up = h.split(ex.ffn, dim=-1)
        return invariant.silu(gate) * up
    with torch.no_grad(), ex.numerics.cached_weights():
        ex.grouped = True
        assert can_group_fp4_for(ex, x)
        got = ex(x, counts)
        again = ex(x, counts)  # Q(W) from the cache: the same bits
        h_grouped = ex._fp4_grouped_linear(x, ex.w13, offs, "w13")
        assert torch.equal(got, ex._fp4_grouped_linear(act(h_grouped), ex.w2, offs, "w2"))
        ex.grouped = False
        want = ex(x, counts)
        h_loop = loop(x, ex.w13, "w13")
        assert torch.equal(want, loop(act(h_loop), ex.w2, "w2"))
        a = act(h_loop)  # the second GEMM of both paths on the same input
        stage2 = ex._fp4_grouped_linear(a, ex.w2, offs, "w2"), loop(a, ex.w2, "w2")
    assert torch.equal(got, again)
    for h in (h_grouped, h_loop):
        assert_fp4_gemm(h, x, ex.w13, counts, ex.recipe)
    for y in stage2:
        assert_fp4_gemm(y, a, ex.w2, counts, ex.recipe)


def assert_fp4_gemm(got, x, w, counts, recipe):
    """Per expert e, elementwise: |got − Q̃(x_e)·Q(W_e)ᵀ| <= γ_{K+2}·(|Q(x_e)| + |Q(x_e − Q(x_e))|)·|Q(W_e)|ᵀ,
    the products in float64 (Higham: a K-term fp32 dot product in any order, +1 rounding for adding
    the residual term, +1 for the output)."""
    from megatron_fp4.fp4 import fake_quantize
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        xe = x[start:start + n]
        q = fake_quantize(xe, recipe.input)
        qr = fake_quantize(xe - q, recipe.input) if recipe.compensated else torch.zeros_like(q)
        qw = fake_quantize(w[e].detach(), recipe.weight).double()
        ref = (q.double() + qr.double()) @ qw.T
        bound = gamma(xe.shape[-1] + 2) * ((q.double().abs() + qr.double().abs()) @ qw.abs().T)
        err = (got[start:start + n].double() - ref).abs()
        assert (err <= bound).all(), (e, float((err / bound).max()))
        start += n


def can_group_fp4_for(ex, x):
    from megatron_fp4.model.moe import can_group_fp4
    return can_group_fp4(ex.recipe, x, (ex.w13, ex.w2), ex.numerics)


def test_grouped_fp4_path_only_where_rows_quantize_alone_and_nothing_needs_gradients():
    from dataclasses import replace
    from megatron_fp4.model.moe import can_group_fp4
    ex = _fp4_experts("fp4_resq")
    x, w = torch.randn(4, 64), (ex.w13, ex.w2)
    assert not can_group_fp4(ex.recipe, x, w)  # grad mode with trainable weights: the per-expert autograd path
    with torch.no_grad():
        assert can_group_fp4(ex.recipe, x, w)
        assert not can_group_fp4(Recipe(mode="bf16"), x, w)
        assert not can_group_fp4(ex.recipe, x.double(), w)
        sr = replace(ex.recipe, input=replace(ex.recipe.input, rounding="stochastic"))
        assert not can_group_fp4(sr, x, w)  # SR streams are keyed by expert
        tensor_scale = replace(ex.recipe, input=replace(ex.recipe.input, scale="tensor"))
        assert not can_group_fp4(tensor_scale, x, w)  # one amax over every expert's rows
        assert not can_group_fp4(ex.recipe, x, w, Numerics(invariance="exact"))  # exact GEMMs per expert


def test_many_rows_per_expert_keep_the_loop_where_it_is_as_fast():
    ex = _experts(E=2)
    y = ex(torch.randn(2 * ex.max_group_rows + 2, ex.hidden), [ex.max_group_rows + 1] * 2)
    assert _nodes(y.grad_fn).count("MmBackward0") == 4  # two linears per expert
