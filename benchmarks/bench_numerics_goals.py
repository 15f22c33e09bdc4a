"""The `batch` numerics level's goal table (issue 32): every ratio side by side, one command.

    OMP_NUM_THREADS=1 python benchmarks/bench_numerics_goals.py --clock cpu                 # small + realistic
    OMP_NUM_THREADS=1 python benchmarks/bench_numerics_goals.py --clock cpu --shapes small --repeats 2
    OMP_NUM_THREADS=1 python benchmarks/bench_numerics_goals.py --clock cpu --vllm-python .venv-vllm/bin/python

Per shape (``small``: hidden 256, 4 layers, 8 experts top-2, 4/2 heads of 64, vocab 2048, the
rollout benchmarks' test-size model; ``realistic``: hidden 1024, 2 layers, 64 experts top-8,
moe_ffn 384, 16/4 heads of 64, vocab 8192; ``tiny``: the embedded default's width, hidden 64), FP4 off
and fp4_resq (MoEResQ experts), in this one process:

- generation: greedy, ``--batch`` × (32 + ``--new-tokens``) tokens, HF transformers' ``generate()``
  (FP4 off: HF has no FP4) and the own engine at the standard kernels and at ``batch`` (the
  default), calls interleaved (``bench_rollout.timed_rounds``);
- scoring: the trainer's no-grad log-prob pass over those sequences, standard vs ``batch``;
- training step: ``Trainer.train_step`` of a trainer built at each level (4 × 128 tokens a step);
- parity: the ``batch`` engine's greedy tokens re-scored by the trainer's model built at ``batch``
  from the config (``numerics_from_config(cfg, "train")``), in the scoring pass (reverse order, 3
  sequences a batch) and in the training forward (autograd on, one batch): token log-probs whose
  bits differ, and routes (expert agreement).

``--vllm-python``: also the vLLM plugin's rows, in that interpreter (``bench_vllm_goals.py --only
logprob,throughput``: plugin ÷ stock vLLM tokens/s with FP4 off at ``batch`` at the realistic MoE
shape — hidden 1024, 64 experts top-8 of width 384, 2 layers; the test sizes are ``bench_vllm_goals.py``'s
default — and the plugin's log-probs vs the trainer at ``batch``).

Each ratio is the median of the rounds' paired ratios (the two runners of a round ran back to back),
its lowest and highest beside it, and a goal is judged on the median (`paired`).

``--clock cpu``: this process's CPU time (run with ``OMP_NUM_THREADS=1``: with more threads CPU time
also counts their spinning); the ratios are what to read, absolute times move with the machine.
Prints a markdown table (measure, per shape, goal); never asserted in tests.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_rollout import generate_and_score, timed_rounds  # noqa: E402
from megatron_fp4.config import Config, default_config_path, load_config  # noqa: E402
from megatron_fp4.fp4 import apply_numerics  # noqa: E402
from megatron_fp4.model import build_model  # noqa: E402
from megatron_fp4.model.specs import numerics_from_config  # noqa: E402
from megatron_fp4.rollout import RolloutEngine, SamplingParams, score  # noqa: E402
from megatron_fp4.rollout.engine import pad_prompt_response  # noqa: E402
from megatron_fp4.rollout.scoring import compute_log_probs  # noqa: E402
from megatron_fp4.training.trainer import Trainer  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=64, num_layers=4, num_experts=8, top_k=2, moe_ffn_hidden_size=256, num_heads=4,
                 num_kv_heads=2, head_dim=16, vocab_size=2048),
    "small": dict(hidden_size=256, num_layers=4, num_experts=8, top_k=2, moe_ffn_hidden_size=256, num_heads=4,
                  num_kv_heads=2, head_dim=64, vocab_size=2048),
    "realistic": dict(hidden_size=1024, num_layers=2, num_experts=64, top_k=8, moe_ffn_hidden_size=384, num_heads=16,
                      num_kv_heads=4, head_dim=64, vocab_size=8192),
}
MODES = {"FP4 off": "bf16", "fp4_resq": "fp4_resq"}
PROMPT_LEN = 32


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def config(shape: str, mode: str, level: str, seq_len: int) -> Config:
    """The shape's config, FP4 ``mode`` on both sides (MoEResQ experts), built at ``level``."""
    cfg = load_config(default_config_path(), ["logging.tensorboard_dir=null", "checkpoint.dir=null",
                                              "logging.progress=false"])
    for k, v in SHAPES[shape].items():
        setattr(cfg.model, k, v)
    cfg.model.max_seq_len = max(seq_len, 128)
    cfg.fp4.scope = "experts"
    cfg.fp4.train_mode = cfg.fp4.rollout_mode = mode
    cfg.numerics.invariance = level
    cfg.schedule.global_batch_size, cfg.schedule.micro_batch_size, cfg.schedule.seq_len = 4, 2, 128
    return cfg


