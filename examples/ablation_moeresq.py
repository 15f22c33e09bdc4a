"""The MoEResQ paper's accuracy ablation in kind: GRPO from one SFT checkpoint in four FP4 settings.

    python examples/ablation_moeresq.py --out outputs/ablation              # generated data + tokenizer
    python examples/ablation_moeresq.py --tokenizer DIR --train-data train.parquet --test-data test.parquet

Data: verl-format parquet (`RLDataset`: chat prompt rendered by the tokenizer's template), rewards
from the data_source registry (`rl.rewards`), an HF tokenizer directory (`HFTokenizer`: pad,
eos and stop ids from it). Without paths, a task and a BPE tokenizer are generated under --out
(nothing is downloaded): ``--task carry`` (default), column addition with explicit carries whose
SFT target comes from a teacher that forgets each carry with probability ``--drop-carry``
(`rl/data/carry_task.py`: the SFT policy samples the carry sometimes but greedy decoding
drops it, so GRPO has a rule to learn that carries over to held-out problems), or ``--task word``,
GSM8K-style word problems (`math_task.py`).

Per seed: SFT (response-only NLL, high precision) gives one checkpoint; then for each setting

    BF16 both sides | FP4, no compensation | rollout-only compensation (trainer fp4, rollout fp4_resq)
    | MoEResQ both sides (fp4_resq / fp4_resq)

a fresh `Trainer` (its own ``fp4.train_mode``) loads the checkpoint and a `RolloutEngine` (its own
``mode``, a bf16 copy of the model by default: the engine gap of real stacks, see
docs/consistency.md) samples, and the GRPO loop of the example (`rl.loop.run_grpo`, one call per
setting and seed) runs. Each GRPO step: sample ``group_size`` answers per prompt, score them,
group-normalise the rewards, recompute the old log-probs on the trainer, log rollout-vs-trainer
consistency (Pearson, KL, expert agreement on the sampled tokens), one clipped policy-gradient step
with truncated IS (or verl's rollout correction: ``--rollout-is``/``--rollout-rs``), and load the new weights into the engine.
Held-out greedy accuracy (test split, never an RL prompt; exact match of the final answer) is
measured before RL and every ``--eval-every`` steps. Numerics: the engine is a bf16 copy
(``--rollout-dtype``) and batch-invariant mode is off (``--batch-invariant`` turns it on), as in
real stacks. The table (mean ± std over seeds) goes to stdout and ``<out>/table.md``, the
curves to ``<out>/ablation.png``, everything to ``<out>/results.json``. docs/ablation.md has a run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_fp4.config import default_config_path, load_config  # noqa: E402
from megatron_fp4.rl import sft_step  # noqa: E402
from megatron_fp4.rl.data import carry_task, math_task  # noqa: E402
from megatron_fp4.rl.data.rl_dataset import RLDataset  # noqa: E402
from megatron_fp4.rl.loop import EngineCopyRollout, GRPOSettings, run_grpo  # noqa: E402
from megatron_fp4.rl.rollout_correction import (add_correction_args, check_correction_args,  # noqa: E402
                                                correction_from_args)
from megatron_fp4.rl.tasks import DatasetTask  # noqa: E402
from megatron_fp4.training.data.tokenizer import HFTokenizer  # noqa: E402
from megatron_fp4.training.trainer import Trainer  # noqa: E402

SETTINGS = [("BF16", "bf16", "bf16"), ("FP4, no compensation", "fp4", "fp4"),
            ("rollout-only compensation", "fp4", "fp4_resq"), ("MoEResQ both sides", "fp4_resq", "fp4_resq")]
CONSISTENCY = ("pearson", "kl", "expert_agreement", "mean_abs_diff")


def prepare_data(args):
    """(tokenizer, train RLDataset, test RLDataset): the given files, or generated under --out."""
    out = Path(args.out)
    if args.tokenizer:
        tok = HFTokenizer.from_dir(args.tokenizer)
    elif args.task == "carry":
        tok = carry_task.build_carry_tokenizer(out / "tokenizer", num_digits=args.num_digits)
    else:
        tok = math_task.build_math_tokenizer(out / "tokenizer", max_operand=args.max_operand)
    if not args.train_data:
        if args.task == "carry":
            paths = carry_task.write_carry_dataset(out / "data", args.num_train, args.num_test,
                                                   num_digits=args.num_digits)
        else:
            paths = math_task.write_math_dataset(out / "data", args.num_train, args.num_test,
                                                 max_operand=args.max_operand)
        args.train_data, args.test_data = str(paths["train"]), str(paths["test"])
    if not args.test_data:
        raise ValueError("--train-data needs --test-data (held-out prompts for the accuracy curve)")
    if tok.eos_id is None:
        raise ValueError(f"{tok.name} has no eos_token: the rollout needs it to stop (tokenizer_config.json)")
    kw = dict(max_prompt_length=args.max_prompt_length)
    return tok, RLDataset(args.train_data, tok, **kw), RLDataset(args.test_data, tok, max_samples=args.eval_size, **kw)


def make_config(args, tok, seed: int, train_mode: str, rollout_mode: str, lr: float, steps: int):
    overrides = ["logging.tensorboard_dir=null", "checkpoint.dir=null", f"schedule.seed={seed}",
                 f"model.vocab_size={tok.vocab_size}", f"model.max_seq_len={args.max_seq_len}",
                 f"fp4.scope={args.scope}", f"fp4.train_mode={train_mode}", f"fp4.rollout_mode={rollout_mode}",
                 f"optimizer.lr={lr}", f"schedule.train_steps={max(steps, 1)}"]
    cfg = load_config(args.config, overrides + list(args.override or []))
    cfg.schedule.warmup_steps = min(cfg.schedule.warmup_steps, steps)
    return cfg


def sft(args, tok, train, seed: int) -> dict:
    """The shared checkpoint: --sft-steps of response-only NLL on the teacher's solutions (high precision)."""
    cfg = make_config(args, tok, seed, "bf16", "bf16", args.sft_lr, args.sft_steps)
    cfg.optimizer.min_lr = args.sft_lr / 10
    trainer = Trainer(cfg, build_data=False)
    rng = random.Random(f"ablation-sft:{seed}")
    for _ in range(args.sft_steps):
        sft_step(trainer, train.rows, tok, args.sft_batch, args.micro_batch_size, args.drop_carry, rng)
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def settings_of(args, seed: int) -> GRPOSettings:
    """One policy step per rollout batch, no KL term; the scoring batch-invariant only with --batch-invariant."""
    return GRPOSettings(steps=args.steps, num_prompts=args.num_prompts, group_size=args.group_size,
                        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=seed,
                        micro_batch_size=args.micro_batch_size, clip_eps=args.clip_eps, tis_cap=args.tis_cap,
                        correction=correction_from_args(args), eval_every=args.eval_every,
                        batch_invariant=args.batch_invariant)


