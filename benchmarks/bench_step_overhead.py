"""The Trainer step's overhead over the bare model step, and both against HF, at realistic widths.

    OMP_NUM_THREADS=1 python benchmarks/bench_step_overhead.py            # tiny + realistic shapes
    OMP_NUM_THREADS=1 python benchmarks/bench_step_overhead.py --shapes realistic,experts128
    python benchmarks/bench_step_overhead.py --quick                      # a smoke run (tests)
    python benchmarks/bench_step_overhead.py --shapes realistic --profile # cProfile of the Trainer step
    OMP_NUM_THREADS=1 python benchmarks/bench_step_overhead.py --shapes realistic --experts 8,64,128 --clock cpu

Per shape a random Qwen3-MoE checkpoint is written with transformers (``save_pretrained``, random
init, nothing downloaded) and loaded by both sides: HF's `Qwen3MoeForCausalLM.from_pretrained` +
`torch.optim.AdamW` (`hf_peer.HFTrainStep`) and the project's `Trainer` (`load_hf_shard`), FP4 off
and fp4_resq; beside each Trainer its bare model step (`bench_train.BareStep`: the same model's
forward + `lm_loss` + backward + clipping + `torch.optim.AdamW`, no trainer around it). Every round
feeds all runners the same micro-batches in alternating order (`bench_train.timed_rounds`), HF
reloaded from the FP4-off Trainer first and each Trainer and its bare step started from the same
weights (restored, untimed), so all route tokens alike and do the same work; medians of the timed
rounds.
Prints tokens/s, the ratio to HF and the Trainer's overhead over its bare step (same mode, same
micro-batches, same weights).

``--clock cpu`` times each step in this process's CPU time (``time.process_time``; with one thread
the step's compute, which other jobs on a shared machine do not inflate) instead of wall time.
``--experts 8,64,128`` adds, after the shapes, the realistic shape at each expert count (top-8): HF
and the Trainer in each mode (no bare steps: three models of 128 experts are ~15 GB), one table of
tokens/s and the ratio to HF per expert count. ``--profile`` profiles with the same clock.

Shapes (fp32): ``tiny`` hidden 256, 4 layers, 8 experts top-2, vocab 2048, micro-batch 4 x 64;
``realistic`` hidden 1024, 2 layers, 64 experts top-8, moe_ffn 384, 16/4 heads of 64, vocab 8192,
micro-batch 2 x 256; ``experts128`` the realistic shape with 128 experts. Memory: the realistic
shape with both modes and their bare steps peaks at ~14.5 GB, ``experts128`` at ~25 GB; one
``--modes`` per process, or ``--experts`` (no bare steps), needs about half.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import CLOCKS, QUIET, BareStep, timed_rounds  # noqa: E402
from megatron_fp4.config import default_config_path, load_config  # noqa: E402
from megatron_fp4.integrations.hf import hf_config_from_ours  # noqa: E402
from megatron_fp4.integrations.hf.checkpoint import load_hf_shard  # noqa: E402
from megatron_fp4.training.trainer import Trainer  # noqa: E402

REALISTIC = ["model.vocab_size=8192", "model.hidden_size=1024", "model.num_layers=2", "model.num_heads=16",
             "model.num_kv_heads=4", "model.head_dim=64", "model.num_experts=64", "model.top_k=8",
             "model.moe_ffn_hidden_size=384", "schedule.global_batch_size=2", "schedule.micro_batch_size=2",
             "schedule.seq_len=256", "model.max_seq_len=256", "data.num_samples=200"]
SHAPES = {
    "tiny": ["model.vocab_size=2048", "model.hidden_size=256", "model.num_layers=4", "model.num_heads=4",
             "model.num_kv_heads=2", "model.head_dim=64", "model.num_experts=8", "model.top_k=2",
             "model.moe_ffn_hidden_size=256", "schedule.global_batch_size=4", "schedule.micro_batch_size=4",
             "schedule.seq_len=64", "data.num_samples=200"],
    "realistic": REALISTIC,
    "experts128": REALISTIC + ["model.num_experts=128"],
    # --quick: the code path of the others at toy size, for tests
    "quick": ["model.vocab_size=256", "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4",
              "model.num_kv_heads=2", "model.head_dim=16", "model.num_experts=4", "model.top_k=2",
              "model.moe_ffn_hidden_size=64", "schedule.global_batch_size=2", "schedule.micro_batch_size=2",
              "schedule.seq_len=16", "data.num_samples=50"],
}
MODES = {"off": "bf16", "fp4_resq": "fp4_resq"}  # fp4.train_mode "bf16" is FP4 off (fp32 here: dtype)


def write_random_hf_checkpoint(model_cfg, out_dir: str, seed: int) -> None:
    """A Qwen3-MoE checkpoint of our model's shape with transformers' own random init."""
    import transformers

    torch.manual_seed(seed)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**hf_config_from_ours(model_cfg)))
    hf.save_pretrained(out_dir)


def build_runners(args, overrides: list[str], ckpt_dir: str, bare: bool = True) -> tuple[dict, dict]:
    """{name: step(micro_batches)} and the trainers, every model holding the checkpoint's weights;
    `bare`: with each Trainer's bare model step."""
    import transformers
    from hf_peer import HFTrainStep

    trainers = {}
    for name in args.modes:
        t = Trainer(load_config(args.config, overrides + args.overrides + [f"fp4.train_mode={MODES[name]}"] + QUIET))
        load_hf_shard(t.model, ckpt_dir)  # in place: the params stay views of the optimizer's flat buffers
        trainers[name] = t
    first = trainers[args.modes[0]]
    if args.profile:
        return {}, trainers
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32)
    runners = {"hf": HFTrainStep(hf, first.cfg.optimizer)}
    for name, t in trainers.items():
        runners[f"trainer {name}"] = lambda mbs, t=t: t.train_step_with_loss(mbs)
        if bare:
            runners[f"bare {name}"] = BareStep(t)
    return runners, trainers


