"""GC-MoE against the all-to-all baseline: random routings over many seeds, random delays and
shuffled arrival orders injected into the transfer thread, chunk sizes below / equal to / above the
token count. ``compute="expert"`` must be bitwise equal in output and every gradient;
``compute="chunk"`` differs only by the CPU GEMM's small-M kernels (see gcmoe.py): the same
dot products summed in another order, which depends on the CPU and BLAS mode. The layers run in
float64 here, so that difference is a ~1e-16 relative effect per GEMM and the bound is
``FP64_REL`` (1e-10) relative to the output scale (tests/numerics.py); the bitwise claims hold in
any dtype (same rows, same kernels).
A receive ring of 2 slots × 4 rows carrying ~150 rows per round (random delays, shuffled posting
order) must also be bitwise equal, with the ring's high-water mark never above its slot count; and
`apply_expert_parallel` must reject ep ranks that disagree on chunk size, ring or dispatcher.

NCCL semantics on gloo: every worker runs under `TagZero`, which forces every p2p tag to 0 (gloo
then matches a pair's messages in issue order, as NCCL does) and logs each rank's p2p operations
per peer; the parent checks that both ends of every pair issued the same sequence (send <-> recv,
same sizes, same order), which is what NCCL's serial per-pair (or per-group) stream requires.
"""
from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist

from megatron_fp4.parallel.moe.expert_parallel import apply_expert_parallel
from megatron_fp4.parallel.mesh import ParallelMesh
from tests.distributed.launch import run_distributed
from tests.distributed.test_expert_parallel import make_batch, make_layer, max_diff, run_layer
from tests.numerics import FP64_REL


class RandomTiming:
    """Test hook: sleeps up to `max_s` at every transfer event and shuffles the arrival order."""

    def __init__(self, seed: int, max_s: float = 0.002):
        self.rng, self.max_s = random.Random(seed), max_s

    def delay(self, event, peer, chunk):
        if self.rng.random() < 0.5:
            time.sleep(self.rng.random() * self.max_s)

    def order(self, arrivals):
        arrivals = list(arrivals)
        self.rng.shuffle(arrivals)
        return arrivals


class TagZero:
    """Forces tag 0 on every dist.isend/irecv of this process and logs (op, numel) per peer."""

    def __init__(self):
        self.log = {}
        self._orig = dist.isend, dist.irecv
        dist.isend, dist.irecv = self._wrap("send", dist.isend), self._wrap("recv", dist.irecv)

    def _wrap(self, kind, fn):
        def call(tensor, peer=None, group=None, tag=0, **kw):
            self.log.setdefault(peer, []).append((kind, tensor.numel()))
            return fn(tensor, peer, group=group, tag=0, **kw)
        return call

    def close(self):
        dist.isend, dist.irecv = self._orig
        return self.log


def check_pairs_mirror(logs):
    """Both ends of every pair issued the same operations in the same order."""
    swap = {"send": "recv", "recv": "send"}
    for a, log in enumerate(logs):
        for b, ops in log.items():
            assert ops == [(swap[kind], n) for kind, n in logs[b].get(a, [])], f"pair {a}-{b} out of order"
    assert any(logs), "no p2p operation was logged"


def _grads(layer):
    return [layer.experts.w13.grad, layer.experts.w2.grad, layer.router.weight.grad]


def _worker_many_seeds(rank, world, num_seeds):
    tags = TagZero()
    mesh = ParallelMesh.build(pp=1, dp=world, ep=world)
    E = 2 * world
    layers = {name: apply_expert_parallel(make_layer(E, 2, seed=0).double(), mesh, disp, gcmoe_compute=comp)
              for name, disp, comp in [("base", "alltoall", "expert"), ("gc", "gcmoe", "expert"),
                                       ("gc_chunk", "gcmoe", "chunk")]}
    gc = layers["gc"].dispatcher
    out = {"exact": [], "chunk_rel": 0.0, "counter_sets": [], "kept_other_set": True, "chunks": set()}
    for seed in range(num_seeds):
        g = torch.Generator().manual_seed(seed)
        top_k = 1 + seed % 2
        router_w = torch.randn(E, layers["base"].router.weight.shape[1], generator=g, dtype=torch.float64)
        tokens = torch.randint(0, 40, (world,), generator=g).tolist()
        tokens[seed % world] = tokens[seed % world] if seed % 5 else 0  # sometimes a rank has none
        # same on every rank (a config value): below, equal to, above rank 0's T·k send rows
        chunk = [3, max(1, tokens[0] * top_k), 1000][seed % 3]
        out["chunks"].add(seed % 3)
        x, gy, tokens = make_batch(world, tokens, seed)
        x, gy = x.double(), gy.double()
        lo = sum(tokens[:rank])
        xs, gys = x[lo:lo + tokens[rank]], gy[lo:lo + tokens[rank]]
        results = {}
        for name, layer in layers.items():
            layer.top_k = layer.router.top_k = top_k
            with torch.no_grad():
                layer.router.weight.copy_(router_w)
            if name != "base":
                layer.dispatcher.chunk_tokens = chunk
                layer.dispatcher.test_hook = RandomTiming(seed * 97 + rank)
            before = [c.clone() for c in gc.counters]
            results[name] = run_layer(layer, xs, gys) + tuple(t.clone() for t in _grads(layer))
            if name == "gc":
                s = gc.last_counter_set
                out["counter_sets"].append(s)
                out["kept_other_set"] &= torch.equal(gc.counters[1 - s], before[1 - s])
        base = results["base"]
        out["exact"].append([max_diff(a, b) for a, b in zip(results["gc"], base)])
        scale = base[0].abs().max().item() if base[0].numel() else 1.0
        out["chunk_rel"] = max(out["chunk_rel"], max_diff(results["gc_chunk"][0], base[0]) / scale)
    out["round"] = gc.round
    out["p2p"] = tags.close()
    return out