def generation_and_scoring(shape: str, args, clock) -> dict:
    """Every timed round's seconds (a list, rounds in order): ``("gen", name)`` for HF and each
    engine, ``("score", name)`` per engine."""
    cfg = config(shape, "bf16", "standard", PROMPT_LEN + args.new_tokens)
    torch.manual_seed(0)
    model = build_model(cfg, seed=0)
    prompts = torch.randint(1, cfg.model.vocab_size, (args.batch, PROMPT_LEN))
    engines = {(m, lv): RolloutEngine(copy.deepcopy(model), mode=m, invariance=lv)
               for m in MODES.values() for lv in ("standard", "batch")}
    log(f"{shape}: generation (HF and {len(engines)} engines), then scoring, {args.repeats} rounds each")
    rounds = {}
    generate_and_score(model, prompts, engines, args.new_tokens, args.repeats, clock, samples=rounds)
    out = {("gen", "HF" if k == "HF generate" else k): v for k, v in rounds["gen"].items()}
    out.update({("score", k): v for k, v in rounds["score"].items()})
    return out


def training_steps(shape: str, args, clock) -> dict:
    """Every timed round's seconds of ``Trainer.train_step``: ``("train", (mode, level))``, trainers interleaved."""
    trainers = {(m, lv): Trainer(config(shape, m, lv, 128)) for m in MODES.values() for lv in ("standard", "batch")}
    log(f"{shape}: training steps, {len(trainers)} trainers, {args.train_steps} rounds")
    rounds = {}
    timed_rounds({k: tr.train_step for k, tr in trainers.items()}, args.train_steps, clock, rounds)
    return {("train", k): v for k, v in rounds.items()}


def parity(shape: str, args) -> dict:
    """Per mode: the ``batch`` engine's greedy rollout vs the trainer's model built at ``batch``
    (scoring pass and training forward): token log-probs whose bits differ, and the share of
    tokens whose routes (every MoE layer's top-k) are equal."""
    out = {}
    for mode in MODES.values():
        cfg = config(shape, mode, "batch", PROMPT_LEN + args.new_tokens)
        trainer_model = build_model(cfg, seed=0)
        apply_numerics(trainer_model, numerics_from_config(cfg, "train"))
        engine = RolloutEngine(copy.deepcopy(trainer_model), mode=mode, invariance="batch")
        g = torch.Generator().manual_seed(1)
        lens = [PROMPT_LEN - 7 * (i % 3) for i in range(args.batch)]  # ragged: left padding in the rollout's batch
        prompts = [torch.randint(1, cfg.model.vocab_size, (n,), generator=g).tolist() for n in lens]
        gen = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens),
                              return_routing=True)
        roll_lp, roll_rt = torch.cat(gen.log_probs), torch.cat(gen.routing)
        score_lp, score_rt = rescored(trainer_model, gen, mode)
        batch = pad_prompt_response(gen.prompt_ids, gen.response_ids, 0)
        with torch.enable_grad():  # the training forward: autograd's tiled functions, parameters requiring grad
            fwd = compute_log_probs(trainer_model, batch["input_ids"], batch["attention_mask"], batch["response_mask"],
                                    mode, return_routing=True, invariance="batch")
        P = batch["prompt_len"]
        train_lp = torch.cat([fwd.log_probs[i, P:P + len(r)].detach() for i, r in enumerate(gen.response_ids)])
        train_rt = torch.cat([fwd.routing[i, P:P + len(r)] for i, r in enumerate(gen.response_ids)])
        out[mode] = {"tokens": int(roll_lp.numel())}
        for side, lp, rt in (("score", score_lp, score_rt), ("train", train_lp, train_rt)):
            out[mode][side + "_bits"] = int((roll_lp.float().view(torch.int32) != lp.float().view(torch.int32)).sum())
            out[mode][side + "_experts"] = float((roll_rt == rt.to(roll_rt.dtype)).all(-1).float().mean())
    return out


