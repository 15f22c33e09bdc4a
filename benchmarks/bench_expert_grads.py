"""Training step with expert weights as `unbind` views (one gradient buffer per stacked weight) vs
per-expert indexing `w13[e]` (a zeroed full-size gradient per expert, the layout before), side by side.

    python benchmarks/bench_expert_grads.py                 # tiny_moe at hidden 128 / 32 experts, bf16 and fp4_resq
    python benchmarks/bench_expert_grads.py --steps 10 --set model.num_experts=64

Per mode two trainers are built from the same config and data (same init); timed steps alternate
between them so machine noise hits both alike, and every step's loss and grad norm are checked equal
(the two layouts compute the same gradients). Prints tokens/s and the speed-up.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_fp4.config import default_config_path, load_config
from megatron_fp4.model.moe import GroupedExperts
from megatron_fp4.training.trainer import Trainer

DEFAULTS = ["model.hidden_size=128", "model.moe_ffn_hidden_size=128", "model.num_experts=32",
            "model.head_dim=32", "schedule.global_batch_size=8", "schedule.micro_batch_size=4", "data.num_samples=500"]


def build(args, mode: str, select: bool) -> Trainer:
    cfg = load_config(args.config, DEFAULTS + args.overrides + [
        f"fp4.train_mode={mode}", "logging.tensorboard_dir=null", "checkpoint.dir=null", "logging.progress=false"])
    trainer = Trainer(cfg)
    for m in trainer.model.modules():
        if isinstance(m, GroupedExperts):
            m.select_per_expert = select
            m.grouped = False  # both sides run the per-expert loop: this compares its weight layouts
    return trainer


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(default_config_path()))
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--modes", default="bf16,fp4_resq")
    args = p.parse_args(argv)
    print(f"threads={torch.get_num_threads()} overrides={DEFAULTS + args.overrides}")
    print(f"{'mode':<10} {'w13[e] tok/s':>13} {'unbind tok/s':>13} {'speed-up':>9}")
    for mode in args.modes.split(","):
        trainers = {"select": build(args, mode, True), "unbind": build(args, mode, False)}
        cfg = trainers["select"].cfg
        tokens = cfg.schedule.global_batch_size * cfg.schedule.seq_len
        times = {k: [] for k in trainers}
        for i in range(args.warmup + args.steps):
            res = {}
            for name, trainer in trainers.items():
                start = time.perf_counter()
                res[name] = trainer.train_step()
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - start)
            if (res["select"]["loss"], res["select"]["grad_norm"]) != (res["unbind"]["loss"], res["unbind"]["grad_norm"]):
                raise SystemExit(f"{mode} step {i}: the layouts disagree: {res}")
        t_s, t_u = statistics.median(times["select"]), statistics.median(times["unbind"])
        print(f"{mode:<10} {tokens / t_s:>13.0f} {tokens / t_u:>13.0f} {t_s / t_u:>8.2f}x")


if __name__ == "__main__":
    main()
