"""Training-step throughput side by side: the FP4 modes, HF transformers, the bare model.

    python benchmarks/bench_train.py                     # tiny_moe: bf16 vs fp4 vs fp4_resq trainers
    python benchmarks/bench_train.py --hf                # the issue's size vs HF Qwen3MoeForCausalLM + AdamW
    python benchmarks/bench_train.py --hf --steps 8 --set model.num_experts=64
    python benchmarks/bench_train.py --sweep             # tokens/s and peak memory vs seq len / experts / batch

Default: the three trainers are built from the same config and data; timed steps are interleaved
round-robin (A, B, C, A, B, C, ...) so machine noise hits all alike. Prints tokens/s and the ratio
to bf16 (higher is faster).

``--hf`` (hidden 256, 4 layers, 8 experts top-2, vocab 2048, fp32 unless overridden): this
trainer in bf16 mode (FP4 off) and in fp4_resq; the same model as a *bare* step (model forward,
`lm_loss`, backward, clipping, `torch.optim.AdamW`: no trainer around it) in both modes; and HF
`Qwen3MoeForCausalLM` with the same weights (`hf_peer.py`, reloaded from the bf16 trainer before
every round so its experts are loaded alike) doing forward + backward + AdamW. Every round feeds
all of them the same micro-batches, in alternating order. Prints tokens/s, the ratio to
HF (FP4 off) and the trainer's overhead over the bare step of its mode. The trainer derives each
expert's Q(W) once per step (`Numerics.cached_weights`). ``--loop-experts`` adds a fp4_resq trainer running its FP4 experts as the per-expert loop
(``trainer fp4_resq/loop``: one MoEResQ call per expert, the layout before the grouped MoEResQ
backward; the same bits, so both trainers stay on the same weights). The issue's ratios (and the
grouped/loop speedup) are printed last.

``--sweep``: one subprocess per point (so each point's peak RSS is its own), the trainer in each
mode; writes outputs/bench_train_sweep.md and .png (see `sweep.py`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_fp4.config import default_config_path, load_config  # noqa: E402
from megatron_fp4.model.moe import GroupedExperts  # noqa: E402
from megatron_fp4.model.transformer import lm_loss  # noqa: E402
from megatron_fp4.training.trainer import Trainer  # noqa: E402
from sweep import add_sweep_args  # noqa: E402

MODES = ("bf16", "fp4", "fp4_resq")
HF_SIZE = ["model.vocab_size=2048", "model.hidden_size=256", "model.num_layers=4", "model.num_heads=4",
           "model.num_kv_heads=2", "model.head_dim=64", "model.num_experts=8", "model.top_k=2",
           "model.moe_ffn_hidden_size=256", "schedule.global_batch_size=8", "schedule.micro_batch_size=4",
           "schedule.seq_len=64", "data.num_samples=2000"]
QUIET = ["logging.tensorboard_dir=null", "checkpoint.dir=null", "logging.progress=false"]


def build_trainer(args, mode: str, extra=()) -> Trainer:
    return Trainer(load_config(args.config, list(extra) + args.overrides + [f"fp4.train_mode={mode}"] + QUIET))


class BareStep:
    """The model's own forward + `lm_loss` + backward + clip + `torch.optim.AdamW`, nothing else.
    It steps the trainer's own model (its own optimizer state), so both run on the same weights and
    route tokens alike: separate copies drift apart and load their experts differently.

    The fastest the model runs without the Trainer around it, so the Trainer's overhead over it is
    what the Trainer adds: torch's fused AdamW where the device has it (the Trainer's kernel too),
    `clip_grad_norm_` (foreach), and the model's own numerics step (`Numerics.training_step` with
    deferred non-finite flags, never read here, and `cached_weights` as the Trainer uses them: the
    same FP4 work). What it leaves out is the Trainer's: the flat buffers, the NaN vote and guards,
    the metrics, the lr schedule."""

    def __init__(self, trainer: Trainer):
        from megatron_fp4.parallel.zero import _fused_adamw_on

        self.model, self.trainer = trainer.model, trainer
        o = trainer.cfg.optimizer
        self.clip = o.clip_grad
        params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                     weight_decay=o.weight_decay, fused=_fused_adamw_on(params[0].device))

    def __call__(self, micro_batches) -> float:
        self.opt.zero_grad(set_to_none=True)
        total, nx = 0.0, self.model.numerics
        with nx.training_step(self.trainer.step, defer_nonfinite=True), self.trainer._weight_cache():
            for i, mb in enumerate(micro_batches):
                with nx.micro_batch(i):
                    loss = lm_loss(self.model(mb["tokens"]).logits, mb["labels"])
                (loss / len(micro_batches)).backward()
                total += loss.item() / len(micro_batches)
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        return total


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # cpu: this process's CPU time (a loaded machine)


def timed_rounds(runners: dict, batches, warmup: int, steps: int, before_round=None, clock: str = "wall",
                 before_runner=None) -> dict:
    """Median seconds per step of each runner; every round gives all runners the same batches and
    alternates the order (forward, then reversed) so slow spells of the machine hit all alike.
    `before_round` (untimed) runs first in every round, `before_runner(name)` (untimed) before each
    runner. `clock`: "wall" (time.perf_counter) or "cpu" (time.process_time: this process's CPU
    time, which other jobs on the machine do not inflate)."""
    times = {k: [] for k in runners}
    names = list(runners)
    now = CLOCKS[clock]
    for i in range(warmup + steps):
        if before_round is not None:
            before_round()
        mbs = batches()
        for name in (names if i % 2 == 0 else names[::-1]):
            if before_runner is not None:
                before_runner(name)
            start = now()
            runners[name](mbs)
            if i >= warmup:
                times[name].append(now() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def compare_modes(args):
    trainers = {mode: build_trainer(args, mode) for mode in MODES}
    cfg = trainers["bf16"].cfg
    tokens = cfg.schedule.global_batch_size * cfg.schedule.seq_len
    runners = {m: (lambda mbs, t=t: t.train_step_with_loss(mbs)) for m, t in trainers.items()}
    med = timed_rounds(runners, trainers["bf16"].next_micro_batches, args.warmup, args.steps)
    print(f"threads={torch.get_num_threads()} tokens/step={tokens} scope={cfg.fp4.scope} format={cfg.fp4.format}")
    print(f"{'mode':<10} {'median s/step':>14} {'tokens/s':>10} {'vs bf16':>8}")
    for mode in MODES:
        print(f"{mode:<10} {med[mode]:>14.4f} {tokens / med[mode]:>10.0f} {med['bf16'] / med[mode]:>7.2f}x")


def compare_hf(args):
    from hf_peer import HFTrainStep, hf_model_like

    trainers = {mode: build_trainer(args, mode, HF_SIZE) for mode in ("bf16", "fp4_resq")}
    cfg = trainers["bf16"].cfg
    runners = {"hf": HFTrainStep(hf_model_like(trainers["bf16"].model), cfg.optimizer)}
    for mode, t in trainers.items():
        runners[f"trainer {mode}"] = lambda mbs, t=t: t.train_step_with_loss(mbs)
        runners[f"bare {mode}"] = BareStep(t)
    if args.loop_experts:  # the per-expert MoEResQ loop (the layout before the grouped call)
        loop = build_trainer(args, "fp4_resq", HF_SIZE)
        for module in loop.model.modules():
            if isinstance(module, GroupedExperts):
                module.grouped = False
        runners["trainer fp4_resq/loop"] = lambda mbs: loop.train_step_with_loss(mbs)
    tokens = cfg.schedule.global_batch_size * cfg.schedule.seq_len
    # HF starts every round from the bf16 trainer's weights: the same routing, so the same expert loads
    sync = lambda: runners["hf"].load_from(trainers["bf16"].model)  # noqa: E731
    med = timed_rounds(runners, trainers["bf16"].next_micro_batches, args.warmup, args.steps, sync)
    m = cfg.model
    print(f"threads={torch.get_num_threads()} hidden={m.hidden_size} layers={m.num_layers} experts={m.num_experts} "
          f"top_k={m.top_k} vocab={m.vocab_size} tokens/step={tokens} (micro-batch {cfg.schedule.micro_batch_size} x "
          f"{cfg.schedule.seq_len}) scope={cfg.fp4.scope} steps={args.steps}")
    print(f"{'runner':<20} {'median s/step':>14} {'tokens/s':>10} {'vs HF':>7} {'overhead vs bare':>17}")
    for name, t in med.items():
        over = f"{t / med['bare ' + name.split()[1].split('/')[0]] - 1:>+16.1%}" if name.startswith("trainer") else ""
        print(f"{name:<20} {t:>14.4f} {tokens / t:>10.0f} {med['hf'] / t:>6.2f}x {over:>17}")
    print_ratios(med)
    return med


def print_ratios(med: dict) -> None:
    """The issue's goals, last: each ratio is tokens/s over HF's (or the loop's) in this one run."""
    print("ratios (higher is faster; medians of interleaved steps in this run):")
    print(f"  training step, fp4_resq experts vs HF: {med['hf'] / med['trainer fp4_resq']:.2f}x (goal >= 0.8x)")
    print(f"  training step, FP4 off vs HF:          {med['hf'] / med['trainer bf16']:.2f}x (goal >= 1.1x)")
    if "trainer fp4_resq/loop" in med:
        print(f"  fp4_resq, grouped experts vs per-expert loop: "
              f"{med['trainer fp4_resq/loop'] / med['trainer fp4_resq']:.2f}x")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(default_config_path()))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hf", action="store_true", help="compare with HF Qwen3MoeForCausalLM and the bare model")
    parser.add_argument("--loop-experts", action="store_true",
                        help="--hf: also a fp4_resq trainer running its FP4 experts as the per-expert loop")
    add_sweep_args(parser)
    args = parser.parse_args(argv)
    if args.point or args.sweep:
        from sweep import train_point, train_sweep
        return train_point(args, build_trainer, HF_SIZE) if args.point else train_sweep(args)
    return compare_hf(args) if args.hf else compare_modes(args)


if __name__ == "__main__":
    main()