def _check(results, num_seeds):
    check_pairs_mirror([r["p2p"] for r in results])
    for rank, r in enumerate(results):
        for seed, diffs in enumerate(r["exact"]):
            assert all(d == 0.0 for d in diffs), f"rank {rank} seed {seed}: y, dx, dw13, dw2, drouter diffs {diffs}"
        assert r["chunk_rel"] <= FP64_REL, r["chunk_rel"]
        assert r["round"] == num_seeds
        assert r["counter_sets"] == [i % 2 for i in range(num_seeds)]
        assert r["kept_other_set"], "a round touched the other round's counter set"
        assert r["chunks"] == {0, 1, 2}


def test_gcmoe_bitwise_equal_to_alltoall_ep2_many_seeds(ep2_results):
    _check([r["many_seeds"] for r in ep2_results], 20)


def test_gcmoe_bitwise_equal_to_alltoall_ep4():
    _check(run_distributed(_worker_many_seeds, 4, (6,)), 6)


# -- bounded receive ring -------------------------------------------------------------------------
RING_SLOTS, RING_CHUNK = 2, 4


def _worker_small_ring(rank, world, num_seeds):
    """A ring of 2 slots × 4 rows against hundreds of incoming rows per round."""
    tags = TagZero()
    mesh = ParallelMesh.build(pp=1, dp=world, ep=world)
    E = 2 * world
    base = apply_expert_parallel(make_layer(E, 2, seed=0), mesh, "alltoall")
    gc = apply_expert_parallel(make_layer(E, 2, seed=0), mesh, "gcmoe", chunk_tokens=RING_CHUNK,
                               ring_slots=RING_SLOTS)
    out = {"diffs": [], "stats": [], "recv_rows": []}
    for seed in range(num_seeds):
        x, gy, tokens = make_batch(world, [150 + 20 * r for r in range(world)], seed)
        lo = sum(tokens[:rank])
        xs, gys = x[lo:lo + tokens[rank]], gy[lo:lo + tokens[rank]]
        gc.dispatcher.test_hook = RandomTiming(seed * 31 + rank, max_s=0.0005)
        want = run_layer(base, xs, gys) + tuple(t.clone() for t in _grads(base))
        got = run_layer(gc, xs, gys) + tuple(t.clone() for t in _grads(gc))
        out["diffs"].append([max_diff(a, b) for a, b in zip(got, want)])
        out["stats"].append(dict(gc.dispatcher.last_ring_stats))
    out["high_water"] = gc.dispatcher.ring_high_water
    out["ring_shape"] = tuple(gc.dispatcher.channel.ring_shape)
    out["mismatch"] = _mismatch_errors(rank, mesh)  # same spawn: saves a process start
    out["p2p"] = tags.close()
    return out


def _worker_ep2(rank, world):
    """The ep2 runs of the module in one spawn: many seeds, then the small ring (and the mismatches)."""
    return {"many_seeds": _worker_many_seeds(rank, world, 20), "small_ring": _worker_small_ring(rank, world, 3)}


@pytest.fixture(scope="module")
def ep2_results():
    return run_distributed(_worker_ep2, 2)


@pytest.fixture(scope="module")
def small_ring_results(ep2_results):
    return [r["small_ring"] for r in ep2_results]


def test_small_ring_many_chunks_bitwise_and_bounded(small_ring_results):
    check_pairs_mirror([r["p2p"] for r in small_ring_results])
    for rank, r in enumerate(small_ring_results):
        for seed, diffs in enumerate(r["diffs"]):
            assert all(d == 0.0 for d in diffs), f"rank {rank} seed {seed}: y, dx, dw13, dw2, drouter {diffs}"
        assert r["ring_shape"] == (RING_SLOTS, RING_CHUNK, 32)
        for st in r["stats"]:
            assert st["slots"] == RING_SLOTS and st["high_water"] == RING_SLOTS, st
            # ~150 rows in 4-row chunks from the peer: every slot was reused dozens of times
            assert st["acquired"] >= 10 * RING_SLOTS, st
        assert r["high_water"] <= RING_SLOTS


# -- config agreement across the ep group ---------------------------------------------------------
def _mismatch_errors(rank, mesh):
    errors = {}
    for name, kwargs in [("chunk", dict(chunk_tokens=8 + rank)), ("slots", dict(ring_slots=2 + rank)),
                         ("dispatcher", dict())]:
        disp = ("alltoall", "gcmoe")[rank] if name == "dispatcher" else "gcmoe"
        try:
            apply_expert_parallel(make_layer(4, 2), mesh, disp, **kwargs)
            errors[name] = None
        except ValueError as err:
            errors[name] = str(err)
    apply_expert_parallel(make_layer(4, 2), mesh, "alltoall", chunk_tokens=8 + rank)  # irrelevant there
    return errors


def test_chunk_tokens_and_ring_slots_must_agree_across_ep(small_ring_results):
    for r in (res["mismatch"] for res in small_ring_results):
        assert "parallel.gcmoe_chunk_tokens" in r["chunk"] and "rank 0: 8, rank 1: 9" in r["chunk"], r
        assert "parallel.gcmoe_ring_slots" in r["slots"] and "rank 0: 2, rank 1: 3" in r["slots"], r
        assert "parallel.expert_dispatcher" in r["dispatcher"] and "'gcmoe'" in r["dispatcher"], r
