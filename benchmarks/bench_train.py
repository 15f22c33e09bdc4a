"""Training-step throughput of the FP4 modes side by side: bf16 (no quantization), fp4, fp4_resq.

    python benchmarks/bench_train.py            # tiny_moe, 2 warm-up + 6 timed steps per mode
    python benchmarks/bench_train.py --steps 20 --set model.hidden_size=128

The three trainers are built from the same config and data; timed steps are interleaved round-robin
(mode A, B, C, A, B, C, ...) so machine noise hits all modes alike. Prints tokens/s and the ratio
to bf16 (higher is faster).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_fp4.config import default_config_path, load_config
from megatron_fp4.training.trainer import Trainer

MODES = ("bf16", "fp4", "fp4_resq")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(default_config_path()))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    trainers = {}
    for mode in MODES:
        cfg = load_config(args.config, args.overrides + [f"fp4.train_mode={mode}", "logging.tensorboard_dir=null",
                                                         "checkpoint.dir=null", "logging.progress=false"])
        trainers[mode] = Trainer(cfg)
    cfg = trainers["bf16"].cfg
    tokens = cfg.schedule.global_batch_size * cfg.schedule.seq_len
    times = {m: [] for m in MODES}
    for i in range(args.warmup + args.steps):
        for mode, trainer in trainers.items():
            start = time.perf_counter()
            trainer.train_step()
            if i >= args.warmup:
                times[mode].append(time.perf_counter() - start)
    print(f"threads={torch.get_num_threads()} tokens/step={tokens} scope={cfg.fp4.scope} format={cfg.fp4.format}")
    print(f"{'mode':<10} {'median s/step':>14} {'tokens/s':>10} {'vs bf16':>8}")
    base = statistics.median(times["bf16"])
    for mode in MODES:
        med = statistics.median(times[mode])
        print(f"{mode:<10} {med:>14.4f} {tokens / med:>10.0f} {base / med:>7.2f}x")


if __name__ == "__main__":
    main()
