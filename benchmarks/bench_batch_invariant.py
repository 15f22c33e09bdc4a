"""Cost of the row-invariant numerics levels (``fp4/invariant.py``) vs the standard kernels, side by side.

    python benchmarks/bench_batch_invariant.py                 # tiny_moe, fp4_resq
    python benchmarks/bench_batch_invariant.py --mode bf16 --set model.hidden_size=128

Measures, interleaved round-robin (standard, batch, exact, standard, ...) so machine noise hits all alike:

- rollout: ``RolloutEngine.generate`` on ``--prompts`` arithmetic prompts, ``--new-tokens`` each
  (KV-cache decode), generated tokens/s;
- scoring: ``rollout.scoring.score`` of those sequences (the trainer's no-grad log-prob pass);
- train step: ``Trainer.train_step`` of a trainer built at each level (its training forward at it).

Prints medians and each level's time ÷ the standard kernels' (> 1: slower). Never asserted in tests.

``--expert-tiles 4,8,16,32`` instead measures the routed experts' two GEMMs alone (w13 [2F, H], w2
[H, F], FP4 off, random top-k routing of the config's shape) at a decode step (``--prompts`` tokens),
a prefill and a scoring pass (``--prompts`` × 6 and × 21 tokens): ``grouped_mm`` (the standard
kernels) against fixed row tiles of each size and the ``batch`` level's own calls (``row plan``: the
tile's bits in the heights this machine's GEMM gives them, ``fp4/row_calls.py``), time ÷ ``grouped_mm``.
``--clock cpu`` measures this process's CPU time (``time.process_time``) instead of wall time: on a
shared machine another job's load stretches wall time but not the CPU time this process spends
(run it with ``OMP_NUM_THREADS=1``: with more threads CPU time also counts the threads' spinning).
"""
from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

import torch

from megatron_fp4.config import default_config_path, load_config
from megatron_fp4.config.choices import INVARIANCE_LEVELS
from megatron_fp4.rollout import RolloutEngine, SamplingParams, score
from megatron_fp4.training.data import ArithmeticTokenizer
from megatron_fp4.training.trainer import Trainer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(default_config_path()))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--mode", default="fp4_resq", choices=("bf16", "fp4", "fp4_resq"))
    parser.add_argument("--levels", default="batch,exact", help="levels compared with the standard kernels")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=3, help="timed Trainer steps per level (0: none)")
    parser.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                        help="wall: time.perf_counter; cpu: this process's CPU time (time.process_time)")
    parser.add_argument("--expert-tiles", default="", help="e.g. 4,8,16,32: the experts' GEMMs per row tile (doc)")
    args = parser.parse_args(argv)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    if args.expert_tiles:
        cfg = load_config(args.config, args.overrides)
        return expert_tiles(cfg.model, [int(t) for t in args.expert_tiles.split(",")], args.prompts, args.repeats, clock)
    levels = ["standard"] + [lv for lv in args.levels.split(",") if lv != "standard"]
    for lv in levels:
        if lv not in INVARIANCE_LEVELS:
            parser.error(f"--levels: {lv!r} is not one of {INVARIANCE_LEVELS}")
    cfg = load_config(args.config, args.overrides + [f"fp4.train_mode={args.mode}", f"fp4.rollout_mode={args.mode}",
                                                     "logging.tensorboard_dir=null", "checkpoint.dir=null",
                                                     "logging.progress=false"])
    trainers = {}  # one per level: the level is fixed when the trainer builds its model (same seed, same data)
    for lv in levels:
        cfg_lv = copy.deepcopy(cfg)
        cfg_lv.numerics.invariance = lv
        trainers[lv] = Trainer(cfg_lv)
    trainer = trainers["standard"]
    tok = ArithmeticTokenizer()
    rng = random.Random(0)
    prompts = [tok.encode(f"{rng.randint(0, 999)}{rng.choice('+-*')}{rng.randint(0, 99)}=", add_eos=False)
               for _ in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=0)
    engines = {lv: RolloutEngine(copy.deepcopy(trainer.model), mode=args.mode, pad_id=tok.pad_id, invariance=lv)
               for lv in levels}
    times = {(what, lv): [] for what in ("rollout", "scoring", "train step") for lv in levels}
    generated = {}
    for i in range(args.repeats + 1):  # the first round warms up
        for lv, engine in engines.items():
            start = clock()
            out = engine.generate(prompts, params)
            if i:
                times[("rollout", lv)].append(clock() - start)
            generated[lv] = out
            start = clock()
            score(engine.model, out.prompt_ids, out.response_ids, tok.pad_id, args.mode, invariance=lv)
            if i:
                times[("scoring", lv)].append(clock() - start)
    for i in range(args.train_steps + 1 if args.train_steps > 0 else 0):  # 0: generation and scoring only
        for lv in levels:
            start = clock()
            trainers[lv].train_step()
            if i:
                times[("train step", lv)].append(clock() - start)
    new_tokens = {lv: sum(len(r) for r in generated[lv].response_ids) for lv in levels}
    scored = {lv: sum(len(p) + len(r) for p, r in zip(generated[lv].prompt_ids, generated[lv].response_ids))
              for lv in levels}
    step_tokens = cfg.schedule.global_batch_size * cfg.schedule.seq_len
    print(f"threads={torch.get_num_threads()} mode={args.mode} scope={cfg.fp4.scope} format={cfg.fp4.format} "
          f"prompts={args.prompts} new_tokens={args.new_tokens} clock={args.clock}")
    print(f"{'':<11} " + " ".join(f"{lv + ' tok/s':>14}" for lv in levels)
          + " ".join(f" {lv + ' / standard':>18}" for lv in levels[1:]))
    for what, counts in (("rollout", new_tokens), ("scoring", scored), ("train step", {lv: step_tokens for lv in levels})):
        if not all(times[(what, lv)] for lv in levels):
            continue  # not measured (--train-steps 0)
        med = {lv: statistics.median(times[(what, lv)]) for lv in levels}
        print(f"{what:<11} " + " ".join(f"{counts[lv] / med[lv]:>14.0f}" for lv in levels)
              + " ".join(f" {med[lv] / med['standard']:>17.2f}x" for lv in levels[1:]))


