"""GC-MoE decode dispatcher (parallel/moe/gcmoe_decode.py) against the all-to-all dispatcher and the
single-process layer, at ep2 and ep4, 1–8 tokens per rank, many seeds, random delays and shuffled
peer order, both transports: the fixed-split all-to-all (a collective: no tags) and the pair
protocol with every p2p tag forced to 0 (`TagZero`: NCCL's ordered matching on gloo; both ends of
every pair must issue the same operations in the same order).

Claims and tolerances:
- exact path (``static=False``), up to ``decode_tokens`` tokens per rank: **bitwise** equal to
  `AllToAllDispatcher` by construction (the same grouped batch, built by a gather into a fresh
  tensor, through the same `GroupedExperts` call; the same combine).
- single-process layer on the global batch: the same rows but other buffers (alignment), so in
  float64 within ``FP64_REL`` of the output scale, as in tests/distributed/test_expert_parallel.py.
- static path (``static=True``, the CUDA-Graph one): every expert GEMM gets extra zero rows, so in
  float64 within ``FP64_REL`` (BLAS blocking only); **bitwise** under the batch-invariant mode,
  where every GEMM is row-invariant by construction (fp4/invariant.py).
- more tokens than ``decode_tokens`` (rounds): per-round expert batches, so within ``FP64_REL``.
Routings cover random ones, every token to the same experts (one rank receives everything, the
others' experts nothing) and every token's k experts on one rank with T = decode_tokens (a pair's
message filled to its static capacity).
"""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.fp4 import Numerics, apply_numerics
from megatron_fp4.parallel.moe.expert_parallel import apply_expert_parallel
from megatron_fp4.parallel.moe.gcmoe_decode import pair_capacity
from megatron_fp4.parallel.mesh import ParallelMesh
from tests.distributed.launch import run_distributed
from tests.distributed.test_expert_parallel import HIDDEN, make_layer
from tests.distributed.test_expert_parallel_gcmoe import RandomTiming, TagZero, check_pairs_mirror
from tests.numerics import FP64_REL

MAX_T = 8  # decode_tokens


