"""How cost grows: tokens/s and peak memory vs sequence length, number of experts and batch size,
for `bench_train.py --sweep` and `bench_rollout.py --sweep`.

Every point runs in its own subprocess (`--point <json>`), so its peak resident memory is its own:
reported as the high-water mark (`VmHWM`) above the resident size once the model is built, i.e.
what the step or the generation itself allocates (activations, gradients, optimizer state, KV
cache). Rollout tokens/s counts generated tokens over the whole `generate` call (prefill
included); training tokens/s counts the step's tokens. Each point times `--sweep-repeats` calls
(default 1: a sweep is long; take the median of more on a quiet machine). A series stops at the first point that fails or runs past `--point-timeout` seconds (the
larger ones would too). Writes outputs/bench_<kind>_sweep.md (the table) and .png (the plot).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(os.path.dirname(HERE), "outputs")


def add_sweep_args(parser) -> None:
    """The `--sweep` options shared by bench_train.py and bench_rollout.py."""
    parser.add_argument("--sweep", action="store_true", help="tokens/s and peak memory vs length, experts, batch")
    parser.add_argument("--sweep-runners", help="--sweep: comma list (default bf16,fp4_resq,hf)")
    parser.add_argument("--sweep-axes", help="--sweep: e.g. 'batch=1,2,4;experts=8,64' (default: every axis)")
    parser.add_argument("--sweep-repeats", type=int, default=1, help="--sweep: timed calls per point")
    parser.add_argument("--point-timeout", type=float, default=600.0, help="--sweep: seconds per point")
    parser.add_argument("--point", help=argparse.SUPPRESS)  # one sweep point (JSON), run in a subprocess


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _emit(result: dict) -> None:
    print("POINT " + json.dumps(result), flush=True)


# -- training --------------------------------------------------------------------------------------
TRAIN_BASE = {"seq_len": 256, "experts": 8, "batch": 4}
TRAIN_AXES = {"seq_len": [128, 256, 512, 1024, 2048, 4096], "experts": [8, 32, 64, 128], "batch": [1, 2, 4, 8]}


def train_point(args, build_trainer, hf_size: list[str]) -> None:
    """One training point; bench_train.py passes its `build_trainer` and `HF_SIZE` (this module
    imports no bench_* script: they import it)."""
    pt = json.loads(args.point)
    over = hf_size + [f"schedule.seq_len={pt['seq_len']}", f"model.max_seq_len={pt['seq_len']}",
                      f"model.num_experts={pt['experts']}", f"schedule.global_batch_size={pt['batch']}",
                      f"schedule.micro_batch_size={pt['batch']}", "data.num_samples=64",
                      "data.kind=arithmetic"]
    mode = "bf16" if pt["runner"] == "hf" else pt["runner"]
    trainer = build_trainer(args, mode, over)
    if pt["runner"] == "hf":
        from hf_peer import HFTrainStep, hf_model_like
        step = HFTrainStep(hf_model_like(trainer.model), trainer.cfg.optimizer)
        del trainer.model
    else:
        step = lambda mbs: trainer.train_step_with_loss(mbs)  # noqa: E731
    mbs = trainer.next_micro_batches()
    base = _status_mib("VmRSS")
    times = []
    for i in range(1 + args.sweep_repeats):
        start = time.perf_counter()
        step(mbs)
        if i:
            times.append(time.perf_counter() - start)
    t = statistics.median(times)
    _emit({**pt, "tokens_per_s": pt["batch"] * pt["seq_len"] / t, "peak_mib": _status_mib("VmHWM") - base})


def train_sweep(args) -> None:
    runners = args.sweep_runners.split(",") if getattr(args, "sweep_runners", None) else ["bf16", "fp4_resq", "hf"]
    _sweep(args, "train", runners, TRAIN_BASE, TRAIN_AXES, os.path.join(HERE, "bench_train.py"))


# -- rollout ---------------------------------------------------------------------------------------
ROLL_BASE = {"prompt_len": 128, "experts": 8, "batch": 4}
ROLL_AXES = {"prompt_len": [128, 256, 512, 1024, 2048, 4096], "experts": [8, 32, 64, 128], "batch": [1, 2, 4, 8, 16]}


def rollout_point(args, build, engine_for) -> None:
    """One rollout point; bench_rollout.py passes its `build` and `engine_for`."""
    import copy

    pt = json.loads(args.point)
    args.experts, args.prompt_len, args.batch = pt["experts"], pt["prompt_len"], pt["batch"]
    model = build(args, args.scope)
    prompts = torch.randint(1, args.vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
    if pt["runner"] == "hf":
        from hf_peer import hf_generate, hf_model_like
        hf = hf_model_like(model)
        del model
        gen = lambda n: hf_generate(hf, prompts, n)  # noqa: E731
    else:
        from megatron_fp4.rollout import SamplingParams
        eng = engine_for(copy.deepcopy(model), pt["runner"])
        gen = lambda n: eng.generate(prompts.tolist(), SamplingParams(temperature=0.0, max_new_tokens=n))  # noqa: E731
    base = _status_mib("VmRSS")
    gen(2)  # warm-up
    times = []
    for _ in range(args.sweep_repeats):
        start = time.perf_counter()
        gen(args.new_tokens)
        times.append(time.perf_counter() - start)
    t = statistics.median(times)
    _emit({**pt, "tokens_per_s": args.batch * args.new_tokens / t, "peak_mib": _status_mib("VmHWM") - base})


def rollout_sweep(args) -> None:
    runners = args.sweep_runners.split(",") if getattr(args, "sweep_runners", None) else ["bf16", "fp4_resq", "hf"]
    _sweep(args, "rollout", runners, ROLL_BASE, ROLL_AXES, os.path.join(HERE, "bench_rollout.py"))


# -- driver ----------------------------------------------------------------------------------------
def _axes(args, default: dict) -> dict:
    if not getattr(args, "sweep_axes", None):
        return default
    axes = {}
    for part in args.sweep_axes.split(";"):
        name, _, values = part.partition("=")
        if name not in default:
            raise ValueError(f"--sweep-axes: unknown axis {name!r}; choose from {sorted(default)}")
        axes[name] = [int(v) for v in values.split(",")]
    return axes


def _sweep(args, kind: str, runners, base: dict, axes: dict, script: str) -> None:
    axes = _axes(args, axes)
    skip = {"--sweep", "--sweep-runners", "--sweep-axes"}
    passthrough, argv = [], sys.argv[1:]
    i = 0
    while i < len(argv):  # drop the sweep's own flags (and their values) from what each point gets
        a = argv[i]
        if a.split("=")[0] in skip:
            i += 1 if "=" in a or a == "--sweep" else 2
            continue
        passthrough.append(a)
        i += 1
    results = []
    for axis, values in axes.items():
        stopped = set()
        for v in values:  # runners side by side per point, so each point's ratios see one machine state
            for runner in runners:
                if runner in stopped:
                    continue
                pt = {**base, axis: v, "runner": runner, "axis": axis}
                cmd = [sys.executable, script, *passthrough, "--point", json.dumps(pt)]
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.point_timeout)
                except subprocess.TimeoutExpired:
                    print(f"{kind} {runner} {axis}={v}: over {args.point_timeout}s, series stopped", flush=True)
                    stopped.add(runner)
                    continue
                line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("POINT ")), None)
                if proc.returncode or line is None:
                    why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                    print(f"{kind} {runner} {axis}={v}: failed ({why}), series stopped", flush=True)
                    stopped.add(runner)
                    continue
                r = json.loads(line[6:])
                results.append(r)
                print(f"{kind} {runner:<10} {axis}={v:<5} {r['tokens_per_s']:>9.1f} tok/s {r['peak_mib']:>8.1f} MiB",
                      flush=True)
    _write(kind, base, axes, runners, results)


def _write(kind: str, base: dict, axes: dict, runners, results) -> None:
    os.makedirs(OUT_DIR, exist_ok=True)
    stem = os.path.join(OUT_DIR, f"bench_{kind}_sweep")
    lines = [f"# bench_{kind} sweep (threads={torch.get_num_threads()}; base point {base})", ""]
    for axis, values in axes.items():
        lines += [f"## vs {axis}", "", "| " + axis + " | " + " | ".join(f"{r} tok/s | {r} peak MiB" for r in runners)
                  + " |", "|" + "---|" * (1 + 2 * len(runners))]
        for v in values:
            cells = []
            for r in runners:
                hit = next((x for x in results if x["axis"] == axis and x["runner"] == r and x[axis] == v), None)
                cells += [f"{hit['tokens_per_s']:.1f}", f"{hit['peak_mib']:.0f}"] if hit else ["—", "—"]
            lines.append(f"| {v} | " + " | ".join(cells) + " |")
        lines.append("")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(2, len(axes), figsize=(4 * len(axes), 6.5), squeeze=False)
    for j, axis in enumerate(axes):
        for r in runners:
            pts = sorted((x[axis], x["tokens_per_s"], x["peak_mib"]) for x in results if x["axis"] == axis and x["runner"] == r)
            if pts:
                xs, tps, mem = zip(*pts)
                ax[0][j].plot(xs, tps, marker="o", label=r)
                ax[1][j].plot(xs, mem, marker="o", label=r)
        for i, ylabel in enumerate(("tokens/s", "peak MiB above model")):
            ax[i][j].set_xscale("log", base=2)
            ax[i][j].set_yscale("log")
            ax[i][j].set_xlabel(axis)
            ax[i][j].set_ylabel(ylabel)
            ax[i][j].grid(True, which="both", alpha=0.3)
        ax[0][j].legend(fontsize=8)
    fig.suptitle(f"bench_{kind} --sweep (base {base})")
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=90)
    print(f"wrote {stem}.md and {stem}.png")
