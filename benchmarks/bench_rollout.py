"""Rollout greedy-generation throughput: quantized-weight cache on vs off, side by side in one run.

    python benchmarks/bench_rollout.py                      # hidden 256, 4 layers, 8 experts, batch 8, 32+64 tokens
    python benchmarks/bench_rollout.py --modes fp4_resq --repeats 5 --no-batch-invariant

For each FP4 mode, two engines run copies of one model: the default (what GEMMs derive from a weight
alone, computed once per `generate` call, `exact_gemm.cached_weights`) and `cache_quantized_weights=False`
(re-quantized at every decode step, the behaviour before the cache). Timed calls alternate between
them so machine noise hits both alike; the outputs are checked equal token for token and log-prob
for log-prob (bitwise) before anything is printed. Prints generated tokens/s and the ratio.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from megatron_fp4.config import Config
from megatron_fp4.model import build_model
from megatron_fp4.rollout import RolloutEngine, SamplingParams


def build(args, scope: str):
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.hidden_size, m.num_layers = args.vocab, args.hidden, args.layers
    m.num_experts, m.top_k, m.moe_ffn_hidden_size = args.experts, 2, args.ffn
    m.num_heads, m.num_kv_heads, m.head_dim = 4, 2, args.hidden // 4
    m.max_seq_len = args.prompt_len + args.new_tokens
    cfg.fp4.scope = scope
    return build_model(cfg, seed=0)


def run(engine, prompts, params):
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    return time.perf_counter() - start, out


def same(a, b) -> bool:
    return a.response_ids == b.response_ids and all(
        torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a.log_probs, b.log_probs))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="fp4_resq,fp4")
    p.add_argument("--scope", default="experts")
    p.add_argument("--no-batch-invariant", action="store_true")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    prompts = torch.randint(1, args.vocab, (args.batch, args.prompt_len)).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens)
    tokens = args.batch * args.new_tokens
    bi = not args.no_batch_invariant
    print(f"threads={torch.get_num_threads()} hidden={args.hidden} layers={args.layers} experts={args.experts} "
          f"batch={args.batch} tokens={args.prompt_len}+{args.new_tokens} batch_invariant={bi} scope={args.scope}")
    print(f"{'mode':<10} {'uncached tok/s':>15} {'cached tok/s':>13} {'speed-up':>9}")
    for mode in args.modes.split(","):
        model = build(args, args.scope)
        cached = RolloutEngine(model, mode=mode, batch_invariant=bi)
        uncached = RolloutEngine(copy.deepcopy(model), mode=mode, batch_invariant=bi, cache_quantized_weights=False)
        times = {"cached": [], "uncached": []}
        for i in range(args.repeats + 1):  # the first round is a warm-up
            outs = {}
            for name, engine in (("uncached", uncached), ("cached", cached)):
                dt, out = run(engine, prompts, params)
                if i:
                    times[name].append(dt)
                outs[name] = out
            if not same(outs["cached"], outs["uncached"]):
                raise SystemExit(f"{mode}: cached and uncached generations differ")
        t_u, t_c = statistics.median(times["uncached"]), statistics.median(times["cached"])
        print(f"{mode:<10} {tokens / t_u:>15.1f} {tokens / t_c:>13.1f} {t_u / t_c:>8.2f}x")


if __name__ == "__main__":
    main()
