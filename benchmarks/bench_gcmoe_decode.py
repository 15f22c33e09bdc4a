"""Decode-step latency of one MoE layer at ep2 on CPU/gloo: all-to-all vs the GC-MoE decode path.

    OMP_NUM_THREADS=1 python benchmarks/bench_gcmoe_decode.py --tokens 1 2 4 8 --reps 200

Spawns 2 processes itself. For each tokens-per-rank count it runs the MoE layer forward (router +
dispatcher + experts, under no_grad, as a decode step does) with four dispatchers on the same
local experts, alternating them call by call (a2a, decode exact, decode static, decode exact over
the p2p transport, a2a, ...) so load changes on a shared machine hit all alike; every call starts
after a barrier. Columns: the max over ranks of each dispatcher's median (ms), and the ratios
decode/a2a (< 1: the decode path is faster). The all-to-all pays a count exchange plus two
variable-split exchanges and the plan's host work; the decode path one fixed-size message per
pair and direction (`decode_tokens` capacity, by default the row's tokens per rank). Wall-clock ratios only; nothing here is asserted.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_fp4.fp4 import Recipe  # noqa: E402
from megatron_fp4.model.moe import MoELayer, init_moe_params  # noqa: E402
from megatron_fp4.parallel.moe.expert_parallel import apply_expert_parallel  # noqa: E402
from megatron_fp4.parallel.mesh import ParallelMesh  # noqa: E402
from bench_moe_dispatch import init_rank, run_ep_ranks  # noqa: E402


def _worker(rank, world, port, args, queue):
    init_rank(rank, world, port)
    mesh = ParallelMesh.build(pp=1, dp=world, ep=world)

    def layer(dispatcher, capacity):
        moe = MoELayer(args.hidden, args.experts, args.top_k, args.ffn, Recipe(mode=args.mode))
        init_moe_params(moe, 0.05, 0.05, torch.Generator().manual_seed(0))
        return apply_expert_parallel(moe, mesh, dispatcher, decode_tokens=capacity).eval()

    base = layer("alltoall", 1)
    rows = []
    for tokens in args.tokens:
        capacity = args.capacity or tokens
        dec, static, p2p = (layer("gcmoe_decode", capacity) for _ in range(3))
        static.dispatcher.static = True
        p2p.dispatcher.transport = "p2p"
        variants = {"a2a": base, "exact": dec, "static": static, "p2p": p2p}
        x = torch.randn(tokens, args.hidden, generator=torch.Generator().manual_seed(rank))
        times = {name: [] for name in variants}
        with torch.no_grad():
            for name, moe in variants.items():  # warm-up (buffers, first-call paths)
                moe(x)
            for _ in range(args.reps):
                for name, moe in variants.items():
                    dist.barrier()
                    t0 = time.perf_counter()
                    moe(x)
                    times[name].append(time.perf_counter() - t0)
        med = torch.tensor([statistics.median(times[n]) for n in variants])
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        rows.append((tokens, *med.tolist()))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8], help="tokens per rank per step")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--mode", default="bf16", help="Recipe mode of the experts: bf16 | fp4 | fp4_resq")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--capacity", type=int, default=0,
                    help="decode_tokens (static capacity per rank); 0: the row's tokens per rank, as with "
                         "one CUDA graph and buffer set per batch-size bucket")
    args = ap.parse_args()
    rows = run_ep_ranks(_worker, 2, args)
    print(f"ep=2 gloo CPU, hidden={args.hidden} ffn={args.ffn} experts={args.experts} top_k={args.top_k} "
          f"mode={args.mode} decode_tokens={args.capacity or 'tokens'}; ms = max over ranks of the median of "
          f"{args.reps} alternating calls")
    head = ("tokens", "a2a", "exact", "static", "p2p", "exact/a2a", "static/a2a", "p2p/a2a")
    print("".join(f"{h:>11}" for h in head))
    for tokens, a2a, *dec in rows:
        vals = (tokens, *(f"{t * 1e3:.3f}" for t in (a2a, *dec)), *(f"{t / a2a:.2f}" for t in dec))
        print("".join(f"{v:>11}" for v in vals))


if __name__ == "__main__":
    main()