def expert_tiles(model_cfg, tiles, prompts: int, repeats: int, clock) -> None:
    """The routed experts' GEMMs, ``grouped_mm`` vs fixed row tiles of each size (``--expert-tiles``),
    vs the calls of the weights' row plans (the trainer's dense weights; where the plan is oneDNN's,
    also the rollout's packed copies)."""
    import torch.nn.functional as F

    from megatron_fp4.fp4.row_calls import RowPlan, row_plan
    from megatron_fp4.fp4.tiled import _grouped_tiles, row_tile

    E, H, Fh, k = model_cfg.num_experts, model_cfg.hidden_size, model_cfg.moe_ffn_hidden_size, model_cfg.top_k
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * Fh, H, generator=g), torch.randn(E, H, Fh, generator=g)
    print(f"threads={torch.get_num_threads()} experts={E} top_k={k} hidden={H} moe_ffn={Fh} "
          f"row_tile(w13)={row_tile(H, 2 * Fh)} row_tile(w2)={row_tile(Fh, H)} "
          f"row_plan(w13)={row_plan(H, 2 * Fh, torch.float32, 'cpu')} row_plan(w2)={row_plan(Fh, H, torch.float32, 'cpu')}")
    for what, tokens in (("decode", prompts), ("prefill", prompts * 6), ("scoring", prompts * 21)):
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).reshape(-1)
        counts = torch.bincount(ids, minlength=E).tolist()
        x1, x2 = torch.randn(sum(counts), H, generator=g), torch.randn(sum(counts), Fh, generator=g)
        offs = torch.tensor(counts).cumsum(0).to(torch.int32)
        runs = {"grouped_mm": lambda: (F.grouped_mm(x1, w13.transpose(1, 2), offs=offs),
                                       F.grouped_mm(x2, w2.transpose(1, 2), offs=offs))}
        for t in tiles:
            runs[f"tile {t}"] = (lambda p: lambda: (_grouped_tiles(x1, w13.unbind(0), counts, p),
                                                     _grouped_tiles(x2, w2.unbind(0), counts, p)))(RowPlan(t, t, t))
        runs["row plan"] = lambda: (_grouped_tiles(x1, w13.unbind(0), counts), _grouped_tiles(x2, w2.unbind(0), counts))
        if row_plan(H, 2 * Fh, torch.float32, "cpu").kernel == "onednn":  # a rollout model's form: packed weights
            packs: dict = {}  # made by the first (untimed) round, reused after: the engine's weight cache
            runs["row plan, packed"] = lambda: (_grouped_tiles(x1, w13.unbind(0), counts, packs=packs),
                                                _grouped_tiles(x2, w2.unbind(0), counts, packs=packs))
        times = {name: [] for name in runs}
        for i in range(repeats + 1):
            for name, run in runs.items():
                start = clock()
                run()
                if i:
                    times[name].append(clock() - start)
        base = statistics.median(times["grouped_mm"])
        print(f"{what:<8} {sum(counts) / E:5.1f} rows/expert  grouped_mm {base * 1e3:8.2f} ms  "
              + "  ".join(f"{name} {statistics.median(ts) / base:.2f}x" for name, ts in times.items() if name != "grouped_mm"))


if __name__ == "__main__":
    main()