def run_setting(args, tok, train, test, sft_state, seed: int, setting) -> dict:
    name, train_mode, rollout_mode = setting
    cfg = make_config(args, tok, seed, train_mode, rollout_mode, args.lr, args.steps)
    cfg.optimizer.min_lr, cfg.optimizer.weight_decay, cfg.schedule.warmup_steps = args.lr, 0.0, 0
    cfg.model.router_aux_loss_coef = cfg.model.router_z_loss_coef = 0.0
    trainer = Trainer(cfg, build_data=False)
    trainer.model.load_state_dict(sft_state)
    dtype = torch.bfloat16 if args.rollout_dtype == "bf16" else None
    rollout = EngineCopyRollout(trainer, tok.pad_id, rollout_mode, dtype, args.batch_invariant)
    # the same prompts in every setting: RL draws from the whole train split, the eval is the test split
    task = DatasetTask(tok, train, test, range(len(test)), range(len(train)), random.Random(f"ablation-rl:{seed}"),
                       args.max_new_tokens, args.test_data)
    try:
        run = run_grpo(trainer, task, rollout, settings_of(args, seed),
                       say=lambda line, **k: print(f"    {name} seed {seed}: {line}", **k))
    finally:
        rollout.close()
    history = [{"step": h["step"], "reward": h["reward"], "loss": h["loss"],
                **{k: h[f"consistency/{k}"] for k in CONSISTENCY}} for h in run.history]
    return {"setting": name, "train_mode": train_mode, "rollout_mode": rollout_mode, "seed": seed,
            "history": history, "evals": [(s, acc) for s, acc, _ in run.evals],
            "eval_groups": [(s, groups) for s, _, groups in run.evals]}


def _mean_std(xs) -> str:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return "n/a"
    return f"{statistics.fmean(xs):.4g} ± {statistics.pstdev(xs):.2g}" if len(xs) > 1 else f"{xs[0]:.4g}"


def summarize(runs: list) -> list:
    """One row per setting: accuracy after SFT / after RL, and consistency averaged over RL steps."""
    rows = []
    for name, train_mode, rollout_mode in SETTINGS:
        mine = [r for r in runs if r["setting"] == name]
        if not mine:
            continue
        row = {"setting": name, "train": train_mode, "rollout": rollout_mode, "seeds": len(mine),
               "acc_sft": _mean_std([r["evals"][0][1] for r in mine]),
               "acc_rl": _mean_std([r["evals"][-1][1] for r in mine]),
               **{f"acc_rl_{g.replace(' ', '_')}": _mean_std([r["eval_groups"][-1][1][g] for r in mine])
                  for g in mine[0]["eval_groups"][-1][1]},
               "reward_last": _mean_std([statistics.fmean(h["reward"] for h in r["history"][-5:]) for r in mine])}
        for key in CONSISTENCY:
            row[key] = _mean_std([statistics.fmean(h[key] for h in r["history"]) for r in mine])
        rows.append(row)
    return rows


