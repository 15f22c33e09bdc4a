"""The training step's hand-written backward passes (issue 37: the step's overhead at realistic
widths): each against autograd through the plain ops it replaces, bitwise where the values are the
same by construction, else against float64 with a stated tolerance."""
import pytest
import torch

from megatron_fp4.config import OptimizerConfig
from megatron_fp4.fp4 import Numerics, invariant
from megatron_fp4.model.dispatch import permute_rows
from megatron_fp4.model.experts import swiglu
from megatron_fp4.model.layers import Embedding
from megatron_fp4.parallel.mesh import ParallelMesh
from megatron_fp4.parallel.zero import ZeroAdamW


def _hex(t):
    return [float(v).hex() for v in t.reshape(-1).tolist()]


@pytest.mark.parametrize("level", ["standard", "batch"])
def test_swiglu_forward_bits_and_gradient(level):
    """Forward: the bits of ``invariant.silu(gate) * up``. Backward (both halves of dh in place):
    against float64 autograd of silu(gate)·up. dgate = dy·up·s·(1 + x(1 − s)) (s = sigmoid(x)) rounds
    ~7 times in fp32 (dy·up, exp, 1 + exp, the division, 1 − s, x·(1 − s) + 1, two products); s carries
    ~3u, which 1 − s turns into an absolute error of ~3u that x multiplies, and x(1 − s) cancels
    against 1 near x ≈ −1.28: |error| <= 8u·|dy·up|·(1 + |x|) (the terms, not the result). dup =
    dy·silu(x): silu's ~3 roundings and the product, 4u·|dup|; below fp32's normal range an absolute
    2^-120 of the inputs' size."""
    nx = Numerics(invariance=level)
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(37, 2 * 24, generator=g) * 4
    h0[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp(−x) overflows; saturates; zero
    dy = torch.randn(37, 24, generator=g)
    h = h0.clone().requires_grad_()
    out = swiglu(h, 24, nx)
    gate, up = h0.split(24, dim=-1)
    assert _hex(out.detach()) == _hex(invariant.silu(gate, nx) * up)
    out.backward(dy)
    hd = h0.double().requires_grad_()
    gd, ud = hd.split(24, dim=-1)
    (torch.nn.functional.silu(gd) * ud).backward(dy.double())
    u = 2.0 ** -24
    dgate_terms = (dy.double() * ud.detach()).abs() * (1 + gd.detach().abs())
    dup_terms = (dy.double() * torch.nn.functional.silu(gd.detach())).abs()
    # plus an absolute floor where a result falls into fp32's subnormal range (silu(−100) ≈ −4e-42)
    tiny = 2.0 ** -120 * dy.double().abs() * (1 + ud.detach().abs()) * (1 + gd.detach().abs())
    bound = torch.cat([8 * u * dgate_terms, 4 * u * dup_terms], dim=-1) + torch.cat([tiny, tiny], dim=-1)
    assert torch.isfinite(h.grad).all()
    assert ((h.grad.double() - hd.grad).abs() <= bound).all()


def test_permute_rows_gradient_is_index_selects_bitwise():
    """Each row receives exactly one term: the inverse gather's gradient equals index_select's
    (an index_add into zeros) in every bit but a −0.0, which the gather keeps (0 + −0 = +0)."""
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(50, 7, generator=g)
    rows = torch.randperm(50, generator=g)
    dy = torch.randn(50, 7, generator=g)
    a, b = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    out = permute_rows(a, rows)
    assert torch.equal(out, x0.index_select(0, rows))
    out.backward(dy)
    b.index_select(0, rows).backward(dy)
    assert _hex(a.grad) == _hex(b.grad)


@pytest.mark.parametrize("fused", [True, False])
def test_embedding_gradient_is_nn_embeddings_bitwise(fused):
    """`layers.Embedding`'s weight gradient, written into ZeroAdamW's zeroed buffer (fused) or
    returned and accumulated by autograd, equals ``nn.Embedding``'s accumulated into zeros, as
    float.hex (repeated tokens: their rows add in token order; a −0.0 row gradient as +0.0)."""
    g = torch.Generator().manual_seed(2)
    emb, ref = Embedding(30, 16), torch.nn.Embedding(30, 16)
    with torch.no_grad():
        ref.weight.copy_(emb.weight)
    opt = ZeroAdamW(emb.named_parameters(), OptimizerConfig(), ParallelMesh.single(), zero_stage=1)
    opt.zero_grad()
    if not fused:
        emb.weight.fused_grad.reset(zeroed=False)  # the claim is refused: autograd accumulates
    tokens = torch.randint(0, 30, (3, 40), generator=g)
    dy = torch.randn(3, 40, 16, generator=g)
    dy[0, 0] = -0.0
    out = emb(tokens)
    assert torch.equal(out, ref(tokens))
    out.backward(dy)
    ref.weight.grad = torch.zeros_like(ref.weight)
    ref(tokens).backward(dy)
    assert emb.weight.grad.data_ptr() == opt.buffers[0].grad.data_ptr()  # still the buffer's view
    assert _hex(emb.weight.grad) == _hex(ref.weight.grad)
