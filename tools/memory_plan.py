"""Per-rank memory plan of a config and layout: parameters, gradients, optimizer state, activations.

    python tools/memory_plan.py examples/configs/qwen3_30b_a3b.yaml --world-size 16 \
        --set parallel.pp=2 parallel.ep=8
    python tools/memory_plan.py megatron_fp4/configs/tiny_moe.yaml --world-size 2 --set parallel.ep=2 --format json

The numbers come from the project's own code (megatron_fp4/training/memory_plan.py: the meta-device
model cut as the trainer cuts it, ZeroAdamW's buffer layout, the saved-tensor terms of the forward);
docs/memory.md ("Planning") says what each row holds and how it was checked. One row per pipeline
rank: its dp, ep and tp peers hold the same bytes. A bad config or layout: one line, exit status 2.
"""
from __future__ import annotations

import argparse
import json
import sys

GB = 1e9
ROWS = ("params", "grads", "masters", "moments", "steps", "activations", "fp4_weights", "head_transient", "grad_transient",
        "step_transient",
        "total")


def _plan_dict(plan) -> dict:
    out = {name: getattr(plan, name) for name in ROWS}
    # the first and last rank, not a list of them (a world of 1e9 ranks is a valid layout to plan)
    out.update(role=plan.role, first_rank=plan.ranks[0], last_rank=plan.ranks[-1], optimizer=plan.optimizer,
               param_numel=plan.param_numel,
               inflight_microbatches={str(c): n for c, n in plan.inflight.items()})
    return out


def format_table(plans) -> str:
    head = f"{'role':6} {'ranks':>11} " + " ".join(f"{r:>12}" for r in ROWS)
    lines = [head + "   (GB = 1e9 bytes)"]
    for p in plans:
        ranks = f"{p.ranks[0]}-{p.ranks[-1]}" if len(p.ranks) > 1 else str(p.ranks[0])
        lines.append(f"{p.role:6} {ranks:>11} " + " ".join(f"{getattr(p, r) / GB:>12.3f}" for r in ROWS))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="YAML config")
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks (GPUs)")
    parser.add_argument("--set", dest="overrides", nargs="*", action="extend", default=[],
                        help="dotted overrides, e.g. parallel.pp=2 parallel.ep=8")
    parser.add_argument("--format", choices=("table", "json"), default="table")
    args = parser.parse_args(argv)
    from megatron_fp4.config import load_config
    from megatron_fp4.training.memory_plan import plan_memory

    if args.world_size < 1:
        print(f"error: --world-size={args.world_size}: must be >= 1", file=sys.stderr)
        return 2
    try:
        plans = plan_memory(load_config(args.config, args.overrides), args.world_size)
    except ValueError as err:  # ConfigError too: the config's own one-line messages
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps([_plan_dict(p) for p in plans], indent=1))
    else:
        print(format_table(plans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
