"""Cost of the batch-invariant numerics mode (``fp4/invariant.py``), on vs off, side by side.

    python benchmarks/bench_batch_invariant.py                 # tiny_moe, fp4_resq
    python benchmarks/bench_batch_invariant.py --mode bf16 --set model.hidden_size=128

Measures, interleaved round-robin (off, on, off, on, ...) so machine noise hits both alike:

- rollout: ``RolloutEngine.generate`` on ``--prompts`` arithmetic prompts, ``--new-tokens`` each
  (KV-cache decode), generated tokens/s;
- scoring: ``rollout.scoring.score`` of those sequences (the trainer's no-grad log-prob pass);
- train step: ``Trainer.train_step`` with the training forward opted into the mode vs not.

Prints medians and the on/off cost ratio (> 1: the mode is slower). Never asserted in tests.
"""
from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

import torch

from megatron_fp4.config import default_config_path, load_config
from megatron_fp4.rollout import RolloutEngine, SamplingParams, score
from megatron_fp4.training.data import ArithmeticTokenizer
from megatron_fp4.training.trainer import Trainer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(default_config_path()))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--mode", default="fp4_resq", choices=("bf16", "fp4", "fp4_resq"))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=3)
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides + [f"fp4.train_mode={args.mode}", f"fp4.rollout_mode={args.mode}",
                                                     "logging.tensorboard_dir=null", "checkpoint.dir=null",
                                                     "logging.progress=false"])
    trainer = Trainer(cfg)
    tok = ArithmeticTokenizer()
    rng = random.Random(0)
    prompts = [tok.encode(f"{rng.randint(0, 999)}{rng.choice('+-*')}{rng.randint(0, 99)}=", add_eos=False)
               for _ in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=0)
    engines = {on: RolloutEngine(copy.deepcopy(trainer.model), mode=args.mode, pad_id=tok.pad_id, batch_invariant=on)
               for on in (False, True)}
    times = {(what, on): [] for what in ("rollout", "scoring", "train step") for on in (False, True)}
    generated = {}
    for i in range(args.repeats + 1):  # the first round warms up
        for on, engine in engines.items():
            start = time.perf_counter()
            out = engine.generate(prompts, params)
            if i:
                times[("rollout", on)].append(time.perf_counter() - start)
            generated[on] = out
            start = time.perf_counter()
            score(engine.model, out.prompt_ids, out.response_ids, tok.pad_id, args.mode, batch_invariant=on)
            if i:
                times[("scoring", on)].append(time.perf_counter() - start)
    for i in range(args.train_steps + 1):
        for on in (False, True):
            start = time.perf_counter()
            with trainer.model.numerics.invariant(on):
                trainer.train_step()
            if i:
                times[("train step", on)].append(time.perf_counter() - start)
    new_tokens = {on: sum(len(r) for r in generated[on].response_ids) for on in (False, True)}
    scored = {on: sum(len(p) + len(r) for p, r in zip(generated[on].prompt_ids, generated[on].response_ids))
              for on in (False, True)}
    step_tokens = cfg.schedule.global_batch_size * cfg.schedule.seq_len
    print(f"threads={torch.get_num_threads()} mode={args.mode} scope={cfg.fp4.scope} format={cfg.fp4.format} "
          f"prompts={args.prompts} new_tokens={args.new_tokens}")
    print(f"{'':<11} {'off tokens/s':>13} {'on tokens/s':>12} {'cost (on/off)':>14}")
    for what, counts in (("rollout", new_tokens), ("scoring", scored), ("train step", {False: step_tokens,
                                                                                        True: step_tokens})):
        off, on = (statistics.median(times[(what, o)]) for o in (False, True))
        print(f"{what:<11} {counts[False] / off:>13.0f} {counts[True] / on:>12.0f} {on / off:>13.2f}x")


if __name__ == "__main__":
    main()
