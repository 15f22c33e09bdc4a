"""The fast ``exact``-level kernels give the bits of the first implementation (issue 27).

``_Reference`` keeps that implementation verbatim (before the Karatsuba ``bmm`` limb GEMM, the
position-chunked causal attention without the B·H·T·T·D products, and the halving reduction
trees): an independent derivation of the same numbers, so these tests fail if a speed-up changes
one bit. Its ``tree_sum`` is the tree's top-down definition (a node = its left half + its right
half), not a copy of the level-by-level code under test. Why the bits agree *by construction* (so the claim holds on any CPU and kernel set):

- ``exact_linear``: the old and new code form the same exact integers ``hh``, ``ll`` and ``cross``
  (integer-valued float64 sums below 2^53 are exact in any order and split; ``cross`` is now an
  exact difference) and combine them with the same IEEE operations (a multiplication by a power
  of two is exact, so ``2^(a+b)`` may be applied as ``2^a`` then ``2^b``).
- reduction trees: the same pairs are added at every level (node i of level L covers indices
  [i·2^L, (i+1)·2^L) in both); only the memory layout of the levels differs. Leaves that are zero
  (masked keys past a query's position, padding to a power of two) may be added or dropped: a
  zero added to a nonzero node gives that node, so only the sign of a zero result could move,
  and every tree ends with ``+ 0.0``.

Non-finite activations are outside the claim (a masked key's ``0·inf`` was a NaN before and is
skipped now); the model checks finiteness elsewhere.
"""
from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from megatron_fp4.config import Config
from megatron_fp4.fp4 import Numerics, exact_gemm, invariant
from megatron_fp4.model import build_model, experts
from megatron_fp4.rollout import RolloutEngine, SamplingParams, score
from tests.numerics import single_thread


class _Reference:
    """The batch-invariant kernels as first written (commit 4997d36), kept as the reference."""

    @staticmethod
    def fixed_point_limbs(x):
        xd = x.double()
        amax = xd.abs().amax(-1) if x.shape[-1] else xd.new_zeros(x.shape[0])
        _, e = torch.frexp(torch.nan_to_num(amax, nan=0.0, posinf=0.0))
        exp = e.to(torch.int64) - 24
        xi = torch.round(xd * exact_gemm.pow2_f64(-exp)[:, None])
        hi = torch.round(xi * 2.0 ** -12)
        lo = xi - hi * 2.0 ** 12
        return hi, lo, exp

    @classmethod
    def exact_linear(cls, x, weight, bias=None, cache=None):  # the cache only reuses bits: ignored here
        x2 = x.reshape(-1, x.shape[-1])
        xh, xl, xe = cls.fixed_point_limbs(x2)
        wh, wl, we = cls.fixed_point_limbs(weight)
        w_cross = torch.cat([wl, wh], 1)
        hh = xh @ wh.t()
        cross = torch.cat([xh, xl], 1) @ w_cross.t()
        ll = xl @ wl.t()
        s = (hh * 2.0 ** 24 + cross * 2.0 ** 12) + ll
        y = s * exact_gemm.pow2_f64(xe[:, None] + we[None, :])
        if bias is not None:
            y = y + bias.double()
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @classmethod
    def tree_sum(cls, t, dim=-1, keepdim=False):
        """The tree by its definition, top down: the root covers [0, 2^L) ⊇ [0, n) and a node's sum is
        its left half's plus its right half's (indices ≥ n are +0 leaves). Adding +0 twice equals adding
        it once, so this gives the bits of any tree with those nodes, however its levels are padded."""
        t = t.movedim(dim, -1)
        n = t.shape[-1]
        if n == 0:
            out = t.new_zeros(t.shape[:-1])
        else:
            width = 1 << (n - 1).bit_length()  # the smallest power of two >= n
            out = cls._node(F.pad(t, (0, width - n)), 0, width) + 0.0
        return out.unsqueeze(dim) if keepdim else out

    @classmethod
    def _node(cls, t, lo, width):
        if width == 1:
            return t[..., lo]
        half = width // 2
        return cls._node(t, lo, half) + cls._node(t, lo + half, half)

    @classmethod
    def attention(cls, q, k, v, positions, pad):
        if k.shape[1] != q.shape[1]:  # the caller used to repeat kv heads itself
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        B, H, Tk, D = k.shape
        idx = (pad[:, None] + torch.arange(Tk)[None, :]).clamp(max=Tk - 1)
        gather = idx[:, None, :, None].expand(B, H, Tk, D)
        k, v = torch.gather(k, 2, gather), torch.gather(v, 2, gather)
        scores = cls.tree_sum(q[:, :, :, None, :] * k[:, :, None, :, :], -1) * (D ** -0.5)
        future = torch.arange(Tk)[None, None, None, :] > positions[:, None, :, None]
        scores = scores.masked_fill(future, float("-inf"))
        e = torch.exp(scores - scores.amax(-1, keepdim=True))
        out = cls.tree_sum(e[..., None] * v[:, :, None, :, :], -2)
        return out / cls.tree_sum(e, -1, keepdim=True)

    @classmethod
    def grouped_linear(cls, x, weights, counts, numerics=None):  # the experts' loop: one exact GEMM per expert
        return torch.cat([cls.exact_linear(r, w) for r, w, n in zip(x.split(list(counts)), weights, counts) if n])

    @classmethod
    def patch(cls, monkeypatch):
        """Run the model on the reference kernels."""
        monkeypatch.setattr(invariant, "exact_linear", cls.exact_linear)
        monkeypatch.setattr(invariant, "grouped_linear", cls.grouped_linear)
        monkeypatch.setattr(experts, "can_group_exact", lambda *a: False)  # experts one by one, as before
        monkeypatch.setattr(invariant, "tree_sum", cls.tree_sum)
        monkeypatch.setattr(invariant, "tree_attention", cls.attention)


