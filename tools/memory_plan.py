"""Per-rank memory plan of a config and layout: parameters, gradients, optimizer state, activations.

    python tools/memory_plan.py examples/configs/qwen3_30b_a3b.yaml --world-size 16 \
        --set parallel.pp=2 parallel.ep=8
    python tools/memory_plan.py megatron_fp4/configs/tiny_moe.yaml --world-size 2 --set parallel.ep=2 --format json
    python tools/memory_plan.py examples/configs/qwen3_30b_a3b.yaml --world-size 8 --set parallel.ep=8 \
        --format markdown --label "ep8 (dp8)" --gpu-gb 80,141      # docs/memory.md's table rows

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


MARKDOWN = (("params", "params"), ("grads", "grads"), ("masters", "masters"), ("moments", "moments"),
            ("activations", "activations"), ("fp4_weights", "Q(W)"), ("head_transient", "head"),
            ("grad_transient", "grad tmp"), ("step_transient", "step tmp"), ("total", "total"))


def format_markdown(plans, label: str = "", gpu_gb=()) -> str:
    """The rows of docs/memory.md's tables: GB per rank, and whether the total fits each GPU size
    in `gpu_gb` (GB = 1e9 bytes, as the cards are sold; a plan's total is the allocator's live
    bytes, docs/memory.md: leave the allocator's own slack beside it)."""
    head = "| layout | role | " + " | ".join(h for _, h in MARKDOWN) + "".join(f" | fits {g:g} GB" for g in gpu_gb) + " |"
    lines = [head, "|---|---|" + "---:|" * (len(MARKDOWN) + len(gpu_gb))]
    for i, p in enumerate(plans):
        cells = [label if i == 0 else "", p.role] + [f"{getattr(p, r) / GB:.2f}" for r, _ in MARKDOWN]
        cells += ["yes" if p.total / GB <= g else "no" for g in gpu_gb]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="YAML config")
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks (GPUs)")
    parser.add_argument("--set", dest="overrides", nargs="*", action="extend", default=[],
                        help="dotted overrides, e.g. parallel.pp=2 parallel.ep=8")
    parser.add_argument("--format", choices=("table", "json", "markdown"), default="table")
    parser.add_argument("--label", default="", help="markdown: the layout's name in the first row")
    parser.add_argument("--gpu-gb", default="", help="markdown: GPU sizes to check the totals against, e.g. 80,141")
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
    elif args.format == "markdown":
        try:
            sizes = [float(g) for g in args.gpu_gb.split(",") if g.strip()]
        except ValueError:
            print(f"error: --gpu-gb={args.gpu_gb!r}: give GPU sizes in GB separated by commas, e.g. 80,141",
                  file=sys.stderr)
            return 2
        print(format_markdown(plans, args.label, sizes))
    else:
        print(format_table(plans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
