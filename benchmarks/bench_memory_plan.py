"""Planned vs measured memory per rank: tools/memory_plan.py's total against the peak-RSS growth of
building the trainer and running two steps, at pp1, pp2, ep2 and tp2 (sequence parallel; gloo on CPU).

    OMP_NUM_THREADS=1 python benchmarks/bench_memory_plan.py
    python benchmarks/bench_memory_plan.py --layouts pp1 --set model.num_layers=2

Peak RSS is measured as in benchmarks/bench_memory.py (its layouts, model and helpers: one fresh
process group per layout, the baseline taken after imports, the process group and torch's one-time
meta-kernel import). Two steps, so the peak is a steady-state step's: Adam moments exist while the
second step's activations are saved (what the planner's "total" is). The model is bench_memory's
~76 M parameter MoE (weights dominate, as at scale) with longer sequences than there, so the
saved activations are a visible part. Goal (issue 26): measured within 10 % of planned.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_memory import DEFAULTS, LAYOUTS, _peak_mb, init_rank, spawn_layout  # noqa: E402  (the same measurement)

PLAN_LAYOUTS = dict(LAYOUTS, tp2=dict(pp=1, ep=1, tp=2, world=2))
PLAN_DEFAULTS = DEFAULTS + ["schedule.global_batch_size=8", "schedule.micro_batch_size=2", "schedule.seq_len=128"]
STEPS = 2


def _rank_main(rank, world, port, spec, overrides, queue):
    from megatron_fp4.training.trainer import Trainer

    cfg, mesh = init_rank(rank, world, port, spec, PLAN_DEFAULTS + overrides)
    before = _peak_mb()
    trainer = Trainer(cfg, mesh, build_data=False)
    s, gen = cfg.schedule, torch.Generator().manual_seed(mesh.coord("dp"))
    for _ in range(STEPS):
        tokens = torch.randint(0, cfg.model.vocab_size, (trainer.num_microbatches, s.micro_batch_size, s.seq_len),
                               generator=gen)
        trainer.train_step_with_loss([{"tokens": t, "labels": t} for t in tokens])
    queue.put((rank, dict(pp_rank=mesh.coord("pp"), growth=_peak_mb() - before)))
    dist.barrier()
    dist.destroy_process_group()


def run_layout(spec: dict, overrides: list) -> list[dict]:
    return spawn_layout(_rank_main, spec, (overrides,), timeout=1800)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--layouts", default="pp1,pp2,ep2,tp2")
    args = parser.parse_args(argv)
    from megatron_fp4.config import default_config_path, load_config
    from megatron_fp4.training.memory_plan import plan_memory

    print(f"{'layout':7} {'rank':>4} {'state MB':>9} {'act MB':>8} {'step tmp MB':>11} {'grad tmp MB':>11} {'planned MB':>10} "
          f"{'measured MB':>11} {'measured/planned':>16}")
    worst = 0.0
    for name in args.layouts.split(","):
        spec = PLAN_LAYOUTS[name]
        cfg = load_config(default_config_path(), PLAN_DEFAULTS + args.overrides + [
            f"parallel.pp={spec['pp']}", f"parallel.ep={spec['ep']}", f"parallel.tp={spec.get('tp', 1)}"])
        plans = plan_memory(cfg, spec["world"])  # ZeroAdamW at every size
        for rank, r in enumerate(run_layout(spec, args.overrides)):
            plan = plans[r["pp_rank"]]
            mb = 2**20
            act = (plan.activations + plan.fp4_weights + plan.head_transient) / mb
            state = (plan.params + plan.grads + plan.optimizer) / mb
            ratio = r["growth"] / (plan.total / mb)
            worst = max(worst, abs(ratio - 1))
            print(f"{name:7} {rank:>4} {state:>9.1f} {act:>8.1f} {plan.step_transient / mb:>11.1f} {plan.grad_transient / mb:>11.1f} "
                  f"{plan.total / mb:>10.1f} {r['growth']:>11.1f} {ratio:>16.3f}", flush=True)
    print(f"worst |measured/planned - 1| = {worst:.3f} (goal <= 0.10)")
    return 0 if worst <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