def measure(args, overrides: list[str], bare: bool = True) -> tuple[dict, object]:
    """Median step times of every runner at `overrides` (see `timed_rounds`) and the first Trainer's
    config; with `--profile`, the profile instead ({}). The models are freed on return."""
    with tempfile.TemporaryDirectory(prefix="bench_step_overhead_") as ckpt_dir:
        probe = load_config(args.config, overrides + args.overrides + QUIET)
        write_random_hf_checkpoint(probe.model, ckpt_dir, probe.schedule.seed)
        runners, trainers = build_runners(args, overrides, ckpt_dir, bare)
    first = trainers[args.modes[0]]
    if args.profile:
        return profile_trainer(args, first), (first.cfg, 0)
    snapshots = {}

    def sync():  # every runner of a round starts from the same weights: the same routing, the same work
        runners["hf"].load_from(first.model)
        if bare:  # a Trainer and its bare step share a model: each starts from the round's weights
            for mode, t in trainers.items():
                snapshots[mode] = [p.detach().clone() for p in t.model.parameters()]

    def restore(name):
        mode = name.split()[-1]
        if name != "hf" and mode in snapshots:
            with torch.no_grad():
                for p, saved in zip(trainers[mode].model.parameters(), snapshots[mode]):
                    p.copy_(saved)

    med = timed_rounds(runners, first.next_micro_batches, args.warmup, args.steps, sync, clock=args.clock,
                       before_runner=restore)
    params = sum(p.numel() for p in first.model.parameters())
    cfg = first.cfg
    del runners, trainers, first, sync, restore, snapshots
    gc.collect()  # the next shape's models: a Trainer's hooks hold cycles
    return med, (cfg, params)


def run_shape(args, shape: str) -> dict:
    med, (cfg, params) = measure(args, SHAPES[shape])
    if args.profile:
        return med
    m, s = cfg.model, cfg.schedule
    tokens = s.global_batch_size * s.seq_len
    print(f"\n[{shape}] threads={torch.get_num_threads()} hidden={m.hidden_size} layers={m.num_layers} "
          f"experts={m.num_experts} top_k={m.top_k} vocab={m.vocab_size} params={params / 1e6:.1f}M "
          f"tokens/step={tokens} (micro-batch {s.micro_batch_size} x {s.seq_len}) steps={args.steps} "
          f"clock={args.clock}")
    print(f"{'runner':<18} {'median s/step':>14} {'tokens/s':>10} {'vs HF':>7} {'trainer / bare':>15}")
    for name, t in med.items():
        over = f"{t / med['bare ' + name.split()[1]] - 1:>+14.1%}" if name.startswith("trainer") else ""
        print(f"{name:<18} {t:>14.4f} {tokens / t:>10.0f} {med['hf'] / t:>6.2f}x {over:>15}")
    return med


