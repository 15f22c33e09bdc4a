"""MoEResQ under torch.autocast: the simulation keeps its fp32 GEMMs, so forward output and every
gradient are bitwise those computed without autocast (CPU autocast to bfloat16 lowers F.linear
and matmul to bf16, which would change the bits by ~1e-3 relative)."""
import pytest
import torch

from megatron_fp4.fp4.moeresq import moeresq_linear
from megatron_fp4.fp4.recipe import Recipe


def _run(recipe, autocast: bool, backward_inside: bool):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g).requires_grad_(True)
    w = torch.randn(48, 64, generator=g).requires_grad_(True)
    b = torch.randn(48, generator=g).requires_grad_(True)
    gy = torch.randn(3, 5, 48, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = moeresq_linear(x, w, b, recipe=recipe, name="layer")
        if backward_inside:  # CPU autograd runs on this thread, inside the autocast region
            y.backward(gy)
    if not backward_inside:
        y.backward(gy)
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("mode", ["fp4_resq", "fp4"])
@pytest.mark.parametrize("backward_inside", [True, False])
def test_autocast_leaves_moeresq_bitwise_unchanged(mode, backward_inside):
    recipe = Recipe(mode=mode)
    want = _run(recipe, autocast=False, backward_inside=backward_inside)
    got = _run(recipe, autocast=True, backward_inside=backward_inside)
    assert got[0].dtype == torch.float32
    for name, a, b in zip(("y", "dx", "dw", "db"), got, want):
        assert torch.equal(a, b), f"{name} changed under autocast: max diff {(a - b).abs().max().item()}"
