"""Packed vs padded GRPO micro-batches (``rl.max_tokens_per_micro_batch``), side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/bench_packing.py --clock cpu
    python benchmarks/bench_packing.py --rows 64 --budget 1024 --set model.hidden_size=128

An RL batch of ``--rows`` sequences at mixed lengths (prompts ``--prompt-len`` 8-64 tokens,
responses ``--response-len`` 4-128, uniform; random tokens and rollout log-probs), then, interleaved
round-robin (padded, packed, padded, ...) so machine noise hits both alike:

- scoring: `build_rl_batch` with a `PolicyScorer` (the old log-probs, routes captured), padded
  micro-batches of ``--micro-batch-size`` rows vs packed ones of at most ``--budget`` tokens;
- update: one `policy_update` (forward + backward + AdamW) in the same micro-batches.

Tokens/s count the real tokens (prompt + response) of the batch; prints the medians and packed ÷
padded throughput. Before timing it checks that both give the same numbers: the old log-probs
bitwise (the ``batch`` numerics level, the default) and the policy loss over the batch (the padded
one as one micro-batch: the token-mean over the same tokens) to float32 rounding. Never asserted in
tests. ``--clock cpu``: this process's CPU time (``time.process_time``; run with OMP_NUM_THREADS=1).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from megatron_fp4.config import default_config_path, load_config
from megatron_fp4.rl import PolicyScorer, build_rl_batch, policy_update, switch_to_rl
from megatron_fp4.rl.algo.grpo import packed_updates
from megatron_fp4.rl.algo.policy_loss import PolicyLoss
from megatron_fp4.training.trainer import Trainer


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def generation(rows: int, prompt_len: tuple, response_len: tuple, vocab: int, seed: int):
    """The `GenerationOutput` fields `build_rl_batch` reads, at uniform random lengths."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(*prompt_len))] for _ in range(rows)]
    responses = [[rng.randrange(1, vocab) for _ in range(rng.randint(*response_len))] for _ in range(rows)]
    log_probs = [-3 * torch.rand(len(r), generator=g) for r in responses]
    return type("Gen", (), {"prompt_ids": prompts, "response_ids": responses, "log_probs": log_probs,
                            "routing": None})()


def span(text: str) -> tuple:
    lo, hi = (int(v) for v in text.split("-"))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: want LO-HI with 1 <= LO <= HI")
    return lo, hi


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(default_config_path()))
    parser.add_argument("--set", action="append", default=[], dest="overrides", help="dotted config override")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-len", type=span, default=(8, 64))
    parser.add_argument("--response-len", type=span, default=(4, 128))
    parser.add_argument("--micro-batch-size", type=int, default=8, help="padded: rows per micro-batch")
    parser.add_argument("--budget", type=int, default=1024, help="packed: tokens per micro-batch")
    parser.add_argument("--clock", default="wall", choices=CLOCKS,
                        help="wall: time.perf_counter; cpu: this process's CPU time (time.process_time)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    clock = CLOCKS[args.clock]
    cfg = load_config(args.config, ["logging.tensorboard_dir=null", "checkpoint.dir=null", "logging.progress=false"]
                      + args.overrides)
    trainer = Trainer(cfg, build_data=False)
    switch_to_rl(trainer, 1e-5, 0.0, 0.0)
    gen = generation(args.rows, args.prompt_len, args.response_len, cfg.model.vocab_size, args.seed)
    rewards = torch.rand(args.rows, generator=torch.Generator().manual_seed(args.seed))
    group = 8 if args.rows % 8 == 0 else 1
    loss = PolicyLoss(0.2, 2.0)
    budgets = {"padded": 0, "packed": args.budget}
    scorers = {name: PolicyScorer(trainer, args.micro_batch_size, keep_reference=False, max_tokens=b)
               for name, b in budgets.items()}

    batches = {name: build_rl_batch(gen, rewards, group, s, 0) for name, s in scorers.items()}
    same_scores = torch.equal(batches["padded"]["old_log_probs"], batches["packed"]["old_log_probs"])
    batch = batches["padded"]
    keys = loss.batch_keys
    padded_loss = trainer.forward_backward([{k: batch[k] for k in keys}], loss, forward_only=True)[0]
    packed_loss = trainer.forward_backward(packed_updates(trainer, batch, loss, args.budget), loss,
                                           forward_only=True)[0]

    times = {(what, name): [] for what in ("scoring", "update") for name in budgets}
    for i in range(args.repeats + 1):  # the first round warms up
        for name, budget in budgets.items():
            start = clock()
            b = build_rl_batch(gen, rewards, group, scorers[name], 0)
            mid = clock()
            policy_update(trainer, b, loss, args.micro_batch_size, budget)
            end = clock()
            if i:
                times[("scoring", name)].append(mid - start)
                times[("update", name)].append(end - mid)
    tokens = sum(len(p) + len(r) for p, r in zip(gen.prompt_ids, gen.response_ids))
    width = max(len(p) for p in gen.prompt_ids) + max(len(r) for r in gen.response_ids)
    print(f"threads={torch.get_num_threads()} rows={args.rows} prompts={args.prompt_len} responses={args.response_len} "
          f"real tokens={tokens} padded slots={args.rows * width} ({tokens / (args.rows * width):.0%} real) "
          f"micro_batch_size={args.micro_batch_size} budget={args.budget} "
          f"numerics={cfg.numerics.invariance} clock={args.clock}")
    print(f"same old log-probs (bitwise): {same_scores}; policy loss padded {padded_loss:.9g} packed {packed_loss:.9g} "
          f"(|diff| {abs(padded_loss - packed_loss):.2g})")
    print(f"{'':<16} {'padded tok/s':>13} {'packed tok/s':>13} {'packed / padded':>16}")
    total = {name: 0.0 for name in budgets}
    for what in ("scoring", "update"):
        med = {name: statistics.median(times[(what, name)]) for name in budgets}
        for name in budgets:
            total[name] += med[name]
        print(f"{what:<16} {tokens / med['padded']:>13.0f} {tokens / med['packed']:>13.0f} "
              f"{med['padded'] / med['packed']:>15.2f}x")
    print(f"{'scoring+update':<16} {tokens / total['padded']:>13.0f} {tokens / total['packed']:>13.0f} "
          f"{total['padded'] / total['packed']:>15.2f}x")


if __name__ == "__main__":
    main()
