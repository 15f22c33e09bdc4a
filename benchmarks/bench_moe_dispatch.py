"""One MoE layer's dispatch at ep2 on CPU/gloo: all-to-all baseline vs GC-MoE (overlapped).

    OMP_NUM_THREADS=1 python benchmarks/bench_moe_dispatch.py --tokens 256 1024 --chunks 32 128 --ring-slots 8

Spawns 2 processes itself. For each (tokens per rank, chunk_tokens) it times, as the max over
ranks of the median over `--reps` calls of the dispatcher (router output precomputed):

- transfer: the baseline's exchanges alone (counts, tokens out, outputs back), no experts;
- compute:  the local experts on the received batch alone;
- a2a fwd / gc fwd: the full dispatcher forward (gc with compute="expert" and "chunk");
- a2a f+b / gc f+b: forward + backward (GC backward = baseline exchange + expert recompute);
- hidden = (a2a fwd − gc fwd) / transfer: share of the transfer time GC-MoE saved against the
  baseline by overlapping it (≤ 0: its threads/bookkeeping cost more than the overlap won). Both
  dispatchers pay the same permute/combine, so their difference isolates the overlap. On a CPU
  with fewer free cores than 2 ranks × (compute + transfer thread) there is nothing to overlap on.
GC-MoE receives through a ring of ``--ring-slots`` slots × chunk rows (``ring`` column: slots,
then the high-water mark of slots in use and the receives posted, from the last call on rank 0).
Wall-clock ratios only; nothing here is asserted.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_fp4.fp4 import Recipe  # noqa: E402
from megatron_fp4.model.moe import MoELayer, init_moe_params  # noqa: E402
from megatron_fp4.parallel.moe.alltoall import DispatchPlan, all_to_all_rows  # noqa: E402
from megatron_fp4.parallel.moe.expert_parallel import apply_expert_parallel  # noqa: E402
from megatron_fp4.parallel.mesh import ParallelMesh  # noqa: E402


def _timed(fn, reps, group=None):
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def init_rank(rank: int, world: int, port: int) -> None:
    """This spawned rank's gloo process group on localhost, one intra-op thread."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def run_ep_ranks(worker, world: int, args):
    """Spawn `worker(rank, world, port, args, queue)` on `world` ranks; what rank 0 puts on the queue."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    rows = queue.get()
    for p in procs:
        p.join()
    return rows


def _layer(args, mesh, dispatcher, compute="expert", chunk=64):
    layer = MoELayer(args.hidden, args.experts, args.top_k, args.ffn, Recipe(mode=args.mode))
    init_moe_params(layer, 0.05, 0.05, torch.Generator().manual_seed(0))
    return apply_expert_parallel(layer, mesh, dispatcher, chunk_tokens=chunk, gcmoe_compute=compute,
                                 ring_slots=args.ring_slots)


def _worker(rank, world, port, args, queue):
    init_rank(rank, world, port)
    mesh = ParallelMesh.build(pp=1, dp=world, ep=world)
    base = _layer(args, mesh, "alltoall")
    gcs = {c: _layer(args, mesh, "gcmoe", c) for c in ("expert", "chunk")}
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            _, _, topk_idx, topk_w = base.router(x)
        experts, group = base.experts, mesh.group("ep")
        plan = DispatchPlan.exchange(topk_idx, args.experts, world, group)
        x_grouped = torch.randn(sum(plan.out_splits), args.hidden)

        def transfer():
            p = DispatchPlan.exchange(topk_idx, args.experts, world, group)
            recv = all_to_all_rows(x[p.token_of_row], p.out_splits, p.in_splits, group)
            all_to_all_rows(recv, p.in_splits, p.out_splits, group)

        def compute():
            with torch.no_grad():
                experts(x_grouped, plan.local_counts)

        def fwd(layer):
            def run():
                with torch.no_grad():
                    layer.dispatcher(x, topk_idx, topk_w, layer.experts)
            return run

        def fwd_bwd(layer):
            def run():
                xr = x.detach().requires_grad_(True)
                layer.dispatcher(xr, topk_idx, topk_w, layer.experts).sum().backward()
            return run

        t_tr, t_comp = _timed(transfer, args.reps), _timed(compute, args.reps)
        t_a2a, t_a2a_fb = _timed(fwd(base), args.reps), _timed(fwd_bwd(base), args.reps)
        for chunk in args.chunks:
            for comp, layer in gcs.items():
                layer.dispatcher.chunk_tokens = chunk
                t_gc, t_gc_fb = _timed(fwd(layer), args.reps), _timed(fwd_bwd(layer), args.reps)
                st = layer.dispatcher.last_ring_stats
                ring = f"{st['slots']}/{st['high_water']}/{st['acquired']}"
                rows.append((tokens, chunk, comp, ring, t_tr, t_comp, t_a2a, t_gc, t_a2a_fb, t_gc_fb))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--chunks", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--mode", default="bf16", help="Recipe mode of the experts: bf16 | fp4 | fp4_resq")
    ap.add_argument("--ring-slots", type=int, default=8, help="GC-MoE receive ring slots (gcmoe_ring_slots)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    rows = run_ep_ranks(_worker, 2, args)
    print(f"ep=2 gloo CPU, hidden={args.hidden} ffn={args.ffn} experts={args.experts} top_k={args.top_k} "
          f"mode={args.mode}; ms = max over ranks of the median of {args.reps}")
    head = ("tokens", "chunk", "gc", "ring", "transfer", "compute", "a2a fwd", "gc fwd", "gc/a2a", "hidden",
            "a2a f+b", "gc f+b", "gc/a2a")
    print("".join(f"{h:>10}" for h in head))
    for tokens, chunk, comp, ring, tr, cp, a2a, gc, a2a_fb, gc_fb in rows:
        hidden = (a2a - gc) / tr if tr > 0 else float("nan")
        vals = (tokens, chunk, comp, ring, f"{tr * 1e3:.2f}", f"{cp * 1e3:.2f}", f"{a2a * 1e3:.2f}",
                f"{gc * 1e3:.2f}", f"{gc / a2a:.2f}", f"{hidden:+.2f}", f"{a2a_fb * 1e3:.2f}", f"{gc_fb * 1e3:.2f}", f"{gc_fb / a2a_fb:.2f}")
        print("".join(f"{v:>10}" for v in vals))


if __name__ == "__main__":
    main()