def rescored(model, gen, mode: str) -> tuple:
    """(log-probs [N], routes [N, L, k]) of ``gen``'s tokens from the scoring pass: reverse request
    order, 3 sequences a batch (another batch composition and padding than the rollout's)."""
    n = len(gen.prompt_ids)
    lp, rt = [None] * n, [None] * n
    order = list(range(n))[::-1]
    for s in range(0, n, 3):
        idx = order[s:s + 3]
        got = score(model, [gen.prompt_ids[i] for i in idx], [gen.response_ids[i] for i in idx], 0, mode,
                    return_routing=True, invariance="batch")
        for j, i in enumerate(idx):
            lp[i], rt[i] = got["log_probs"][j], got["routing"][j]
    return torch.cat(lp), torch.cat(rt)


def vllm_rows(python: str, args) -> list:
    """bench_vllm_goals.py's logprob and throughput rows, run by ``python`` (the vLLM venv's)."""
    with tempfile.TemporaryDirectory(prefix="bench_numerics_goals-") as tmp:
        dest = Path(tmp) / "rows.json"
        cmd = [python, str(Path(__file__).with_name("bench_vllm_goals.py")), "--only", "logprob,throughput",
               "--clock", args.clock, "--tp-hidden", "1024", "--tp-wide", "0", "--tp-experts", "64", "--tp-top-k", "8",
               "--tp-ffn", "384", "--tp-layers", "2", "--tp-levels", "batch,standard", "--new-tokens", "32",
               "--repeats", str(args.repeats), "--json", str(dest)]
        log("vLLM: " + " ".join(cmd))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]),
                                                           os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        subprocess.run(cmd, check=True, env=env)
        return json.loads(dest.read_text())


def paired(num, den) -> tuple:
    """(median, lowest, highest) of the per-round ratios ``num[i] / den[i]`` (lists of every timed
    round's seconds; a float is one round). The runners alternate within a round, so a round's two
    calls ran back to back on the same machine state: the median of the paired ratios follows the
    machine's drifts less than a ratio of two medians, and the range shows how far a single round
    strayed (one run's median has straddled a goal run to run on a shared machine)."""
    num, den = ([v] if isinstance(v, (int, float)) else list(v) for v in (num, den))
    if len(num) != len(den) or not num:
        raise ValueError(f"paired: {len(num)} and {len(den)} rounds (the same number, at least one)")
    r = sorted(a / b for a, b in zip(num, den))
    return statistics.median(r), r[0], r[-1]


def _ratio_text(r: tuple) -> str:
    med, lo, hi = r
    return f"{med:.2f}×" if lo == hi else f"{med:.2f}× ({lo:.2f}–{hi:.2f})"


