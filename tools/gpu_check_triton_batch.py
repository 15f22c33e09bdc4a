"""The batch-level Triton section of tools/gpu_check.py (``fp4/triton_batch.py``): batch invariance
bitwise, agreement with the portable ops within a derived bound, and (CUDA) kernel time against
torch.mm / SDPA on a realistic shape.

On CUDA the kernels run compiled; on the CPU (``--device cpu`` dry run, tests/unit/test_triton_batch.py)
the same checks run under Triton's interpreter when ``TRITON_INTERPRET=1`` was set before triton was
imported, on shapes that still cross every tile boundary, and are skipped otherwise.

Bounds (fp32 accumulation, u = 2^-24, γ(n) = n·u / (1 − n·u); the reference in float64 from the same
inputs):

- GEMM ``y = x·wᵀ``: every output is a sum of K exact-or-rounded products accumulated in fp32, plus
  one add per K block: |ŷ − y| ≤ γ(K + ⌈K/BK⌉ + 1)·Σ_k |x_k·w_k| (fp32 inputs: each product rounded
  once, inside the γ; bf16 inputs: products exact), and for a bf16 output one more rounding,
  2^-8·|ŷ|. The portable ``tiled`` ops obey the same bound, so the two differ by at most twice it.
- Attention: each score's error δ ≤ γ(D + 2)·scale·Σ_d |q_d·k_d|; a softmax weight's relative error
  is then ≤ 2·max δ plus the exp's (ε_exp = 64·u: a GPU's ``ex2.approx`` is within 2 ulp, and its
  argument s − m rounds by |s − m|·u, under 64·u for every weight that is not negligible against
  the block's largest); the output's, ≤ (2·(2·max δ + ε_exp) + γ(Tk + 3·⌈Tk/BN⌉ + 2))·Σ_j w_j·|v_j|
  (w the exact weights), doubled for the second-order terms. bf16 inputs add the weights' rounding
  to bf16 before the value product (2·2^-7: the interpreter's cast truncates) and the output's
  (2^-8·|ô|); against ``tiled.block_attention`` only in fp32 (its bf16 scores are rounded to bf16).
"""
from __future__ import annotations

import contextlib
import json
import math
import statistics
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_fp4.fp4 import tiled, triton_batch
from tools.gpu_check_triton import _time_ms, cannot_run  # _time_ms: CUDA events on a GPU, the wall clock elsewhere

U = 2.0 ** -24


def gamma(n: float) -> float:
    return n * U / (1 - n * U)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _excess(err: torch.Tensor, bound: torch.Tensor) -> tuple:
    """(whether every |err| ≤ bound, max err / bound)."""
    ratio = (err / bound.clamp_min(1e-300)).max().item() if err.numel() else 0.0
    return bool((err <= bound).all()), ratio


# ---- GEMM -------------------------------------------------------------------------------------

