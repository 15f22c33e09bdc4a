"""The MoEResQ backward split into dgrad and wgrad halves.

Bitwise claims hold by construction: the halves run the same ops on the same operands as the
formulas written out below (the quantizers of `fp4/resq.py` and one GEMM each), only in separate
autograd nodes.
The zero-bubble passes are torch.distributed.pipelining's own `stage_backward_input` /
`stage_backward_weight`, which need no process group.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

import megatron_fp4.fp4.moeresq as moeresq
from megatron_fp4.fp4 import MoEResQLinear, Numerics, Recipe, fake_quantize, moeresq_linear, resq_quantize

NUM = Numerics()  # the numerics the tests' linears compute with


def data(dtype, tokens=40, d_in=64, d_out=32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, tokens // 4, d_in, generator=g)
    w = torch.randn(d_out, d_in, generator=g) / d_in ** 0.5
    b = torch.randn(d_out, generator=g)
    dy = torch.randn(4, tokens // 4, d_out, generator=g)
    return [t.to(dtype) for t in (x, w, b, dy)]


def run(x, w, b, dy, recipe):
    xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = moeresq_linear(xs, ws, bs, recipe=recipe, numerics=NUM)
    y.backward(dy)
    return y, xs.grad, ws.grad, bs.grad


def col(a, fmt, comp):
    """The wgrad operand written out: tokens padded to the block, transposed, Q̃."""
    pad = (-a.shape[0]) % fmt.block_size
    at = (F.pad(a.t(), (0, pad)) if pad else a.t()).contiguous()
    return resq_quantize(at, fmt, comp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("mode", ["fp4", "fp4_resq"])
def test_split_is_bitwise_the_formulas(mode, fmt, dtype):
    recipe = Recipe.for_format(mode, fmt)
    comp = recipe.compensated
    x, w, b, dy = data(dtype)
    y, dx, dw, db = run(x, w, b, dy, recipe)
    assert all(t.dtype == dtype for t in (y, dx, dw, db))
    # the MoEResQ forward and FP4 backward, written out: Q̃(x)·Q(W)ᵀ, Q̃_row(dY)·Q(W), Q̃_col(dY)ᵀ·Q̃_col(X)
    x2, dy2 = x.reshape(-1, x.shape[-1]).float(), dy.reshape(-1, dy.shape[-1]).float()
    wq = fake_quantize(w.float(), recipe.weight)
    assert torch.equal(y, F.linear(resq_quantize(x2, recipe.input, comp), wq, b.float()).to(dtype).reshape(y.shape))
    assert torch.equal(dx, (resq_quantize(dy2, recipe.grad_output, comp) @ wq).to(dtype).reshape(x.shape))
    assert torch.equal(dw, (col(dy2, recipe.grad_output, comp) @ col(x2, recipe.input, comp).t()).to(dtype))
    assert torch.equal(db, dy2.sum(0).to(dtype))


def test_straight_through_backward_is_the_unquantized_formulas():
    recipe = Recipe(quantize_backward=False)
    x, w, b, dy = data(torch.float32)
    y, dx, dw, db = run(x, w, b, dy, recipe)
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    wq = fake_quantize(w, recipe.weight)
    assert torch.equal(y, F.linear(resq_quantize(x2, recipe.input, recipe.compensated), wq, b).reshape(y.shape))
    assert torch.equal(dx, (dy2 @ wq).reshape(x.shape))  # dY · Q(W): the straight-through estimator
    assert torch.equal(dw, dy2.t() @ x2)
    assert torch.equal(db, dy2.sum(0))


def test_inputs_without_grad():
    x, w, _, dy = data(torch.float32)
    ws = w.clone().requires_grad_()
    moeresq_linear(x, ws, recipe=Recipe()).backward(dy)  # weight only
    xs = x.clone().requires_grad_()
    moeresq_linear(xs, w, recipe=Recipe()).backward(dy)  # input only
    # each half alone gives the bits of the full backward's (the same ops on the same operands)
    _, dx, dw, _ = run(x, w, torch.zeros(w.shape[0]), dy, Recipe())
    assert torch.equal(ws.grad, dw) and torch.equal(xs.grad, dx)
    with torch.no_grad():
        assert not moeresq_linear(xs, ws, recipe=Recipe()).requires_grad


class Chunk(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = MoEResQLinear(64, 64, recipe=Recipe(), numerics=NUM)
        self.fc2 = MoEResQLinear(64, 64, recipe=Recipe(), numerics=NUM)

    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(h)))  # a residual, as decoder layers end (and not a view)


def counting(monkeypatch):
    calls = {"dgrad": 0, "wgrad": 0, "quantized": []}
    for fn in ("_dgrad", "_wgrad"):
        original = getattr(moeresq, fn)

        def counted(*args, _original=original, _key=fn[1:]):
            calls[_key] += 1
            return _original(*args)
        monkeypatch.setattr(moeresq, fn, counted)
    quantize = moeresq._Site.quantize

    def counted_quantize(site, a, fmt, operand, compensated, **kw):
        calls["quantized"].append(operand)
        return quantize(site, a, fmt, operand, compensated, **kw)
    monkeypatch.setattr(moeresq._Site, "quantize", counted_quantize)
    return calls


def zero_bubble_grads(chunk, h, dy, calls, num_micro_batches=2):
    """Input-grad passes of every micro-batch, then their weight-grad passes (a ZB schedule's order)."""
    params, deferred, dh, per_pass = list(chunk.parameters()), [], [], []
    for _ in range(num_micro_batches):
        hs = h.clone().requires_grad_()
        out = chunk(hs)
        before = dict(calls, quantized=list(calls["quantized"]))
        grads, groups = stage_backward_input([out], [dy], [hs], iter(params))
        per_pass.append(("I", calls["dgrad"] - before["dgrad"], calls["wgrad"] - before["wgrad"],
                         calls["quantized"][len(before["quantized"]):]))
        deferred.append(groups)
        dh.append(grads[0])
    for groups in deferred:
        before = dict(calls, quantized=list(calls["quantized"]))
        stage_backward_weight(iter(params), groups)
        per_pass.append(("W", calls["dgrad"] - before["dgrad"], calls["wgrad"] - before["wgrad"],
                         calls["quantized"][len(before["quantized"]):]))
    return dh, [p.grad.clone() for p in params], per_pass


def test_zero_bubble_passes_run_each_half_once(monkeypatch):
    torch.manual_seed(0)
    chunk = Chunk()
    h, dy = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    calls = counting(monkeypatch)
    dh, dw, per_pass = zero_bubble_grads(chunk, h, dy, calls)
    backward_only = ["grad_output", "grad_output (columnwise)", "input (columnwise)"]
    for kind, n_dgrad, n_wgrad, quantized in per_pass:
        backward_ops = [op for op in quantized if op in backward_only]
        if kind == "I":  # dgrad of both layers, rowwise dY only
            assert (n_dgrad, n_wgrad, backward_ops) == (2, 0, ["grad_output"] * 2)
        else:  # wgrad of both layers, columnwise operands only: once per layer per micro-batch
            assert (n_dgrad, n_wgrad) == (0, 2)
            assert sorted(backward_ops) == sorted(["grad_output (columnwise)", "input (columnwise)"] * 2)

    # same bits as a plain backward of the same micro-batches
    for p in chunk.parameters():
        p.grad = None
    for _ in range(2):
        hs = h.clone().requires_grad_()
        chunk(hs).backward(dy)
        assert torch.equal(hs.grad, dh[0])
    assert all(torch.equal(p.grad, g) for p, g in zip(chunk.parameters(), dw))
