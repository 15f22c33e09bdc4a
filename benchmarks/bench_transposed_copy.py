"""What ``RowPlan.transposed_copy`` buys (``fp4/row_calls.py``): ``mm``'s operand from the weight's
contiguous transposed copy instead of the transposed view of the row-major weight, at the ``batch``
level, side by side in one process; ``--flag batched``: what ``RowPlan.batched`` buys (a decode
step's expert runs of one height in one ``bmm`` instead of one ``mm`` per expert); ``--flag low``:
what ``RowPlan.low`` buys (oneDNN calls of 2-3 rows made as they are instead of padded to 4: a
decode step's experts at a realistic width); ``--flag tall``: what a oneDNN plan's heights past its
probed ones buy (``RowPlan.dense``: calls of up to 256 rows, each height verified at its first call,
instead of 64-row ones: a scoring pass's experts and projections at a realistic width); ``--flag
in_place``: what reading a oneDNN plan's grouped runs in place buys (``tiled._onednn_runs``: a run's
calls read the next runs' rows where the padded layout has zeros) against the padded layout
(``GroupedRows``: a zero-filled copy of every row and a gather back; ``tiled.IN_PLACE_ROWS`` raised
past any pass), timed on the engine's generation and on the trainer's scoring of its sequences;
``--flag stream``: what the row-streaming kernel buys (``RowPlan.stream``, ``fp4/row_stream.py``: a
decode step's calls of at most 16 rows on a oneDNN plan, at one thread) against oneDNN's calls.

    OMP_NUM_THREADS=1 python benchmarks/bench_transposed_copy.py                 # both parts
    OMP_NUM_THREADS=1 python benchmarks/bench_transposed_copy.py --only gemm --heights 4,8,16,64
    OMP_NUM_THREADS=1 python benchmarks/bench_transposed_copy.py --only generate --flag batched --hidden 64
    OMP_NUM_THREADS=1 python benchmarks/bench_transposed_copy.py --only generate --flag low --modes bf16 \
        --hidden 1024 --layers 2 --experts 64 --top-k 8 --ffn 384 --heads 16 --kv-heads 4 --vocab 8192
    OMP_NUM_THREADS=1 python benchmarks/bench_transposed_copy.py --only generate --flag tall \
        --hidden 1024 --layers 2 --experts 64 --top-k 8 --ffn 384 --heads 16 --kv-heads 4 --vocab 8192
    OMP_NUM_THREADS=1 python benchmarks/bench_transposed_copy.py --only generate --flag in_place \
        --hidden 1024 --layers 2 --experts 64 --top-k 8 --ffn 384 --heads 16 --kv-heads 4 --vocab 8192
    OMP_NUM_THREADS=1 python benchmarks/bench_transposed_copy.py --only generate --flag stream \
        --hidden 1024 --layers 2 --experts 64 --top-k 8 --ffn 384 --heads 16 --kv-heads 4 --vocab 8192

- gemm: one ``torch.mm`` per weight of a set of ``--mib`` MiB (cycled, so each call reads its weight
  from memory, as a decode step's layers and experts do) at each height, view vs copy, and whether
  the two give the same bits at that height;
- generate: the rollout engine's greedy generation (the rollout benchmarks' hidden-256 model, FP4
  off and fp4_resq at ``batch``) with the probed plans as they are (copy where the probe kept it)
  and with ``--flag`` (``transposed_copy``, ``batched``, ``low``, ``tall`` or ``stream``) turned off in every
  plan (``in_place``: the padded layout instead), calls alternating; the same tokens and log-prob
  bits either way (checked); with ``tall`` and ``in_place`` also the trainer's no-grad scoring of the
  generated sequences (`rollout.scoring.score`), the same log-prob bits either way (checked).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rollout import add_model_args, build, engine_for, same  # noqa: E402

from megatron_fp4.fp4 import row_calls, tiled  # noqa: E402
from megatron_fp4.rollout import SamplingParams  # noqa: E402
from megatron_fp4.rollout.scoring import score  # noqa: E402

FLAGS = {"transposed_copy": ("view", "copy"), "batched": ("per run", "batched"),
         "low": ("padded to 4", "short calls"), "tall": ("64-row calls", "tall calls"),
         "in_place": ("padded layout", "in place"),
         "stream": ("oneDNN calls", "row-streaming")}  # plan flag (in_place: tiled.IN_PLACE_ROWS): (off, on) labels
SCORED = ("tall", "in_place")  # the flags whose runs also time the trainer's scoring


def flag_off(plan: row_calls.RowPlan, flag: str) -> row_calls.RowPlan:
    """``plan`` with ``flag`` turned off (``tall``: the plan's probed heights alone; ``in_place`` is
    not the plan's: ``tiled.IN_PLACE_ROWS``, the plan as it is)."""
    if flag == "in_place":
        return plan
    if flag == "tall":
        return dataclasses.replace(plan, cap=plan.dense or plan.cap, dense=0)
    return dataclasses.replace(plan, **{flag: False})


def flagged_by(plan: row_calls.RowPlan, flag: str) -> bool:
    """Whether ``plan`` has ``flag`` on (``tall``: heights past its probed ones, ``RowPlan.dense``;
    ``in_place``: a oneDNN plan, whose grouped runs are read in place)."""
    if flag == "in_place":
        return plan.kernel == "onednn"
    return bool(plan.dense if flag == "tall" else getattr(plan, flag))


SHAPES = ((512, 256), (256, 256), (128, 256), (512, 128), (256, 128), (128, 64))  # [n, k]: out, in


def gemm_rows(heights: list, mib: float, repeats: int) -> list:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, k in SHAPES:
        count = max(4, min(64, int(mib * (1 << 20)) // (n * k * 4)))
        views = [(torch.randn(n, k, generator=gen) / k ** 0.5) for _ in range(count)]
        copies = [w.t().contiguous() for w in views]
        for h in heights:
            x = torch.randn(h, k, generator=gen)
            out = torch.empty(h, n)
            runs = {"view": lambda i: torch.mm(x, views[i].t(), out=out),
                    "copy": lambda i: torch.mm(x, copies[i], out=out)}
            best = {}
            for name, fn in runs.items():
                for i in range(count):
                    fn(i)
            for _ in range(repeats):
                for name, fn in runs.items():
                    start = time.perf_counter()
                    for i in range(count):
                        fn(i)
                    best[name] = min(best.get(name, 1e9), (time.perf_counter() - start) / count)
            bitwise = torch.equal(torch.mm(x, views[0].t()), torch.mm(x, copies[0]))
            rows.append((f"[{n}, {k}]", h, best["view"] * 1e6, best["copy"] * 1e6, bitwise))
    return rows


def generate_rows(args) -> list:
    torch.manual_seed(0)
    model = build(args, args.scope)
    prompts = torch.randint(1, args.vocab, (args.batch, args.prompt_len)).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
    rows = []
    for mode in args.modes.split(","):
        eng = engine_for(model, f"{mode}-batch")
        first = eng.generate(prompts, params)  # probes every shape: the plans as the machine gives them
        kept = dict(row_calls._PLANS)
        off, on = FLAGS[args.flag]
        plans = {on: kept, off: {k: flag_off(p, args.flag) for k, p in kept.items()}}
        parts = {"generation": lambda: eng.generate(prompts, params)}
        if args.flag in SCORED:
            responses = [list(r) for r in first.response_ids]
            parts["scoring"] = lambda: score(eng.model, prompts, responses, 0, eng.mode, invariance=eng.invariance)
            scored = parts["scoring"]()
        times: dict = {(part, name): [] for part in parts for name in plans}
        in_place = tiled.IN_PLACE_ROWS
        try:
            for i in range(args.repeats):
                for part, fn in parts.items():
                    # the order turned every round: neither side always runs first after the other part
                    for name, table in list(plans.items())[::-1 if i % 2 else 1]:
                        row_calls._PLANS.clear()
                        row_calls._PLANS.update(table)
                        tiled.IN_PLACE_ROWS = sys.maxsize if args.flag == "in_place" and name == off else in_place
                        start = time.process_time()
                        out = fn()
                        times[part, name].append(time.process_time() - start)
                        if part == "generation":
                            assert same(out, first), f"{mode}: {name} gave other tokens or log-prob bits"
                        else:
                            assert all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                                       for a, b in zip(out["log_probs"], scored["log_probs"])), f"{mode}: {name} scoring"
        finally:
            row_calls._PLANS.clear()
            row_calls._PLANS.update(kept)
            tiled.IN_PLACE_ROWS = in_place
        flagged = sorted(f"[{k[1]}, {k[0]}]" for k, p in kept.items() if flagged_by(p, args.flag))
        for part in parts:
            rows.append((mode, part, statistics.median(times[part, off]), statistics.median(times[part, on]), flagged))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--only", choices=("gemm", "generate"), default=None)
    p.add_argument("--heights", default="4,8,16,64,256")
    p.add_argument("--mib", type=float, default=16.0, help="the GEMM part's weight set (cycled)")
    p.add_argument("--modes", default="bf16,fp4_resq")
    p.add_argument("--flag", choices=tuple(FLAGS), default="transposed_copy",
                   help="the plan flag the generation part turns off (the GEMM part: transposed_copy)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"threads={torch.get_num_threads()} MKL_CBWR={os.environ.get('MKL_CBWR', '-')}")
    with torch.inference_mode():
        if args.only in (None, "gemm"):
            print("\n| weight [n, k] | rows | view µs | copy µs | copy ÷ view | same bits |")
            print("|---|---|---|---|---|---|")
            heights = [int(h) for h in args.heights.split(",")]
            for shape, h, view, copy, bitwise in gemm_rows(heights, args.mib, args.repeats):
                same_bits = "yes" if bitwise else "no"
                print(f"| {shape} | {h} | {view:.1f} | {copy:.1f} | {copy / view:.2f}× | {same_bits} |")
    if args.only in (None, "generate"):
        print(f"\nhidden {args.hidden}, {args.experts} experts top-{args.top_k}, batch {args.batch} × "
              f"{args.prompt_len}+{args.new_tokens} tokens, {args.repeats} rounds, process CPU time (medians)")
        off, on = FLAGS[args.flag]
        print(f"\n| mode (`batch`) | part | {off} ms | {on} ms | {on} ÷ {off} | weights with `{args.flag}` |\n"
              "|---|---|---|---|---|---|")
        for mode, part, t_off, t_on, shapes in generate_rows(args):
            kept = ", ".join(shapes) or "—"
            print(f"| {mode} | {part} | {t_off * 1e3:.0f} | {t_on * 1e3:.0f} | {t_on / t_off:.2f}× | {kept} |")


if __name__ == "__main__":
    main()