def bits(t):
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int64)


@pytest.mark.parametrize("rows,k,n,scale", [(1, 7, 5, 1.0), (37, 64, 48, 3e-3), (5, 300, 33, 1e5), (8, 1, 3, 1.0)])
def test_exact_linear_bits_equal_reference(rows, k, n, scale):
    g = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(rows, k, generator=g) * scale
    x[0, : k // 2] *= 1e-6  # a row with a wide dynamic range: low limbs of small elements
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    for bias in (None, b):
        assert torch.equal(bits(exact_gemm.exact_linear(x, w, bias)), bits(_Reference.exact_linear(x, w, bias)))
    x3 = x.reshape(1, rows, k).expand(2, rows, k)  # leading dims and a non-contiguous input
    assert torch.equal(bits(exact_gemm.exact_linear(x3, w)), bits(_Reference.exact_linear(x3, w)))


@pytest.mark.parametrize("counts", [[3, 0, 1, 5], [40, 2, 0, 33], [0, 0, 7, 0]])
def test_grouped_linear_bits_equal_reference_loop(counts):
    """Experts' runs (few rows: one gathered GEMM per run; many rows: Karatsuba) == one exact GEMM per run."""
    g = torch.Generator().manual_seed(sum(counts))
    x = torch.randn(sum(counts), 24, generator=g)
    weights = torch.randn(len(counts), 10, 24, generator=g).unbind(0)
    got = invariant.grouped_linear(x, weights, counts, Numerics(invariance="exact"))
    assert torch.equal(bits(got), bits(_Reference.grouped_linear(x, weights, counts)))


@pytest.mark.parametrize("shape,dim", [((5, 1), -1), ((3, 7), -1), ((4, 64), -1), ((2, 33, 3), 1), ((6, 2049), -1)])
def test_tree_sum_bits_equal_reference(shape, dim):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    x.view(-1)[::5] = 0.0
    for keepdim in (False, True):
        got = invariant.tree_sum(x, dim, keepdim)
        assert torch.equal(bits(got), bits(_Reference.tree_sum(x, dim, keepdim)))


def _strided_tree_sum(t, dim=-1):
    """A wrong order: level by level ``t[i] + t[i + half]`` (the same pairs only for n ≤ 2)."""
    t = t.movedim(dim, -1)
    while t.shape[-1] > 1:
        half = (t.shape[-1] + 1) // 2
        t = F.pad(t, (0, 2 * half - t.shape[-1]))
        t = t[..., :half] + t[..., half:]
    return t.squeeze(-1) + 0.0


@pytest.mark.parametrize("n", [3, 7, 64, 2049])
def test_tree_sum_reference_tells_orders_apart(n):
    """The reference is not order-blind: the inputs of the test above, summed in another pair order,
    differ from it in some bits (float addition is not associative), so a changed order fails."""
    x = torch.randn(64, n, generator=torch.Generator().manual_seed(n)) * torch.logspace(-3, 3, n)
    assert not torch.equal(bits(_strided_tree_sum(x)), bits(_Reference.tree_sum(x)))
    # and it is a sum: within pairwise summation's bound ⌈log2 n⌉·u·Σ|x| (u = 2^-24) of the exact one
    exact = torch.tensor([math.fsum(row) for row in x.double().tolist()])
    bound = (n - 1).bit_length() * 2.0 ** -24 * x.double().abs().sum(-1)
    assert ((_Reference.tree_sum(x).double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("B,H,KV,Tq,Tk,D", [(3, 4, 2, 9, 9, 16), (2, 4, 4, 1, 13, 8), (4, 6, 2, 40, 40, 12),
                                            (1, 2, 1, 5, 21, 64)])
@pytest.mark.parametrize("chunk", [invariant.ATTENTION_CHUNK, 1])
def test_attention_bits_equal_reference(monkeypatch, B, H, KV, Tq, Tk, D, chunk):
    """Causal attention by position, prefill (Tq = Tk) and decode-like steps (Tq < Tk), padded rows;
    in one query chunk and one query per chunk."""
    monkeypatch.setattr(invariant, "ATTENTION_CHUNK", chunk)
    g = torch.Generator().manual_seed(B * 100 + Tq)
    q = torch.randn(B, H, Tq, D, generator=g)
    k = torch.randn(B, KV, Tk, D, generator=g)
    v = torch.randn(B, KV, Tk, D, generator=g)
    pad = torch.randint(0, max(1, Tk - Tq), (B,), generator=g) if Tq < Tk else torch.randint(0, Tk, (B,), generator=g)
    pad[0] = 0
    slots = torch.arange(Tk - Tq, Tk)[None, :].expand(B, Tq)
    positions = (slots - pad[:, None]).clamp(min=0)
    got = invariant.attention(q, k, v, positions, pad)
    assert torch.equal(bits(got), bits(_Reference.attention(q, k, v, positions, pad)))


def _tiny(mode_scope, seed, fmt="nvfp4"):
    cfg = Config()
    cfg.model.vocab_size, cfg.model.num_layers = 64, 2
    cfg.fp4.scope, cfg.fp4.format = mode_scope, fmt
    return build_model(cfg, seed=seed)


@pytest.mark.parametrize("mode,scope,fmt", [("bf16", "experts", "nvfp4"), ("fp4_resq", "experts+attention", "nvfp4"),
                                            ("fp4", "experts", "mxfp4")])
def test_generate_and_score_bits_equal_reference(monkeypatch, mode, scope, fmt):
    """The whole batch-invariant rollout and scoring, new kernels vs the reference kernels."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 64) for _ in range(rng.randint(1, 9))] for _ in range(5)]
    params = SamplingParams(max_new_tokens=7, temperature=1.0, seed=3)
    runs = []
    with single_thread():
        for reference in (False, True):
            with monkeypatch.context() as mp:
                if reference:
                    _Reference.patch(mp)
                model = _tiny(scope, 1, fmt)
                out = RolloutEngine(model, mode=mode, invariance="exact").generate(prompts, params,
                                                                                 return_distributions=True)
                sc = score(model, out.prompt_ids, out.response_ids, mode=mode, return_distributions=True,
                           invariance="exact")
                runs.append((out, sc))
    (new, new_sc), (ref, ref_sc) = runs
    assert new.response_ids == ref.response_ids
    for i in range(len(prompts)):
        for a, b in ((new.distributions[i], ref.distributions[i]), (new_sc["log_probs"][i], ref_sc["log_probs"][i]),
                     (new_sc["distributions"][i], ref_sc["distributions"][i])):
            assert torch.equal(bits(a), bits(b))


def test_engine_derives_weight_terms_once_per_version(monkeypatch):
    """The engine keeps the weights' exact-GEMM limbs across generate calls (not once per call),
    and a load_weights makes the next call use the new weights' (same bits as a fresh engine)."""
    calls = []
    limbs = exact_gemm._weight_limbs
    monkeypatch.setattr(exact_gemm, "_weight_limbs", lambda w: calls.append(1) or limbs(w))
    prompts, params = [[3, 5, 7], [9]], SamplingParams(max_new_tokens=3, temperature=0.0)
    with single_thread():
        engine = RolloutEngine(_tiny("experts", 2), mode="bf16", invariance="exact")
        first = engine.generate(prompts, params, return_distributions=True)
        per_call = len(calls)
        again = engine.generate(prompts, params, return_distributions=True)
        assert per_call > 0 and len(calls) == per_call  # nothing re-derived by the second call
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(first.distributions, again.distributions))
        new_weights = _tiny("experts", 3).state_dict()
        engine.load_weights(new_weights, version=1)
        after = engine.generate(prompts, params, return_distributions=True)
        fresh = RolloutEngine(_tiny("experts", 3), mode="bf16", invariance="exact").generate(
            prompts, params, return_distributions=True)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(after.distributions, fresh.distributions))
    assert not torch.equal(after.distributions[0], first.distributions[0])