def table(shapes: list, t: dict, par: dict) -> list:
    """Rows (measure, value per shape, goal, met per shape); the standard kernels' own speed vs HF
    beside the goal rows, without a goal (HF has no FP4: fp4_resq vs HF includes MoEResQ's own work).
    ``t[shape][key]``: every timed round's seconds (or one float); a ratio is the median of the
    rounds' paired ratios, its range beside it (:func:`paired`), and a goal is judged on the median."""
    rows = []

    def add(measure, fn, goal, ok):
        vals = {s: fn(s) for s in shapes}
        rows.append((measure, {s: (_ratio_text(v) if isinstance(v, tuple) else str(v)) for s, v in vals.items()},
                     goal, {s: ("yes" if ok(v[0] if isinstance(v, tuple) else v) else "no") for s, v in vals.items()}))

    for label, m in MODES.items():
        add(f"generation, batch ÷ standard, {label}",
            lambda s: paired(t[s][("gen", (m, "batch"))], t[s][("gen", (m, "standard"))]), "≤ 1.3×", lambda v: v <= 1.3)
        add(f"generation, batch vs HF generate() (speed), {label}",
            lambda s: paired(t[s][("gen", "HF")], t[s][("gen", (m, "batch"))]), "≥ 0.8×", lambda v: v >= 0.8)
        rows.append((f"(generation, standard kernels vs HF generate(), {label})",
                     {s: _ratio_text(paired(t[s][("gen", "HF")], t[s][("gen", (m, "standard"))])) for s in shapes},
                     "—", {s: "—" for s in shapes}))
        add(f"scoring, batch ÷ standard, {label}",
            lambda s: paired(t[s][("score", (m, "batch"))], t[s][("score", (m, "standard"))]), "≤ 1.15×",
            lambda v: v <= 1.15)
        if all(("train", (m, "batch")) in t[s] for s in shapes):
            add(f"training step, batch ÷ standard, {label}",
                lambda s: paired(t[s][("train", (m, "batch"))], t[s][("train", (m, "standard"))]), "≤ 1.1×",
                lambda v: v <= 1.1)
    for label, m in MODES.items():
        add(f"rollout (own engine, batch) vs trainer scoring: log-prob bits differing / tokens, experts equal, {label}",
            lambda s: f"{par[s][m]['score_bits']} / {par[s][m]['tokens']}, {par[s][m]['score_experts']:.0%}",
            "0, 100 %", lambda v: v.startswith("0 /") and v.endswith("100%"))
        add(f"rollout (own engine, batch) vs trainer training forward: log-prob bits differing / tokens, experts "
            f"equal, {label}", lambda s: f"{par[s][m]['train_bits']} / {par[s][m]['tokens']}, "
            f"{par[s][m]['train_experts']:.0%}", "0, 100 %", lambda v: v.startswith("0 /") and v.endswith("100%"))
    return rows


def markdown(shapes: list, rows: list) -> str:
    head = "| measure | " + " | ".join(shapes) + " | goal | met? |"
    lines = [head, "|---" * (len(shapes) + 3) + "|"]
    for measure, vals, goal, met in rows:
        lines.append(f"| {measure} | " + " | ".join(vals[s] for s in shapes) + f" | {goal} | "
                     + " / ".join(met[s] for s in shapes) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="small,realistic", help=f"comma-separated subset of {','.join(SHAPES)}")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of generation and scoring (after a warm-up)")
    p.add_argument("--train-steps", type=int, default=3, help="timed training rounds (0: no training rows)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--vllm-python", help="the vLLM venv's python: add the plugin's rows (bench_vllm_goals.py)")
    args = p.parse_args(argv)
    shapes = args.shapes.split(",")
    if not shapes or any(s not in SHAPES for s in shapes):
        p.error(f"--shapes: {args.shapes!r}: choose from {', '.join(SHAPES)}")
    if args.batch < 1 or args.new_tokens < 1 or args.repeats < 1 or args.train_steps < 0:
        p.error("--batch, --new-tokens and --repeats must be >= 1, --train-steps >= 0")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    # the vLLM rows first, in their own process, while this one holds no model (six vLLM engines at
    # hidden 1024 beside this process's realistic models exceed a 24 GiB machine)
    v_rows = vllm_rows(args.vllm_python, args) if args.vllm_python else None
    times, par = {}, {}
    for s in shapes:
        t0 = time.perf_counter()
        times[s] = generation_and_scoring(s, args, clock)
        if args.train_steps:
            gc.collect()
            times[s].update(training_steps(s, args, clock))
        log(f"{s}: parity")
        par[s] = parity(s, args)
        gc.collect()  # the shape's trainers and engines (reference cycles) before the next shape's
        log(f"{s}: {time.perf_counter() - t0:.0f} s")
    print(f"threads={torch.get_num_threads()} clock={args.clock} batch={args.batch} tokens={PROMPT_LEN}+{args.new_tokens} "
          f"repeats={args.repeats} train_steps={args.train_steps}; shapes: "
          + "; ".join(f"{s} {SHAPES[s]}" for s in shapes))
    print(markdown(shapes, table(shapes, times, par)))
    if v_rows is not None:
        print("\nvLLM + the plugin (bench_vllm_goals.py):")
        print("| measure | value | goal | met? |\n|---|---|---|---|")
        for r in v_rows:
            print(f"| {r['measure']} | {r['value']} | {r['goal']} | {r['met']} |")


if __name__ == "__main__":
    main()