def markdown(rows: list) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows])


def plot(runs: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("held-out greedy accuracy", None), ("1 - pearson", "pearson"), ("KL(rollout || train)", "kl"),
              ("1 - expert agreement", "expert_agreement")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4))
    for color, (name, _, _) in zip(("C0", "C1", "C2", "C3"), SETTINGS):
        for k, r in enumerate(x for x in runs if x["setting"] == name):
            label = name if k == 0 else None
            steps, acc = zip(*r["evals"])
            axes[0].plot(steps, acc, "o-", color=color, ms=3, alpha=0.7, label=label)
            for ax, (_, key) in zip(axes[1:], panels[1:]):
                ys = [h[key] for h in r["history"]]
                ys = [1 - y for y in ys] if key in ("pearson", "expert_agreement") else ys
                ax.plot([h["step"] for h in r["history"]], ys, color=color, alpha=0.7, label=label)
    for ax, (title, key) in zip(axes, panels):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
        if key is not None:
            ax.set_yscale("symlog", linthresh=1e-6)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> dict:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok, train, test = prepare_data(args)
    settings = [s for s in SETTINGS if args.settings is None or s[0] in args.settings]
    runs = []
    for seed in args.seeds:
        state = sft(args, tok, train, seed)
        print(f"seed {seed}: SFT {args.sft_steps} steps done at {time.perf_counter() - start:.0f} s", flush=True)
        for setting in settings:
            r = run_setting(args, tok, train, test, state, seed, setting)
            runs.append(r)
            h = r["history"]
            print(f"  {setting[0]:<28} acc {r['evals'][0][1]:.3f} -> {r['evals'][-1][1]:.3f}  reward "
                  f"{h[0]['reward']:.3f} -> {h[-1]['reward']:.3f}  pearson {statistics.fmean(x['pearson'] for x in h):.6f}"
                  f"  kl {statistics.fmean(x['kl'] for x in h):.2e}  experts "
                  f"{statistics.fmean(x['expert_agreement'] for x in h):.4f}  ({time.perf_counter() - start:.0f} s)",
                  flush=True)
    rows = summarize(runs)
    table = markdown(rows)
    print(table)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows, "runs": runs}, indent=1))
    plot(runs, out / "ablation.png")
    print(f"{out / 'table.md'}, {out / 'ablation.png'}, {out / 'results.json'}; {time.perf_counter() - start:.0f} s")
    return {"rows": rows, "runs": runs}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(default_config_path()))
    ap.add_argument("--override", action="append", help="dotted config override, e.g. model.num_layers=2")
    ap.add_argument("--out", default="outputs/ablation")
    ap.add_argument("--tokenizer", help="HF tokenizer directory (default: a BPE trained on the generated set)")
    ap.add_argument("--train-data", help="verl-format parquet/json of RL prompts (default: generated)")
    ap.add_argument("--test-data", help="verl-format held-out prompts for the greedy accuracy")
    ap.add_argument("--task", default="carry", choices=["carry", "word"],
                    help="generated task: column addition with carries (carry_task) or word problems (math_task)")
    ap.add_argument("--num-digits", type=int, default=2, help="carry task: digits per operand")
    ap.add_argument("--drop-carry", type=float, default=0.6,
                    help="carry task: probability that the SFT teacher forgets a carry")
    ap.add_argument("--num-train", type=int, default=2000)
    ap.add_argument("--num-test", type=int, default=200)
    ap.add_argument("--max-operand", type=int, default=20, help="word task: operands 0..N")
    ap.add_argument("--eval-size", type=int, default=128)
    ap.add_argument("--max-prompt-length", type=int, default=96)
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument("--scope", default="experts+attention", help="fp4.scope: experts | experts+attention")
    ap.add_argument("--rollout-dtype", default="bf16", choices=["bf16", "fp32"],
                    help="the rollout engine's copy (bf16: the engine gap; fp32: the same numerics as the trainer)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="batch-invariant numerics in the engine and the trainer's scoring (default off, as real stacks)")
    ap.add_argument("--settings", nargs="*", help="subset of the setting names (default: all four)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--sft-steps", type=int, default=800)
    ap.add_argument("--sft-batch", type=int, default=32)
    ap.add_argument("--sft-lr", type=float, default=3e-3)
    ap.add_argument("--steps", type=int, default=20, help="GRPO steps per setting")
    ap.add_argument("--lr", type=float, default=3e-4, help="GRPO learning rate (constant)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--micro-batch-size", type=int, default=32)
    ap.add_argument("--clip-eps", type=float, default=0.2)
    ap.add_argument("--tis-cap", type=float, default=2.0, help="truncated IS cap (rollout vs trainer log-probs)")
    add_correction_args(ap)  # verl's rollout correction instead of --tis-cap
    ap.add_argument("--eval-every", type=int, default=5)
    args = ap.parse_args(argv)
    check_correction_args(ap, args)
    return args


if __name__ == "__main__":
    run(parse_args())
