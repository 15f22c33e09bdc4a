"""Rollout greedy generation side by side: this engine vs HF transformers' `generate()`.

    python benchmarks/bench_rollout.py                  # hidden 256, 4 layers, 8 experts, batch 8, 32+64 tokens
    python benchmarks/bench_rollout.py --repeats 5 --engines bf16,bf16-batch,bf16-exact,fp4_resq-batch
    python benchmarks/bench_rollout.py --cache-ablation --modes fp4_resq   # weight cache on vs off
    python benchmarks/bench_rollout.py --sweep          # tokens/s and peak memory vs length / experts / batch
    OMP_NUM_THREADS=1 python benchmarks/bench_rollout.py --clock cpu --engines bf16,bf16-batch   # process CPU time

One model (fp32, FP4 scope `--scope`) is copied into one `RolloutEngine` per entry of `--engines`
(``<mode>`` = the standard kernels, ``<mode>-batch`` / ``<mode>-exact`` = that numerics level;
``batch`` is the engine's default)
and loaded into HF `Qwen3MoeForCausalLM` through the project's HF exporter (`hf_peer.py`). All get
the same prompts (one batch, no padding), greedy, exactly `--new-tokens` new tokens, KV cache (HF:
its default dynamic cache). Timed calls alternate between all of them (order reversed every
round); medians. Prints generated tokens/s, the ratio to HF, and the share of tokens equal to
HF's (FP4 off: the same function, so 100% unless fp32 rounding flips a near tie); then the time of
scoring HF's sequences (`rollout.scoring.score`, the trainer's no-grad log-prob pass) with each
engine's numerics, and last the ratios: each level's generation vs HF and vs the standard
kernels, its scoring vs standard (current numbers: docs/benchmarks.md, history: docs/changelog.md).
``--clock cpu`` times every call by this process's CPU time (``time.process_time``) instead of wall
time: HF, the engines and the scorers run in this one process, interleaved, so another job's load on a
shared machine stretches none of them and the ratios stop moving with it (run it with
``OMP_NUM_THREADS=1``: with more threads CPU time also counts the threads' spinning).

``--cache-ablation``: per FP4 mode, the weight-derived GEMM terms cached per `generate` call
(`Numerics.cached_weights`, the default) vs re-derived every decode step; outputs checked
bitwise equal.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_fp4.config import Config  # noqa: E402
from megatron_fp4.model import build_model  # noqa: E402
from megatron_fp4.rollout import RolloutEngine, SamplingParams, score  # noqa: E402
from bench_train import CLOCKS  # noqa: E402  (--clock: wall time, or this process's CPU time)
from sweep import add_sweep_args  # noqa: E402


def build(args, scope: str):
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.hidden_size, m.num_layers = args.vocab, args.hidden, args.layers
    heads = getattr(args, "heads", 4)
    m.num_experts, m.top_k, m.moe_ffn_hidden_size = args.experts, getattr(args, "top_k", 2), args.ffn
    m.num_heads, m.num_kv_heads = heads, getattr(args, "kv_heads", 2)
    m.head_dim = getattr(args, "head_dim", 0) or args.hidden // heads
    m.max_seq_len = args.prompt_len + args.new_tokens
    cfg.fp4.scope = scope
    return build_model(cfg, seed=0)


def engine_for(model, spec: str) -> RolloutEngine:
    mode, _, level = spec.partition("-")
    return RolloutEngine(copy.deepcopy(model), mode=mode, invariance=level or "standard")


def run(fn, clock=time.perf_counter):
    start = clock()
    out = fn()
    return clock() - start, out


def same(a, b) -> bool:
    return a.response_ids == b.response_ids and all(
        torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a.log_probs, b.log_probs))


def add_model_args(p):
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=0, help="0: hidden // heads")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--scope", default="experts")


def timed_rounds(runners: dict, repeats: int, clock=time.perf_counter, samples: dict = None):
    """Median seconds per runner (calls alternate, order reversed every round; round 0 warms up)
    and each runner's last output. ``clock``: wall time, or ``time.process_time`` (this process's
    CPU time: a shared machine's other load does not count). ``samples``: a dict given the seconds
    of every timed round per runner (round i of two runners ran back to back: their paired ratio)."""
    times = {k: [] for k in runners}
    outs = {}
    names = list(runners)
    for i in range(repeats + 1):
        for name in (names if i % 2 == 0 else names[::-1]):
            dt, outs[name] = run(runners[name], clock)
            if i:
                times[name].append(dt)
    if samples is not None:
        samples.update(times)
    return {k: statistics.median(v) for k, v in times.items()}, outs


def generate_and_score(model, prompts: torch.Tensor, engines: dict, new_tokens: int, repeats: int, clock,
                       samples: dict = None) -> tuple:
    """HF `generate()` on ``model``'s weights (key "HF generate") and each engine, greedy, exactly
    ``new_tokens`` new tokens, calls interleaved; then the trainer's no-grad scoring of HF's
    sequences with each engine's model at its mode and level. Returns (median generation seconds,
    last outputs, median scoring seconds), keyed as ``engines``; ``samples`` (a dict) is given every
    round's seconds under "gen" and "score" (`timed_rounds`)."""
    from hf_peer import hf_generate, hf_model_like

    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    hf = hf_model_like(model)
    runners = {"HF generate": lambda: hf_generate(hf, prompts, new_tokens)}
    for key, eng in engines.items():
        runners[key] = lambda eng=eng: eng.generate(prompts.tolist(), params)
    gen, scoring = {}, {}
    t_gen, outs = timed_rounds(runners, repeats, clock, gen)
    responses = [r.tolist() for r in outs["HF generate"]]
    scorers = {key: (lambda eng=eng: score(eng.model, prompts.tolist(), responses, 0, eng.mode,
                                           invariance=eng.invariance)) for key, eng in engines.items()}
    t_score, _ = timed_rounds(scorers, repeats, clock, scoring)
    if samples is not None:
        samples.update(gen=gen, score=scoring)
    return t_gen, outs, t_score


