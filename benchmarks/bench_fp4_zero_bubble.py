"""Zero-bubble (ZB1P) vs interleaved 1F1B pipeline step in ``fp4_resq``, side by side in one run.

Zero-bubble schedules run each backward as an input-grad pass (I) and a later weight-grad pass
(W); MoEResQ's backward is split into a dgrad and a wgrad autograd node (``fp4/moeresq.py``), so
I runs only dgrad and W only wgrad: ZB1P makes as many dgrad and wgrad GEMMs as 1F1B. For each
schedule it spawns pp=2 gloo processes (virtual_stages=2), runs warm-up steps, then times
``--steps`` steps and counts the dgrad and wgrad GEMMs (with their quantizations) per step,
summed over ranks. Printed: median step time, calls per step, and the ZB1P / 1F1B ratios.

    OMP_NUM_THREADS=1 python benchmarks/bench_fp4_zero_bubble.py [--layers 4] [--microbatches 4]

CPU caveat (as in bench_pipeline.py): with more processes than cores the times include waiting
for a core; the call counts are exact.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.bench_pipeline import bench_cfg


def _child(rank, world_size, cfg, steps: int):
    import megatron_fp4.fp4.moeresq as moeresq
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer, lm_loss_fn

    calls = {"dgrad": 0, "wgrad": 0}
    for key in calls:
        original = getattr(moeresq, "_" + key)

        def counted(*args, _original=original, _key=key):
            calls[_key] += 1
            return _original(*args)
        setattr(moeresq, "_" + key, counted)
    trainer = Trainer(cfg, ParallelMesh.build(cfg.parallel.pp, 1, 1))
    for _ in range(2):  # warm-up (allocations, shape set-up)
        trainer.train_step()
    times = []
    for _ in range(steps):
        batch = trainer.next_micro_batches()
        torch.distributed.barrier()
        for key in calls:
            calls[key] = 0
        start = time.perf_counter()
        trainer.pipeline.run(batch, lm_loss_fn)
        times.append(time.perf_counter() - start)
        torch.distributed.barrier()
    return {"times": times, "calls": dict(calls)}


def measure(schedule: str, layers: int, microbatches: int, steps: int) -> dict:
    from tests.distributed.launch import run_distributed

    cfg = bench_cfg(2, 2, layers, microbatches, schedule)
    cfg.fp4.scope, cfg.fp4.train_mode = "experts+attention", "fp4_resq"
    per_rank = run_distributed(_child, 2, (cfg, steps), timeout_s=1800)
    wall = [max(r["times"][i] for r in per_rank) for i in range(steps)]
    return {"schedule": schedule, "ms": statistics.median(wall) * 1e3,
            "dgrad": sum(r["calls"]["dgrad"] for r in per_rank), "wgrad": sum(r["calls"]["wgrad"] for r in per_rank)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    one_f1b, zb = (measure(schedule, a.layers, a.microbatches, a.steps)
                   for schedule in ("interleaved_1f1b", "interleaved_zero_bubble"))
    print(f"{'schedule':<25}{'step ms':>10}{'dgrad/step':>12}{'wgrad/step':>12}")
    for r in (one_f1b, zb):
        print(f"{r['schedule']:<25}{r['ms']:>10.1f}{r['dgrad']:>12}{r['wgrad']:>12}")
    print(f"ZB1P / interleaved 1F1B: step time {zb['ms'] / one_f1b['ms']:.2f}, "
          f"GEMM calls {(zb['dgrad'] + zb['wgrad']) / (one_f1b['dgrad'] + one_f1b['wgrad']):.2f}")


if __name__ == "__main__":
    main()
