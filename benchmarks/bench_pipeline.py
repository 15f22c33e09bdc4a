"""Pipeline bubble and ZeRO optimizer memory, measured side by side in one run.

For 1F1B, interleaved 1F1B and the zero-bubble schedules ZB1P (interleaved_zero_bubble) and ZB-V
(pp=2, and pp=4 with --pp4) it spawns gloo processes, runs warm-up
steps, then times every stage forward/backward of one training step on every rank and reports the
idle fraction (idle / busy, the quantity the theory gives as (pp−1)/(v·m)) beside the theoretical
value (1F1B family only), and writes a per-rank busy/idle timeline PNG. The zero-bubble schedules
split each backward into input-grad (I) and weight-grad (W) work; W fills what would be bubble. Then it prints the fp32 master + Adam bytes per
rank for dp = 1, 2, 4 from the ZeRO layout planner (the same functions the optimizer uses; the
distributed memory test checks the optimizer holds exactly that).

    OMP_NUM_THREADS=1 python benchmarks/bench_pipeline.py [--pp4] [--png pipeline_timeline.png]

CPU caveat: with more processes than cores, ranks also wait for a core; the measured bubble then
overstates the schedule's own idle time.
"""
from __future__ import annotations

import argparse
import time

import torch

from megatron_fp4.config import Config
from megatron_fp4.parallel.pipeline import theoretical_bubble


def bench_cfg(pp: int, v: int, layers: int, microbatches: int, schedule: str | None = None) -> Config:
    cfg = Config()
    cfg.model.num_layers = layers
    cfg.fp4.scope, cfg.fp4.train_mode = "none", "bf16"
    s = cfg.schedule
    s.micro_batch_size, s.seq_len, s.global_batch_size, s.warmup_steps = 2, 32, 2 * microbatches, 1
    cfg.data.num_samples = 400
    cfg.logging.tensorboard_dir, cfg.logging.progress = None, False
    cfg.parallel.pp, cfg.parallel.virtual_stages = pp, v
    cfg.parallel.schedule = schedule or ("interleaved_1f1b" if v > 1 else "1f1b")
    return cfg


def _timed_step(rank, world_size, cfg):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer, lm_loss_fn

    trainer = Trainer(cfg, ParallelMesh.build(cfg.parallel.pp, 1, 1))
    events = []
    for stage in trainer.pipeline.stages:
        for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                             ("backward_weight_one_chunk", "W")):
            original = getattr(stage, method)

            def timed(*args, _original=original, _kind=kind, _chunk=stage.stage_index, **kwargs):
                t0 = time.perf_counter()
                out = _original(*args, **kwargs)
                events.append((_kind, _chunk, t0, time.perf_counter()))
                return out
            setattr(stage, method, timed)
    for _ in range(2):  # warm-up (allocations, shape set-up)
        trainer.train_step()
    torch.distributed.barrier()
    events.clear()
    start = time.perf_counter()
    trainer.pipeline.run(trainer.next_micro_batches(), lm_loss_fn)
    end = time.perf_counter()
    return {"events": [(k, c, a - start, b - start) for k, c, a, b in events], "wall": end - start}


def measure(pp: int, v: int, layers: int, microbatches: int, schedule: str | None = None) -> dict:
    from tests.distributed.launch import run_distributed

    cfg = bench_cfg(pp, v, layers, microbatches, schedule)
    per_rank = run_distributed(_timed_step, pp, (cfg,), timeout_s=900)
    busy = [sum(b - a for _, _, a, b in r["events"]) for r in per_rank]
    wall = max(r["wall"] for r in per_rank)
    idle = [wall - x for x in busy]
    zero_bubble = cfg.parallel.schedule in ("interleaved_zero_bubble", "zbv")
    return {"pp": pp, "v": v, "m": microbatches, "per_rank": per_rank, "wall": wall, "name": cfg.parallel.schedule,
            "measured": sum(i / b for i, b in zip(idle, busy)) / pp,
            "theory": float("nan") if zero_bubble else theoretical_bubble(pp, v, microbatches)}


def zero_memory(dp_sizes=(1, 2, 4), bucket_mb: float = 4.0) -> list[tuple[int, int, int]]:
    """(dp, bytes per rank, unsharded bytes) of fp32 masters + exp_avg + exp_avg_sq, tiny_moe model."""
    from megatron_fp4.model import build_model
    from megatron_fp4.parallel.zero import owned_ranges, plan_buckets
    from megatron_fp4.training.optim import no_weight_decay

    model = build_model(Config())
    groups: dict = {}
    for name, p in model.named_parameters():
        groups.setdefault(no_weight_decay(name, p), []).append(p.numel())
    total = 12 * sum(p.numel() for p in model.parameters())
    rows = []
    for dp in dp_sizes:
        held = 0
        for numels in groups.values():
            _, buckets = plan_buckets(numels[::-1], int(bucket_mb * 2**20 / 4), dp)
            held += 12 * sum(hi - lo for lo, hi in owned_ranges(buckets, dp, 0))
        rows.append((dp, held, total))
    return rows


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 1.2 + 0.6 * sum(r["pp"] for r in results)), squeeze=False)
    for ax, res in zip(axes[:, 0], results):
        for rank, r in enumerate(res["per_rank"]):
            for kind, chunk, a, b in r["events"]:
                palette = {"F": ("tab:blue", "tab:green", "tab:purple", "tab:cyan"),
                           "B": ("tab:orange", "tab:red", "tab:brown", "tab:pink"),
                           "W": ("gold", "khaki", "olive", "yellowgreen")}[kind]
                color = palette[chunk // res["pp"] % 4]
                ax.broken_barh([(a * 1e3, (b - a) * 1e3)], (rank - 0.4, 0.8), color=color)
        ax.set_yticks(range(res["pp"]), [f"rank {i}" for i in range(res["pp"])])
        ax.invert_yaxis()
        ax.set_title(f"{res['name']}: pp={res['pp']} v={res['v']} m={res['m']} — idle/busy measured "
                     f"{res['measured']:.2f}, theory {res['theory']:.2f} (F blue/green, B orange/red, W yellow)")
        ax.set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp4", action="store_true", help="also pp=4 (4 processes)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--png", default="pipeline_timeline.png")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    zb = [(2, 2, "interleaved_zero_bubble"), (2, 2, "zbv")]
    layouts = [(2, 1, None), (2, 2, None)] + zb + ([(4, 1, None), (4, 2, None), (4, 2, "zbv")] if a.pp4 else [])
    results = [measure(pp, v, a.layers, a.microbatches, schedule) for pp, v, schedule in layouts]
    print(f"{'schedule':<25}{'pp':>3}{'v':>3}{'m':>4}{'step ms':>10}{'idle/busy':>11}{'theory':>9}")
    for r in results:
        print(f"{r['name']:<25}{r['pp']:>3}{r['v']:>3}{r['m']:>4}{r['wall'] * 1e3:>10.1f}{r['measured']:>11.3f}"
              f"{r['theory']:>9.3f}")
    print(f"\n{'dp':>3}{'optimizer MB/rank':>19}{'fraction of unsharded':>23}")
    for dp, held, total in zero_memory():
        print(f"{dp:>3}{held / 2**20:>19.3f}{held / total:>23.4f}")
    plot(results, a.png)
    print(f"\ntimeline written to {a.png}")


if __name__ == "__main__":
    main()