def compare_hf(args):
    torch.manual_seed(0)
    model = build(args, args.scope)
    prompts = torch.randint(1, args.vocab, (args.batch, args.prompt_len))
    engines = {spec: engine_for(model, spec) for spec in args.engines.split(",")}
    t_gen, outs, t_score = generate_and_score(model, prompts, engines, args.new_tokens, args.repeats,
                                              CLOCKS[args.clock])
    tokens = args.batch * args.new_tokens
    ref = outs["HF generate"].tolist()
    print(f"threads={torch.get_num_threads()} hidden={args.hidden} layers={args.layers} experts={args.experts} "
          f"top_k={args.top_k} heads={args.heads}/{args.kv_heads} ffn={args.ffn} "
          f"vocab={args.vocab} batch={args.batch} tokens={args.prompt_len}+{args.new_tokens} scope={args.scope} "
          f"repeats={args.repeats} clock={args.clock}")
    print(f"{'runner':<16} {'median s':>9} {'tokens/s':>9} {'vs HF':>7} {'tokens = HF':>12}")
    t_hf = t_gen["HF generate"]
    for name, t in t_gen.items():
        if name == "HF generate":
            agree = "-"
        else:
            hits = sum(a == b for r, h in zip(outs[name].response_ids, ref) for a, b in zip(r, h))
            agree = f"{hits / tokens:.0%}"
        print(f"{name:<16} {t:>9.3f} {tokens / t:>9.1f} {t_hf / t:>6.2f}x {agree:>12}")
    # Scoring (the trainer's no-grad log-prob pass) of HF's sequences, per engine's model and numerics.
    scored = args.batch * (args.prompt_len + args.new_tokens)
    print(f"{'scoring':<16} {'median s':>9} {'tokens/s':>9}")
    for name, t in t_score.items():
        print(f"{name:<16} {t:>9.3f} {scored / t:>9.1f}")
    print("ratios (this run; goals of issue 32 for the batch level in brackets):")
    for spec in engines:
        mode, _, level = spec.partition("-")
        if not level:
            continue
        print(f"  {mode:<9} generation, {level:<5} vs HF generate: {t_hf / t_gen[spec]:.2f}x speed  [>= 0.8x]")
        if mode in engines:
            print(f"  {mode:<9} generation, {level:<5} / standard:    {t_gen[spec] / t_gen[mode]:.2f}x time   [<= 1.3x]")
            print(f"  {mode:<9} scoring,    {level:<5} / standard:    {t_score[spec] / t_score[mode]:.2f}x time   "
                  "[<= 1.15x]")


def cache_ablation(args):
    torch.manual_seed(0)
    prompts = torch.randint(1, args.vocab, (args.batch, args.prompt_len)).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
    tokens = args.batch * args.new_tokens
    level = "standard" if args.no_batch_invariant else "batch"
    print(f"threads={torch.get_num_threads()} hidden={args.hidden} layers={args.layers} experts={args.experts} "
          f"batch={args.batch} tokens={args.prompt_len}+{args.new_tokens} invariance={level} scope={args.scope}")
    print(f"{'mode':<10} {'uncached tok/s':>15} {'cached tok/s':>13} {'speed-up':>9}")
    for mode in args.modes.split(","):
        model = build(args, args.scope)
        cached = RolloutEngine(model, mode=mode, invariance=level)
        uncached = RolloutEngine(copy.deepcopy(model), mode=mode, invariance=level, cache_quantized_weights=False)
        times = {"cached": [], "uncached": []}
        for i in range(args.repeats + 1):  # the first round is a warm-up
            outs = {}
            for name, engine in (("uncached", uncached), ("cached", cached)):
                dt, out = run(lambda: engine.generate(prompts, params), CLOCKS[args.clock])
                if i:
                    times[name].append(dt)
                outs[name] = out
            if not same(outs["cached"], outs["uncached"]):
                raise SystemExit(f"{mode}: cached and uncached generations differ")
        t_u, t_c = statistics.median(times["uncached"]), statistics.median(times["cached"])
        print(f"{mode:<10} {tokens / t_u:>15.1f} {tokens / t_c:>13.1f} {t_u / t_c:>8.2f}x")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--clock", default="wall", choices=tuple(CLOCKS),
                   help="wall: time.perf_counter; cpu: this process's CPU time (time.process_time), interleaved runs")
    p.add_argument("--engines", default="bf16,bf16-batch,bf16-exact,fp4_resq,fp4_resq-batch,fp4_resq-exact")
    p.add_argument("--cache-ablation", action="store_true")
    p.add_argument("--modes", default="fp4_resq,fp4", help="--cache-ablation: FP4 modes")
    p.add_argument("--no-batch-invariant", action="store_true", help="--cache-ablation: standard kernels")
    add_sweep_args(p)
    args = p.parse_args(argv)
    if args.point or args.sweep:
        from sweep import rollout_point, rollout_sweep
        return rollout_point(args, build, engine_for) if args.point else rollout_sweep(args)
    return cache_ablation(args) if args.cache_ablation else compare_hf(args)


if __name__ == "__main__":
    main()