def run_experts(args, counts: list[int]) -> dict:
    """The realistic shape (`--quick`: the quick one) at each expert count, top-8 (top-k capped at
    the count): HF and the Trainers, a table of tokens/s and ratios to HF, each row printed as soon
    as it is measured."""
    base = SHAPES["quick" if args.quick else "realistic"]
    modes = [f"trainer {mode}" for mode in args.modes]
    results = {}
    for n in counts:
        med, (cfg, _) = measure(args, base + [f"model.num_experts={n}", f"model.top_k={min(8, n)}"], bare=False)
        m, s = cfg.model, cfg.schedule
        tokens = s.global_batch_size * s.seq_len
        results[n] = tps = {name: tokens / t for name, t in med.items()}
        if len(results) == 1:
            print(f"\n[experts] hidden={m.hidden_size} layers={m.num_layers} moe_ffn={m.moe_ffn_hidden_size} "
                  f"vocab={m.vocab_size} top_k=min(8, experts) tokens/step={tokens} steps={args.steps} "
                  f"clock={args.clock}: tokens/s (vs HF)")
            print(f"{'experts':>7} {'hf':>8} " + " ".join(f"{name:>22}" for name in modes))
        cells = " ".join(f"{tps[name]:>14.0f} ({tps[name] / tps['hf']:.2f}x)" for name in modes)
        print(f"{n:>7} {tps['hf']:>8.0f} {cells}", flush=True)
    return results


def profile_trainer(args, trainer) -> dict:
    """cProfile of `--steps` Trainer steps after `--warmup` (the top of the own-time list), timed by `--clock`."""
    for _ in range(args.warmup):
        trainer.train_step_with_loss(trainer.next_micro_batches())
    prof = cProfile.Profile(CLOCKS[args.clock])
    batches = [trainer.next_micro_batches() for _ in range(args.steps)]
    prof.enable()
    for mbs in batches:
        trainer.train_step_with_loss(mbs)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return {}


def print_summary(results: dict, experts: dict) -> None:
    """The issue's ratios, last (higher is faster; medians of interleaved steps in this run)."""
    print("\nratios (medians of interleaved steps in this run):")
    for n, tps in experts.items():
        for name in (k for k in tps if k.startswith("trainer")):
            print(f"  [{n} experts] tokens/s, {name} vs HF: {tps[name] / tps['hf']:.2f}x"
                  + (" (goal >= 1.0x)" if name == "trainer off" else ""))
    for shape, med in results.items():
        for mode in ("off", "fp4_resq"):
            if f"trainer {mode}" in med:
                print(f"  [{shape}] Trainer step / bare model step, {mode}: "
                      f"{med[f'trainer {mode}'] / med[f'bare {mode}'] - 1:+.1%} (goal <= +5%)")
                goal = "1.4x" if mode == "off" else "1.0x"
                print(f"  [{shape}] Trainer step {mode} vs HF: {med['hf'] / med[f'trainer {mode}']:.2f}x "
                      f"(goal >= {goal} at the realistic shape); bare {mode} vs HF: "
                      f"{med['hf'] / med[f'bare {mode}']:.2f}x")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(default_config_path()))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--shapes", default="tiny,realistic", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--modes", default="off,fp4_resq", help="comma-separated Trainer modes: off, fp4_resq")
    parser.add_argument("--steps", type=int, default=3, help="timed rounds per shape (median)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="the quick shape, one warm-up and one timed round")
    parser.add_argument("--profile", action="store_true", help="cProfile the first mode's Trainer step instead")
    parser.add_argument("--clock", default="wall", choices=tuple(CLOCKS),
                        help="wall time, or this process's CPU time (cpu: for a machine other jobs load)")
    parser.add_argument("--experts", default="",
                        help="comma-separated expert counts (e.g. 8,64,128): the realistic shape at each, top-8, "
                             "tokens/s vs HF; --shapes '' runs only these")
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes, args.steps, args.warmup = "quick", 1, 1
    shapes, args.modes = [s for s in args.shapes.split(",") if s], args.modes.split(",")
    bad = [s for s in shapes if s not in SHAPES] + [m for m in args.modes if m not in MODES]
    try:
        counts = [int(n) for n in args.experts.split(",") if n]
    except ValueError:
        counts = [0]
    if bad or args.steps < 1 or args.warmup < 0 or any(n < 1 for n in counts):
        parser.error(f"unknown shape/mode {bad} (shapes: {', '.join(SHAPES)}; modes: {', '.join(MODES)}), "
                     f"--steps < 1 / --warmup < 0, or --experts={args.experts!r} not positive integers")
    if args.profile and counts:
        parser.error("--profile profiles the --shapes; leave out --experts")
    results = {shape: run_shape(args, shape) for shape in shapes}
    experts = run_experts(args, counts) if counts else {}
    if not args.profile:
        print_summary(results, experts)
    if counts:
        results["experts"] = experts
    return results


if __name__ == "__main__":
    main()