def routing(seed: int, world: int, E: int):
    """Global (tokens per rank, topk_idx, topk_w, x) for one seed; the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    El, kind = E // world, seed % 4
    k = int(torch.randint(1, min(4, E) + 1, (1,), generator=g))
    tokens = torch.randint(1, MAX_T + 1, (world,), generator=g).tolist()
    if kind == 0:    # random distinct experts
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(sum(tokens))])
    elif kind == 1:  # every token to experts 0..k-1: rank 0's experts get all, the rest none
        idx = torch.arange(k).repeat(sum(tokens), 1)
    elif kind == 2:  # T = decode_tokens, k = El experts all on one rank: a pair's message is full
        k, tokens, dst = El, [MAX_T] * world, seed % world
        idx = torch.stack([dst * El + torch.randperm(El, generator=g) for _ in range(MAX_T * world)])
    else:            # top-1, skewed towards the last expert
        k = 1
        idx = torch.where(torch.rand(sum(tokens), 1, generator=g) < 0.7, E - 1,
                          torch.randint(0, E, (sum(tokens), 1), generator=g))
    w = torch.rand(idx.shape, generator=g, dtype=torch.float64) + 0.1
    w = w / w.sum(1, keepdim=True)
    x = torch.randn(sum(tokens), HIDDEN, generator=g, dtype=torch.float64)
    return tokens, idx.long(), w, x, kind


def _rel(a, b):
    d = (a - b).abs().max().item() if a.numel() else 0.0
    return d / max(b.abs().max().item(), 1e-300) if d else 0.0


def _worker(rank, world, num_seeds):
    tags = TagZero()
    mesh = ParallelMesh.build(pp=1, dp=world, ep=world)
    E = 2 * world
    full = make_layer(E, 2).double()
    base = apply_expert_parallel(make_layer(E, 2).double(), mesh, "alltoall")
    dec = apply_expert_parallel(make_layer(E, 2).double(), mesh, "gcmoe_decode", decode_tokens=MAX_T)
    experts, d = base.experts, dec.dispatcher
    out = {"exact": [], "static": [], "ref": [], "kinds": set(), "full_pair": False}
    with torch.no_grad():
        for seed in range(num_seeds):
            tokens, idx, w, x, kind = routing(seed, world, E)
            out["kinds"].add(kind)
            lo = sum(tokens[:rank])
            sl = slice(lo, lo + tokens[rank])
            d.test_hook = RandomTiming(seed * 97 + rank)
            y_base = base.dispatcher(x[sl], idx[sl], w[sl], experts)
            d.static, d.transport = False, "alltoall"
            y_exact = d(x[sl], idx[sl], w[sl], experts)
            d.transport = "p2p"
            y_exact_p2p = d(x[sl], idx[sl], w[sl], experts)
            d.static, d.transport = True, ("alltoall", "p2p")[seed % 2]
            y_static = d(x[sl], idx[sl], w[sl], experts)
            y_ref = full.dispatcher(x, idx, w, full.experts)[sl]
            out["exact"].append(max((y - y_base).abs().max().item() if y.numel() else 0.0
                                    for y in (y_exact, y_exact_p2p)))
            out["static"].append(_rel(y_static, y_base))
            out["ref"].append(_rel(y_exact, y_ref))
            if kind == 2:  # the destination's message from me holds cap rows
                out["full_pair"] = (idx[sl] // (E // world) == seed % world).sum().item() == \
                    pair_capacity(MAX_T, idx.shape[1], E // world)
        out.update(_persistent_buffers(d, experts, world, E))
        out.update(_rounds(rank, world, d, experts, base, E))
        out.update(_batch_invariant_static(rank, world, mesh, E))
    out["errors"] = _errors(rank, mesh, d, experts, E)
    out["p2p"] = tags.close()
    return out


def _persistent_buffers(d, experts, world, E):
    """Six steps of 1..8 tokens with the same k: no reallocation, parity alternates, seq counts."""
    B = d.buffers
    g = torch.Generator().manual_seed(5)
    ptrs, parities, seqs, allocs = set(), [], [], None
    for step, T in enumerate([1, 8, 3, 5, 2, 7]):
        idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
        w = torch.full((T, 2), 0.5, dtype=torch.float64)
        parities.append(B.round % 2)
        seqs.append(int(B.seq) if B.seq is not None else None)
        d(torch.randn(T, HIDDEN, generator=g, dtype=torch.float64), idx, w, experts)
        allocs = B.allocations if step == 0 else allocs
        ptrs.add(tuple(t.data_ptr() for s in B.sets for t in s.values()))
    return {"ptrs": len(ptrs), "realloc": B.allocations - allocs, "parities": parities,
            "seq_steps": [b - a for a, b in zip(seqs[1:], seqs[2:])]}


def _rounds(rank, world, d, experts, base, E):
    """Rank 0 holds 20 tokens (> decode_tokens), the others 3: every rank runs ceil(20/8) rounds."""
    g = torch.Generator().manual_seed(11 + rank)
    T = 20 if rank == 0 else 3
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    w = torch.full((T, 2), 0.5, dtype=torch.float64)
    x = torch.randn(T, HIDDEN, generator=g, dtype=torch.float64)
    d.static = False
    y = d(x, idx, w, experts)
    return {"rounds": d.last_rounds, "rounds_rel": _rel(y, base.dispatcher(x, idx, w, experts))}


def _batch_invariant_static(rank, world, mesh, E):
    """fp32 layers under the batch-invariant mode: the static path is bitwise the all-to-all."""
    base = apply_expert_parallel(make_layer(E, 2, seed=4), mesh, "alltoall")
    dec = apply_expert_parallel(make_layer(E, 2, seed=4), mesh, "gcmoe_decode", decode_tokens=MAX_T)
    dec.dispatcher.static = True
    diffs = []
    apply_numerics(base, Numerics(invariance="exact"))  # the experts both dispatchers run
    for seed in range(4):
        tokens, idx, w, x, _ = routing(100 + seed, world, E)
        lo = sum(tokens[:rank])
        sl = slice(lo, lo + tokens[rank])
        x, w = x.float(), w.float()
        diffs.append((dec.dispatcher(x[sl], idx[sl], w[sl], base.experts)
                      - base.dispatcher(x[sl], idx[sl], w[sl], base.experts)).abs().max().item())
    return {"invariant_static": diffs}


def _errors(rank, mesh, d, experts, E):
    errors = {}
    d.static = True
    try:  # every rank over the static capacity: each raises before communicating
        with torch.no_grad():
            d(torch.zeros(MAX_T + 1, HIDDEN, dtype=torch.float64), torch.zeros(MAX_T + 1, 1, dtype=torch.long),
              torch.ones(MAX_T + 1, 1, dtype=torch.float64), experts)
    except ValueError as err:
        errors["static"] = str(err)
    try:
        with torch.enable_grad():
            d(torch.zeros(2, HIDDEN, dtype=torch.float64, requires_grad=True), torch.zeros(2, 1, dtype=torch.long),
              torch.ones(2, 1, dtype=torch.float64), experts)
    except ValueError as err:
        errors["grad"] = str(err)
    try:
        apply_expert_parallel(make_layer(E, 2), mesh, "gcmoe_decode", decode_tokens=4 + rank)
    except ValueError as err:
        errors["agree"] = str(err)
    return errors


def _check(results, world, num_seeds):
    check_pairs_mirror([r["p2p"] for r in results])
    for rank, r in enumerate(results):
        assert r["kinds"] == {0, 1, 2, 3}
        assert all(v == 0.0 for v in r["exact"]), f"rank {rank}: exact vs all-to-all {r['exact']}"
        assert max(r["static"]) <= FP64_REL, f"rank {rank}: static vs all-to-all {r['static']}"
        assert max(r["ref"]) <= FP64_REL, f"rank {rank}: vs single process {r['ref']}"
        assert all(v == 0.0 for v in r["invariant_static"]), r["invariant_static"]
        assert r["full_pair"], "a pair's message never reached its static capacity"
        assert r["ptrs"] == 1 and r["realloc"] == 0, "decode buffers were reallocated between steps"
        assert r["parities"] == [(r["parities"][0] + i) % 2 for i in range(6)]
        assert r["seq_steps"] == [1] * 4
        assert r["rounds"] == 3 and r["rounds_rel"] <= FP64_REL, r
        err = r["errors"]
        assert "9 tokens on this rank exceed decode_tokens=8" in err["static"], err
        assert "forward-only" in err["grad"] and "torch.no_grad()" in err["grad"], err
        assert "decode_tokens" in err["agree"] and "rank 0: 4, rank 1: 5" in err["agree"], err


def test_decode_dispatcher_ep2_many_seeds():
    _check(run_distributed(_worker, 2, (24,)), 2, 24)


def test_decode_dispatcher_ep4():
    _check(run_distributed(_worker, 4, (8,)), 4, 8)


@pytest.mark.parametrize("k,El,want", [(1, 4, 8), (2, 4, 16), (8, 4, 32), (3, 2, 16)])
def test_pair_capacity(k, El, want):
    assert pair_capacity(MAX_T, k, El) == want