def gemm_bound(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The bound on |y − x·wᵀ| of the module docstring (float64, y's shape)."""
    K = x.shape[1]
    bk = triton_batch.GEMM_CONFIG[x.dtype][2]
    bound = gamma(K + math.ceil(K / bk) + 1) * (x.double().abs() @ w.double().abs().t())
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * y.double().abs()
    return bound


def gemm_mismatches(fn, x: torch.Tensor, w: torch.Tensor) -> list:
    """Where ``fn(rows, w)`` gives a row other bits than among all of ``x``'s rows: alone, in a
    short batch, permuted (other tiles, other places in a tile), behind other rows."""
    full = fn(x, w)
    M = x.shape[0]
    bad = []
    for r in sorted({0, 1, M // 2, M - 1}):
        if not _same(fn(x[r:r + 1], w), full[r:r + 1]):
            bad.append(f"row {r} alone")
    if not _same(fn(x[3:10], w), full[3:10]):
        bad.append("rows 3..9 as a batch of 7")
    perm = torch.randperm(M, generator=torch.Generator().manual_seed(5)).to(x.device)
    if not _same(fn(x[perm], w), full[perm]):
        bad.append("rows permuted")
    rolled = torch.cat([x[M // 3:], x[:M // 3]])
    if not _same(fn(rolled, w), torch.cat([full[M // 3:], full[:M // 3]])):
        bad.append("rows rolled by M/3")
    return bad


def _operands(dev, dtype, M, K, N, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-2, 2, K)[torch.randperm(K, generator=g)]
    w = torch.randn(N, K, generator=g) * K ** -0.5
    return x.to(dtype).to(dev), w.to(dtype).to(dev)


def check_gemm(dev: torch.device, record, quick: bool) -> None:
    cuda = dev.type == "cuda"
    shapes = [(100, 72, 72)] if not cuda else [(150, 72, 136), (1000, 1024, 1536)] + ([] if quick else [(4100, 2048, 1024)])
    for dtype in triton_batch.DTYPES:
        for M, K, N in shapes:
            x, w = _operands(dev, dtype, M, K, N, 11)
            label = f"{_name(dtype)} {M}x{K}->{N}"
            bad = gemm_mismatches(triton_batch.gemm, x, w)
            record(f"triton batch gemm {label}: a row's bits do not depend on its batch", "FAIL" if bad else "PASS",
                   f"differs: {bad}" if bad else "bitwise (alone, batch of 7, permuted, rolled)")
            y = triton_batch.gemm(x, w)
            ref = x.double() @ w.double().t()
            bound = gemm_bound(x, w, y).cpu()
            ok, ratio = _excess((y.double() - ref).abs().cpu(), bound)
            record(f"triton batch gemm {label}: vs float64 within the bound", "PASS" if ok else "FAIL",
                   f"max |err|/bound = {ratio:.3f}")
            portable = tiled.tiled_linear(x, w)
            ok, ratio = _excess((y.double() - portable.double()).abs().cpu(),
                                (bound + gemm_bound(x, w, portable).cpu()))
            record(f"triton batch gemm {label}: vs tiled.tiled_linear within twice the bound", "PASS" if ok else "FAIL",
                   f"max |Δ|/bound = {ratio:.3f}")


def check_sensitivity(dev: torch.device, record) -> None:
    """The invariance check catches a kernel whose tile is chosen from M (the mistake it guards
    against): BLOCK_K 16 for short batches, the fixed 32 otherwise — bits change with the batch."""
    x, w = _operands(dev, torch.float32, 100, 72, 72, 12)
    bm, bn, bk, warps, stages = triton_batch.GEMM_CONFIG[torch.float32]

    def tile_from_m(rows, weight):
        return triton_batch.gemm(rows, weight, config=(bm, bn, 16 if rows.shape[0] < 16 else bk, warps, stages))

    bad = gemm_mismatches(tile_from_m, x, w)
    record("triton batch gemm with BLOCK_K chosen from M: the invariance check catches it",
           "PASS" if bad else "FAIL", f"caught: {bad}" if bad else "not caught: the check cannot fail")


def check_attention_sensitivity(dev: torch.device, record) -> None:
    """The decode == prefill check catches a kernel whose KV split size is chosen from the query
    count (32-key blocks for a decode step, 64 for a prefill: the anchors' mistake to avoid)."""
    q, k, v, positions, pad = _attention_inputs(dev, torch.float32, 2, 2, 1, 70, 16, [0, 5], 24, capacity=79)
    bm, bn, warps, stages = triton_batch.ATTENTION_CONFIG[torch.float32]

    def split_from_tq(q, *args, **kwargs):
        return triton_batch.attention_forward(q, *args, **kwargs,
                                              config=(bm, bn // 2 if q.shape[2] == 1 else bn, warps, stages))

    bad = attention_mismatches(q, k, v, positions, pad, {}, [(0, 64)], forward=split_from_tq)
    record("triton batch attention with the KV split chosen from Tq: the decode == prefill check catches it",
           "PASS" if bad else "FAIL", f"caught: {bad}" if bad else "not caught: the check cannot fail")


def check_grouped(dev: torch.device, record, quick: bool) -> None:
    cuda = dev.type == "cuda"
    K, N = (72, 72) if not cuda else (1024, 1536)
    counts = [70, 0, 1, 64, 15] if not cuda else [700, 0, 1, 64, 129, 3000, 17, 5]
    for dtype in triton_batch.DTYPES:
        g = torch.Generator().manual_seed(13)
        x = (torch.randn(sum(counts), K, generator=g)).to(dtype).to(dev)
        w = (torch.randn(len(counts), N, K, generator=g) * K ** -0.5).to(dtype).to(dev)
        label = f"{_name(dtype)} counts {counts} {K}->{N}"
        y = triton_batch.grouped_gemm(x, w, counts)
        bad, at = [], 0
        for e, n in enumerate(counts):
            if n and not _same(y[at:at + n], triton_batch.gemm(x[at:at + n], w[e])):
                bad.append(f"expert {e}")
            at += n
        # the same expert's rows in another grouping: expert 0's rows split over two runs of expert 0
        halves = [counts[0] // 2, counts[0] - counts[0] // 2]
        y2 = triton_batch.grouped_gemm(x[:counts[0]], torch.stack([w[0], w[0]]), halves)
        if not _same(y2[:halves[0]], y[:halves[0]]) or not _same(y2[halves[0]:], y[halves[0]:counts[0]]):
            bad.append("expert 0's rows in two runs")
        record(f"triton batch grouped gemm {label}: each run == the dense kernel on it alone",
               "FAIL" if bad else "PASS", f"differs: {bad}" if bad else "bitwise")
        portable = tiled.tiled_grouped_linear(x, w.unbind(0), counts)
        bound = torch.cat([gemm_bound(x[a:a + n], w[e], y[a:a + n]) + gemm_bound(x[a:a + n], w[e], portable[a:a + n])
                           for e, (a, n) in enumerate(zip([sum(counts[:i]) for i in range(len(counts))], counts))])
        ok, ratio = _excess((y.double() - portable.double()).abs().cpu(), bound.cpu())
        record(f"triton batch grouped gemm {label}: vs tiled.tiled_grouped_linear within twice the bound",
               "PASS" if ok else "FAIL", f"max |Δ|/bound = {ratio:.3f}")


def check_autograd(dev: torch.device, record) -> None:
    """Through the entry points with autograd: the forward is the kernel's, the gradients are
    tiled.py's backward of the same saved tensors (the same GEMMs: bitwise)."""
    x0, w0 = _operands(dev, torch.float32, 40, 72, 136, 14)
    dy = torch.randn(40, 136, generator=torch.Generator().manual_seed(15)).to(dev)
    mode = "auto" if dev.type == "cuda" else "interpret"
    grads = []
    for fn in (lambda x, w: triton_batch.linear(x, w, triton=mode), lambda x, w: tiled.tiled_linear(x, w)):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        y = fn(x, w)
        y.backward(dy)
        grads.append((y.detach(), x.grad, w.grad))
    launched = triton_batch.launches()
    same_fwd = _same(grads[0][0], triton_batch.gemm(x0, w0))
    bad = [n for n, a, b in zip(("dx", "dw"), grads[0][1:], grads[1][1:]) if not _same(a, b)]
    ok = same_fwd and not bad and launched > 0
    record("triton batch linear with autograd: kernel forward, tiled backward", "PASS" if ok else "FAIL",
           f"forward == kernel: {same_fwd}; grads differ in {bad}; launches {launched}")
    counts = [25, 0, 15]
    ws = torch.stack([w0, w0 * 0.5, w0 * 2])
    outs = []
    for fn in (lambda x, w: triton_batch.grouped_linear(x, w, counts, mode),
               lambda x, w: tiled.tiled_grouped_linear(x, w, counts)):
        x, w = x0.clone().requires_grad_(True), ws.clone().requires_grad_(True)
        fn(x, w).backward(dy)
        outs.append((x.grad, w.grad))
    bad = [n for n, a, b in zip(("dx", "dw"), *outs) if not _same(a, b)]
    record("triton batch grouped linear with autograd: tiled backward's gradients", "FAIL" if bad else "PASS",
           f"differs in {bad}" if bad else "bitwise")


# ---- attention ------------------------------------------------------------------------------

def reference_attention(q, k, v, positions, pad, scale=None, window=0, sinks=None) -> tuple:
    """(output, Σ_j w_j·|v_j|, max score error bound δ per query) in float64 by the contract."""
    B, H, Tq, D = q.shape
    KV, Tk = k.shape[1], k.shape[2]
    rep = H // KV
    scale = D ** -0.5 if scale is None else scale
    qd, kd, vd = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = torch.einsum("bhtd,bhsd->bhts", qd, kd) * scale
    delta = gamma(D + 2) * scale * torch.einsum("bhtd,bhsd->bhts", qd.abs(), kd.abs())
    kpos = (torch.arange(Tk, device=q.device)[None, :] - pad[:, None])[:, None, None, :]
    qpos = positions[:, None, :, None]
    seen = (kpos >= 0) & (kpos <= qpos)
    if window:
        seen &= kpos > qpos - window
    s = s.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, H, 1, 1).expand(B, H, Tq, 1)], -1)
    wts = torch.softmax(s, -1)[..., :Tk]
    out = wts @ vd
    return out, wts @ vd.abs(), delta.masked_fill(~seen, 0).amax(-1, keepdim=True)


def attention_bound(q, k, v, positions, pad, got, scale=None, window=0, sinks=None) -> tuple:
    """(reference output, the bound of the module docstring on |got − reference|), float64."""
    ref, weighted, delta = reference_attention(q, k, v, positions, pad, scale, window, sinks)
    Tk = k.shape[2]
    blocks = math.ceil(Tk / triton_batch.ATTENTION_CONFIG[q.dtype][1])
    eps_w = 2 * delta + 64 * U
    rel = 2 * (2 * eps_w + gamma(Tk + 3 * blocks + 2))
    if q.dtype == torch.bfloat16:
        rel = rel + 2 * 2.0 ** -7
    bound = rel * weighted
    if got.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * got.double().abs()
    return ref, bound


def _attention_inputs(dev, dtype, B, H, KV, T, D, pads, seed, capacity=None):
    """q [B, H, T, D]; k, v [B, KV, T, D] as the filled prefix of a [B, KV, capacity, D] cache whose
    unfilled slots hold other (finite) values; positions of left-padded rows (pad[b] slots first)."""
    g = torch.Generator().manual_seed(seed)
    cap = capacity or T
    q = torch.randn(B, H, T, D, generator=g).to(dtype).to(dev)
    kc = torch.randn(B, KV, cap, D, generator=g).to(dtype).to(dev)
    vc = torch.randn(B, KV, cap, D, generator=g).to(dtype).to(dev)
    pad = torch.tensor(pads, dtype=torch.long, device=dev)
    positions = (torch.arange(T, device=dev)[None, :] - pad[:, None]).clamp_min(0)
    return q, kc[:, :, :T], vc[:, :, :T], positions, pad


def attention_mismatches(q, k, v, positions, pad, variant, probes, forward=None) -> list:
    """Where a query's bits differ between the causal prefill of the batch and (a) a decode step
    over the cache up to that query, (b) the same row alone without padding, (c) a decode step of
    the row alone. ``forward``: another kernel call than ``triton_batch.attention_forward``."""
    attention = forward or triton_batch.attention_forward
    full = attention(q, k, v, positions, pad, **variant)[0]
    bad = []
    for b, t in probes:
        p = int(positions[b, t])
        one = attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], positions[:, t:t + 1],
                                             pad, **variant)[0]
        if not _same(one[b], full[b, :, t:t + 1]):
            bad.append(f"row {b} position {p}: decode step over the batch's cache")
        lo = int(pad[b])
        alone = attention(q[b:b + 1, :, lo:t + 1], k[b:b + 1, :, lo:t + 1], v[b:b + 1, :, lo:t + 1],
                                               positions[b:b + 1, lo:t + 1], pad.new_zeros(1), **variant)[0]
        if not _same(alone[0, :, -1:], full[b, :, t:t + 1]):
            bad.append(f"row {b} position {p}: the row's own prefill without padding")
        step = attention(q[b:b + 1, :, t:t + 1], k[b:b + 1, :, lo:t + 1], v[b:b + 1, :, lo:t + 1],
                                              positions[b:b + 1, t:t + 1], pad.new_zeros(1), **variant)[0]
        if not _same(step[0], full[b, :, t:t + 1]):
            bad.append(f"row {b} position {p}: a decode step of the row alone")
    return bad


def check_attention(dev: torch.device, record, quick: bool) -> None:
    cuda = dev.type == "cuda"
    B, H, KV, T, D = (2, 2, 1, 70, 16) if not cuda else (3, 16, 4, 600, 64)
    pads = [0, 5] if not cuda else [0, 37, 200]
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(17)).to(dev)
    variants = [("causal", {}), ("window 40 + sinks + scale", {"window": 40, "sinks": sinks, "scale": 0.3})]
    for dtype in triton_batch.DTYPES:
        q, k, v, positions, pad = _attention_inputs(dev, dtype, B, H, KV, T, D, pads, 16, capacity=T + 9)
        probes = [(0, 0), (1, pads[1]), (0, 63), (0, 64), (1, T - 1), (B - 1, T - 2)]
        if not cuda:  # the interpreter pays per program: a key-block boundary and a padded row's last query
            probes = [(0, 64), (1, T - 1)]
        for name, variant in variants[:1] if (not cuda and dtype == torch.bfloat16) else variants:
            if variant.get("sinks") is not None:
                variant = dict(variant, sinks=variant["sinks"].to(dtype))
            label = f"{_name(dtype)} {name} B{B} H{H}/KV{KV} T{T} D{D} pads {pads}"
            bad = attention_mismatches(q, k, v, positions, pad, variant, probes)
            record(f"triton batch attention {label}: decode == prefill, alone == padded batch",
                   "FAIL" if bad else "PASS", f"differs: {bad}" if bad else f"bitwise at {len(probes)} probes x 3")
            got = triton_batch.attention_forward(q, k, v, positions, pad, **variant)[0]
            live = positions >= 0  # every query here (padding queries sit at position 0)
            ref, bound = attention_bound(q, k, v, positions, pad, got, **variant)
            ok, ratio = _excess(((got.double() - ref).abs() * live[:, None, :, None]).cpu(), bound.cpu())
            record(f"triton batch attention {label}: vs float64 within the bound", "PASS" if ok else "FAIL",
                   f"max |err|/bound = {ratio:.3f}")
            if dtype == torch.float32:
                portable = tiled.block_attention(q, k, v, positions, pad, **variant)
                _, bound_p = attention_bound(q, k, v, positions, pad, portable, **variant)
                ok, ratio = _excess((got.double() - portable.double()).abs().cpu(), (bound + bound_p).cpu())
                record(f"triton batch attention {label}: vs tiled.block_attention within twice the bound",
                       "PASS" if ok else "FAIL", f"max |Δ|/bound = {ratio:.3f}")


def check_attention_autograd(dev: torch.device, record) -> None:
    """Through the entry point with autograd: the kernel's forward, tiled.py's flash-style backward
    from the kernel's log-sum-exp; the gradients against autograd of the float64 reference."""
    mode = "auto" if dev.type == "cuda" else "interpret"
    q0, k0, v0, positions, pad = _attention_inputs(dev, torch.float32, 2, 4, 2, 40, 16, [0, 3], 18)
    sinks0 = torch.randn(4, generator=torch.Generator().manual_seed(19)).to(dev)
    do = torch.randn(2, 4, 40, 16, generator=torch.Generator().manual_seed(20)).to(dev)
    leaves = [t.clone().requires_grad_(True) for t in (q0, k0, v0, sinks0)]
    launched = triton_batch.launches()
    out = triton_batch.attention(*leaves[:3], positions, pad, mode, window=24, sinks=leaves[3])
    out.backward(do)
    served = triton_batch.launches() > launched
    ref_leaves = [t.double().clone().requires_grad_(True) for t in (q0, k0, v0, sinks0)]
    ref = reference_attention(*ref_leaves[:3], positions, pad, window=24, sinks=ref_leaves[3])[0]
    ref.backward(do.double())
    # the backward's inputs (out, lse) carry the forward's error (≲ 1e-6 relative here), and its
    # sums over ≤ 40 keys and 16 dims add ≲ 56·u relative each: 1e-4 of the largest gradient is ample
    errs = {n: float((a.grad.double() - b.grad).abs().max() / b.grad.abs().max())
            for n, a, b in zip(("dq", "dk", "dv", "dsinks"), leaves, ref_leaves)}
    ok = served and all(e <= 1e-4 for e in errs.values())
    record("triton batch attention with autograd (window, sinks): gradients vs float64", "PASS" if ok else "FAIL",
           f"kernel served: {served}; max|Δ|/max|ref| " + json.dumps({k: f"{e:.1e}" for k, e in errs.items()}))


# ---- the model ------------------------------------------------------------------------------

def check_model(dev: torch.device, record) -> None:
    """The tiny Qwen3-MoE (2 layers, FP4 experts + attention) at the batch level with the kernels
    serving its GEMMs and attention: the KV-cache decode == the full forward (left padding), the
    rollout engine's log-probs and routes == scoring in other batches, the training forward ==
    the no-grad forward, all bitwise. (Norms, softmax and SiLU stay ATen's kernels: on a GPU this
    also checks that they are row-local there.)"""
    from megatron_fp4.config import Config
    from megatron_fp4.fp4 import Numerics, apply_numerics
    from megatron_fp4.model import KVCache, build_model
    from megatron_fp4.rollout.engine import RolloutEngine
    from megatron_fp4.rollout.sampling import SamplingParams
    from megatron_fp4.rollout.scoring import score

    mode_t = "auto" if dev.type == "cuda" else "interpret"
    for mode in ("bf16", "fp4_resq"):
        cfg = Config()
        cfg.model.num_layers, cfg.fp4.scope = 2, "experts+attention"
        model = build_model(cfg, seed=5)
        model.set_fp4_mode(mode)
        apply_numerics(model, Numerics(invariance="batch", triton=mode_t))
        model.to(dev).eval()
        V = cfg.model.vocab_size
        g = torch.Generator().manual_seed(6)
        tokens = torch.randint(1, V, (3, 12), generator=g).to(dev)
        mask = torch.ones_like(tokens)
        mask[0, :3] = 0
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        launched = triton_batch.launches()
        with torch.no_grad():
            full = model(tokens, pos, mask).logits
            cache = KVCache.empty(len(model.layers))
            steps = [model(tokens[:, :5], pos[:, :5], mask[:, :5], cache).logits]
            steps += [model(tokens[:, t:t + 1], pos[:, t:t + 1], mask[:, :t + 1], cache).logits for t in range(5, 12)]
        got = torch.cat(steps, 1)
        ok = _same(got[0, 3:], full[0, 3:]) and _same(got[1:], full[1:]) and triton_batch.launches() > launched
        record(f"triton batch model ({mode}): KV-cache decode == full forward", "PASS" if ok else "FAIL",
               f"bitwise; {triton_batch.launches() - launched} kernel launches" if ok else "logits differ")
        trained = model(tokens, pos, mask).logits
        trained.float().square().mean().backward()
        record(f"triton batch model ({mode}): training forward == no-grad forward", "PASS" if _same(trained.detach(), full)
               else "FAIL")
        model.zero_grad(set_to_none=True)
        prompts = [torch.randint(1, V, (n,), generator=g).tolist() for n in (3, 7, 5, 9)]
        engine = RolloutEngine(model, mode=mode, invariance="batch")
        out = engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0, seed=3), return_routing=True)
        bad = []
        for batch in ([2, 0], [3], [1, 2, 3]):
            sc = score(model, [out.prompt_ids[i] for i in batch], [out.response_ids[i] for i in batch], mode=mode,
                       return_routing=True, invariance="batch")
            for j, i in enumerate(batch):
                if not _same(sc["log_probs"][j], out.log_probs[i]):
                    bad.append(f"log-probs of request {i} in batch {batch}")
                if not torch.equal(sc["routing"][j].sort(-1).values.cpu(), out.routing[i].sort(-1).values.cpu()):
                    bad.append(f"routes of request {i} in batch {batch}")
        record(f"triton batch model ({mode}): rollout engine == scoring in other batches", "FAIL" if bad else "PASS",
               f"differs: {bad}" if bad else "log-probs bitwise, routes equal")


# ---- speed ----------------------------------------------------------------------------------

def _compare(dev, record, label, fns: dict, reps: int, rounds: int) -> None:
    skipped = {}
    for name, fn in list(fns.items()):
        try:
            fn()  # compile, warm up
        except Exception as err:  # a baseline this build cannot run (e.g. torch._grouped_mm's layout rules)
            if name == "triton":
                raise
            skipped[name] = f"{type(err).__name__}: {str(err)[:120]}"
            del fns[name]
    times = {name: [] for name in fns}
    for _ in range(rounds):  # alternate, so drift hits all alike
        for name, fn in fns.items():
            times[name].append(_time_ms(fn, reps, dev))
    med = {name: statistics.median(t) for name, t in times.items()}
    base = med["triton"]
    record(f"triton batch speed {label}{'' if dev.type == 'cuda' else ' (interpreter: not a speed)'}", "PASS",
           json.dumps({**{f"{n}_ms": round(t, 4) for n, t in med.items()},
                       **{f"{n}/triton": round(t / base, 2) for n, t in med.items() if n != "triton"},
                       **({"not run": skipped} if skipped else {})}))


def check_speed(dev: torch.device, record, quick: bool) -> None:
    """Printed, never asserted. Hidden 1024, 64 experts top-8 (expert FFN 768), GQA 16/4 heads of 64."""
    cuda = dev.type == "cuda"
    reps, rounds = ((10, 3) if quick else (20, 3)) if cuda else (1, 1)
    hidden, ffn, experts, top_k = (1024, 768, 64, 8) if cuda else (64, 48, 4, 2)
    for dtype in triton_batch.DTYPES:
        dn = _name(dtype)
        for M in ((8, 4096) if cuda else (8,)):
            x, w = _operands(dev, dtype, M, hidden, 2 * ffn, 21)
            _compare(dev, record, f"gemm {dn} {M}x{hidden}->{2 * ffn}", {
                "triton": lambda: triton_batch.gemm(x, w), "torch.mm": lambda: torch.mm(x, w.t()),
                "tiled": lambda: tiled.tiled_linear(x, w)}, reps, rounds)
        tokens = 4096 if cuda else 16
        rows = tokens * top_k
        gen = torch.Generator().manual_seed(22)
        route = torch.randint(0, experts, (rows,), generator=gen)
        counts = torch.bincount(route, minlength=experts).tolist()
        x = torch.randn(rows, hidden, generator=gen).to(dtype).to(dev)
        w = (torch.randn(experts, 2 * ffn, hidden, generator=gen) * hidden ** -0.5).to(dtype).to(dev)
        wl = w.unbind(0)
        offs = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
        fns = {"triton": lambda: triton_batch.grouped_gemm(x, w, counts),
               "torch.mm loop": lambda: torch.cat([torch.mm(r, we.t()) for r, we in zip(x.split(counts), wl)]),
               "tiled": lambda: tiled.tiled_grouped_linear(x, wl, counts)}
        if cuda and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            fns["torch._grouped_mm"] = lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        _compare(dev, record, f"grouped gemm {dn} {experts} experts top-{top_k} {tokens} tokens {hidden}->{2 * ffn}",
                 fns, reps, rounds)
        B, H, KV, T, D = (8, 16, 4, 1024, 64) if cuda else (1, 2, 1, 40, 16)
        q, k, v, positions, pad = _attention_inputs(dev, dtype, B, H, KV, T, D, [0] * B, 23)
        rep = H // KV
        _compare(dev, record, f"attention prefill {dn} B{B} H{H}/KV{KV} T{T} D{D}", {
            "triton": lambda: triton_batch.attention_forward(q, k, v, positions, pad),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                           is_causal=True),
            "tiled": lambda: tiled.block_attention(q, k, v, positions, pad)}, max(1, reps // 2), rounds)
        q1, p1 = q[:, :, -1:].contiguous(), positions[:, -1:].contiguous()
        _compare(dev, record, f"attention decode step {dn} B{B} H{H}/KV{KV} over {T} keys D{D}", {
            "triton": lambda: triton_batch.attention_forward(q1, k, v, p1, pad),
            "sdpa": lambda: F.scaled_dot_product_attention(q1, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)),
            "tiled": lambda: tiled.block_attention(q1, k, v, p1, pad)}, reps, rounds)


@contextlib.contextmanager
def row_invariant_interpreter_dot():
    """Under Triton's interpreter, ``tl.dot`` as a GPU's MMA computes it for these checks: every
    output element the same sum whatever its place in the tile — the products (in the accumulator's
    dtype) added in increasing k, then the accumulator. The interpreter's own ``tl.dot`` is numpy's
    ``matmul``, i.e. the BLAS numpy was built with, and OpenBLAS's Haswell kernels (a CPU without
    AVX-512) compute a [64, K] tile's last rows in an edge micro-kernel with another summation
    order: 34 of 64 rows changed bits when moved within one tile shape (measured, numpy 2.4's
    OpenBLAS 0.3.31), so a row's bits would depend on its position, a property of that BLAS, not of
    the kernel's tiling these checks are about. Restores the interpreter's dot on exit; a no-op
    when the interpreter is not in use."""
    from megatron_fp4.fp4.triton_fp4 import interpreting
    if not interpreting():
        yield
        return
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:  # fp8: the interpreter's own
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc_dtype = d.data.dtype
        x, w = a.data.astype(acc_dtype), b.data.astype(acc_dtype)  # [..., M, K], [..., K, N]
        total = x[..., :, 0, None] * w[..., 0, None, :]
        for k in range(1, x.shape[-1]):
            total = total + x[..., :, k, None] * w[..., k, None, :]
        return interpreter.TensorHandle((total + d.data).astype(acc_dtype, copy=False), d.dtype.scalar)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = original


def run(dev: torch.device, record, quick: bool, speed: bool = True, model: Optional[bool] = None) -> None:
    """Every batch-level Triton check on ``dev`` (skipped with the reason when the kernels cannot run
    there); under the interpreter with a row-invariant ``tl.dot`` (:func:`row_invariant_interpreter_dot`)."""
    why = cannot_run(dev)
    if why:
        record("triton batch kernels", "SKIP", why)
        return
    with row_invariant_interpreter_dot():
        _run(dev, record, quick, speed, model)


def _run(dev: torch.device, record, quick: bool, speed: bool, model: Optional[bool]) -> None:
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the portable fp32 ops in fp32, as the bounds assume
    checks = [check_gemm, check_grouped, check_attention]
    for check in checks:
        try:
            check(dev, record, quick)
        except Exception as err:  # report and go on: one broken check must not hide the rest
            record(f"triton batch {check.__name__}", "FAIL", f"{type(err).__name__}: {err}")
    for check in (check_sensitivity, check_attention_sensitivity, check_autograd, check_attention_autograd):
        try:
            check(dev, record)
        except Exception as err:
            record(f"triton batch {check.__name__}", "FAIL", f"{type(err).__name__}: {err}")
    if dev.type == "cuda" if model is None else model:
        try:
            check_model(dev, record)
        except Exception as err:
            record("triton batch check_model", "FAIL", f"{type(err).__name__}: {err}")
    elif model is None:
        record("triton batch model checks", "SKIP", "under the interpreter they take ~70 s of CPU: run on CUDA, or "
               "run(..., model=True)")
    if speed:
        try:
            check_speed(dev, record, quick)
        except Exception as err:
            record("triton batch speed", "FAIL", f"{type(err).__name__}: {err}")
