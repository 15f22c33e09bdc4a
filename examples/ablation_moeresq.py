"""The MoEResQ paper's accuracy ablation in kind, with router replay and TIS: GRPO from one SFT
checkpoint per seed in six FP4/replay settings, each with and without truncated IS, over >= 8 seeds.

    python examples/ablation_moeresq.py --out outputs/ablation --jobs 2     # generated data + tokenizer
    python examples/ablation_moeresq.py --tokenizer DIR --train-data train.parquet --test-data test.parquet

Data: verl-format parquet (`RLDataset`: chat prompt rendered by the tokenizer's template), rewards
from the data_source registry (`rl.tasks.rewards`), an HF tokenizer directory (`HFTokenizer`: pad,
eos and stop ids from it). Without paths, a task and a BPE tokenizer are generated under --out
(nothing is downloaded): ``--task carry`` (default), column addition with explicit carries whose
SFT target comes from a teacher that forgets each carry with probability ``--drop-carry``
(`rl/tasks/carry_task.py`: the SFT policy samples the carry sometimes but greedy decoding
drops it, so GRPO has a rule to learn that carries over to held-out problems), or ``--task word``,
GSM8K-style word problems (`math_task.py`).

Per seed: SFT (response-only NLL, high precision) gives one checkpoint (cached in
``<out>/sft/seed<N>.safetensors``); then for each setting

    BF16 both sides | FP4, no compensation | rollout-only compensation (trainer fp4, rollout fp4_resq)
    | MoEResQ both sides (fp4_resq / fp4_resq) | FP4 + R3 | MoEResQ + R3   (R3: rl.router_replay=r3)

and each TIS choice (``--tis on|off|both``; on: token TIS at ``--tis-cap`` or verl's correction of
``--rollout-is``; off: no IS weights; a variant without TIS is named "<setting>, no TIS" and can be
listed in ``--settings`` on its own) a fresh `Trainer` (its own ``fp4.train_mode``) loads the
checkpoint and a `RolloutEngine` (its own ``mode``, a bf16 copy of the model by default: the
engine gap of real stacks, docs/consistency.md) samples, and one `rl.loop.run_grpo` call runs.
Each GRPO step logs rollout-vs-trainer consistency (Pearson, KL, expert agreement on the sampled
tokens); held-out greedy accuracy (test split, never an RL prompt) is measured before RL and every
``--eval-every`` steps. Numerics: the engine is a bf16 copy (``--rollout-dtype``) and
numerics are the standard kernels (``--invariance batch|exact`` picks a row-invariant level), as in real stacks.

Every (variant, seed) writes ``<out>/runs/<variant>.seed<N>.json`` when it finishes (atomically):
a cut run resumes where it stopped, and ``--report-only`` tables whatever is there. ``--jobs N``
runs SFTs and runs in N processes; each run's numbers do not depend on that (one thread per
process, every run seeded by its seed). The table (mean ± 95 % Student-t CI over seeds, and paired
per-seed contrasts; examples/ablation_report.py) goes to stdout and ``<out>/table.md``, accuracies
per seed to ``<out>/per_seed.md``, the curves to ``<out>/{accuracy,kl,pearson,expert_agreement}.png``,
everything to ``<out>/results.json``. docs/ablation.md has a run.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ablation_report as report  # noqa: E402

from megatron_fp4.config.choices import INVARIANCE_LEVELS  # noqa: E402
from megatron_fp4.config import default_config_path, load_config  # noqa: E402
from megatron_fp4.rl import sft_step  # noqa: E402
from megatron_fp4.rl.tasks import carry_task, math_task  # noqa: E402
from megatron_fp4.rl.tasks.rl_dataset import RLDataset  # noqa: E402
from megatron_fp4.rl.flags import check_ranges  # noqa: E402
from megatron_fp4.rl.loop import EngineCopyRollout, GRPOSettings, run_grpo  # noqa: E402
from megatron_fp4.rl.algo.rollout_correction import (add_correction_args, check_correction_args,  # noqa: E402
                                                     correction_from_args)
from megatron_fp4.rl.tasks.catalog import DatasetTask  # noqa: E402
from megatron_fp4.training.data.tokenizer import HFTokenizer  # noqa: E402
from megatron_fp4.training.trainer import Trainer  # noqa: E402

# (name, trainer fp4 mode, rollout fp4 mode, rl.router_replay)
SETTINGS = [("BF16", "bf16", "bf16", "off"), ("FP4, no compensation", "fp4", "fp4", "off"),
            ("rollout-only compensation", "fp4", "fp4_resq", "off"),
            ("MoEResQ both sides", "fp4_resq", "fp4_resq", "off"),
            ("FP4 + R3", "fp4", "fp4", "r3"), ("MoEResQ + R3", "fp4_resq", "fp4_resq", "r3")]
NO_TIS = ", no TIS"
CONSISTENCY = report.CONSISTENCY
# paired contrasts reported (A - B), for the TIS variants and the no-TIS ones; plus each setting's TIS effect
CONTRASTS = [("MoEResQ both sides", "rollout-only compensation"), ("MoEResQ both sides", "FP4, no compensation"),
             ("rollout-only compensation", "FP4, no compensation"), ("FP4 + R3", "FP4, no compensation"),
             ("MoEResQ + R3", "MoEResQ both sides"), ("MoEResQ + R3", "FP4 + R3"), ("BF16", "MoEResQ both sides"),
             ("BF16", "MoEResQ + R3")]
# flags that change no number of a run (where it goes, which runs, how many processes)
NOT_IN_FINGERPRINT = ("out", "jobs", "seeds", "settings", "tis", "report_only", "run_fingerprint", "sft_fingerprint")
SFT_FLAGS = ("config", "override", "tokenizer", "train_data", "test_data", "task", "num_digits", "drop_carry",
             "num_train", "num_test", "max_operand", "max_prompt_length", "max_seq_len", "scope", "sft_steps",
             "sft_batch", "sft_lr", "micro_batch_size")


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


def make_config(args, tok, seed: int, train_mode: str, rollout_mode: str, lr: float, steps: int,
                router_replay: str | None = None):
    overrides = ["logging.tensorboard_dir=null", "checkpoint.dir=null", f"schedule.seed={seed}",
                 f"model.vocab_size={tok.vocab_size}", f"model.max_seq_len={args.max_seq_len}",
                 f"fp4.scope={args.scope}", f"fp4.train_mode={train_mode}", f"fp4.rollout_mode={rollout_mode}",
                 f"optimizer.lr={lr}", f"schedule.train_steps={max(steps, 1)}",
                 f"numerics.invariance={args.invariance}"]  # the trainer's model is built at it (scoring too)
    overrides += [f"rl.router_replay={router_replay}"] if router_replay is not None else []
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


def settings_of(args, tis: bool = True) -> GRPOSettings:
    """One policy step per rollout batch, no KL term; the scoring at --invariance, the sampling seeded by
    schedule.seed (`make_config`).
    `tis` False: no IS weights at all (neither --tis-cap nor --rollout-is/--rollout-rs)."""
    return GRPOSettings(steps=args.steps, num_prompts=args.num_prompts, group_size=args.group_size,
                        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        micro_batch_size=args.micro_batch_size, clip_eps=args.clip_eps,
                        tis_cap=args.tis_cap if tis else None, correction=correction_from_args(args) if tis else None,
                        eval_every=args.eval_every)


def _progress(name: str, seed: int, steps: int):
    """`say` for run_grpo: each line prefixed by variant and seed; step lines get this run's ETA."""
    start, done = time.perf_counter(), [0]

    def say(line: str, **kw) -> None:
        if re.match(r"\s*\d+\s+-?\d", line):  # a step row of run_grpo's table
            done[0] += 1
            rate = (time.perf_counter() - start) / done[0]
            line += f"  [{done[0]}/{steps}, {rate:.1f} s/step, ETA {rate * (steps - done[0]):.0f} s]"
        print(f"    {name} seed {seed}: {line}", **kw)
    return say


def run_setting(args, tok, train, test, sft_state, seed: int, setting, tis: bool = True) -> dict:
    name, train_mode, rollout_mode, replay = (tuple(setting) + ("off",))[:4]
    variant = name if tis else name + NO_TIS
    cfg = make_config(args, tok, seed, train_mode, rollout_mode, args.lr, args.steps, replay)
    cfg.optimizer.min_lr, cfg.optimizer.weight_decay, cfg.schedule.warmup_steps = args.lr, 0.0, 0
    cfg.model.router_aux_loss_coef = cfg.model.router_z_loss_coef = 0.0
    trainer = Trainer(cfg, build_data=False)
    trainer.model.load_state_dict(sft_state)
    dtype = torch.bfloat16 if args.rollout_dtype == "bf16" else None
    rollout = EngineCopyRollout(trainer, tok.pad_id, rollout_mode, dtype, args.invariance)
    # the same prompts in every setting: RL draws from the whole train split, the eval is the test split
    task = DatasetTask(tok, train, test, range(len(test)), range(len(train)), random.Random(f"ablation-rl:{seed}"),
                       args.max_new_tokens, args.test_data)
    try:
        run = run_grpo(trainer, task, rollout, settings_of(args, tis), say=_progress(variant, seed, args.steps))
    finally:
        rollout.close()
    history = [{"step": h["step"], "reward": h["reward"], "loss": h["loss"],
                **{k: h[f"consistency/{k}"] for k in CONSISTENCY}} for h in run.history]
    return {"variant": variant, "setting": name, "train_mode": train_mode, "rollout_mode": rollout_mode,
            "router_replay": cfg.rl.router_replay, "tis": tis, "seed": seed,
            "history": history, "evals": [(s, acc) for s, acc, _ in run.evals],
            "eval_groups": [(s, groups) for s, _, groups in run.evals]}


def variants_of(args) -> list:
    """The (setting, TIS) variants --settings and --tis select, in table order."""
    names = {s[0] for s in SETTINGS}
    wanted = args.settings if args.settings else [s[0] for s in SETTINGS]
    picked = set()
    for w in wanted:
        if w in names:
            picked |= {(w, tis) for tis in (True, False) if args.tis in ("both", "on" if tis else "off")}
        elif w.endswith(NO_TIS) and w[:-len(NO_TIS)] in names:
            picked.add((w[:-len(NO_TIS)], False))
        else:
            raise ValueError(f"--settings {w!r} is not a setting; choose from {', '.join(sorted(names))} "
                             f"(or '<setting>{NO_TIS}')")
    return [{"variant": s[0] if tis else s[0] + NO_TIS, "setting": s[0], "train_mode": s[1], "rollout_mode": s[2],
             "router_replay": s[3], "tis": tis, "spec": s}
            for tis in (True, False) for s in SETTINGS if (s[0], tis) in picked]


def sft_state_for(args, tok, train, seed: int, out: Path) -> dict:
    """The seed's SFT checkpoint: from <out>/sft/seed<N>.safetensors when it was made with these flags."""
    from safetensors.torch import load_file, save_file

    path = out / "sft" / f"seed{seed}.safetensors"
    fp = getattr(args, "sft_fingerprint", None) or json.dumps(report.fingerprint(args, SFT_FLAGS), sort_keys=True)
    if path.is_file():
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), "pt") as f:
                theirs = (f.metadata() or {}).get("fingerprint")
            state = load_file(str(path)) if theirs == fp else None
        except (SafetensorError, OSError, ValueError) as err:  # cut short, or not a safetensors file
            raise ValueError(f"{path}: not a readable SFT checkpoint ({err}); delete it to redo SFT") from None
        if theirs != fp:
            raise ValueError(f"{path} was made with other SFT flags ({theirs} vs {fp}); delete it to redo SFT")
        return state
    state = sft(args, tok, train, seed)
    report.write_atomic(path, lambda tmp: save_file({k: v.contiguous() for k, v in state.items()}, str(tmp),
                                              metadata={"fingerprint": fp}))
    return state


_WORKER = {}


def _init_worker(args) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    _WORKER.update(args=args, data=load_data(args))


def load_data(args):
    """The prepared tokenizer and splits (prepare_data has written them; nothing is regenerated)."""
    tok = HFTokenizer.from_dir(args.tokenizer)
    kw = dict(max_prompt_length=args.max_prompt_length)
    return tok, RLDataset(args.train_data, tok, **kw), RLDataset(args.test_data, tok, max_samples=args.eval_size, **kw)


def _job(job):
    """One unit of work in a worker: ('sft', seed) or ('run', seed, variant); returns (job, seconds, record)."""
    args, (tok, train, test) = _WORKER["args"], _WORKER["data"]
    out, t0 = Path(args.out), time.perf_counter()
    state = sft_state_for(args, tok, train, job[1], out)
    if job[0] == "sft":
        return job, time.perf_counter() - t0, None
    v = job[2]
    rec = run_setting(args, tok, train, test, state, job[1], v["spec"], v["tis"])
    rec["fingerprint"] = args.run_fingerprint
    report.write_atomic(report.run_path(out, v["variant"], job[1]), lambda tmp: tmp.write_text(json.dumps(rec)))
    return job, time.perf_counter() - t0, rec


def _execute(args, jobs: list, label) -> None:
    """`jobs` in order, in-process (--jobs 1) or in a pool; a progress line with the ETA after each."""
    if not jobs:
        return
    start, done = time.perf_counter(), 0
    if args.jobs > 1:
        pool = multiprocessing.get_context("spawn").Pool(args.jobs, _init_worker, (args,), maxtasksperchild=None)
        results = pool.imap_unordered(_job, jobs, chunksize=1)
    else:
        pool = None
        _init_worker(args)
        results = map(_job, jobs)
    try:
        for job, seconds, rec in results:
            done += 1
            elapsed = time.perf_counter() - start
            eta = elapsed / done * (len(jobs) - done)
            print(f"[{done}/{len(jobs)}] {label(job, rec)} ({seconds:.0f} s); elapsed {elapsed / 60:.1f} min, "
                  f"ETA {eta / 60:.1f} min", flush=True)
    except BaseException:
        if pool is not None:  # a failed or interrupted run: stop the others (finished runs are on disk)
            pool.terminate()
        raise
    if pool is not None:
        pool.close()
        pool.join()


def _done_line(job, rec) -> str:
    if rec is None:
        return f"SFT seed {job[1]} ready"
    h = rec["history"]
    return (f"{rec['variant']} seed {rec['seed']}: acc {rec['evals'][0][1]:.3f} -> {rec['evals'][-1][1]:.3f}, "
            f"kl {sum(x['kl'] for x in h) / len(h):.2e}, experts {sum(x['expert_agreement'] for x in h) / len(h):.4f}")


def run(args) -> dict:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants, fp = variants_of(args), report.fingerprint(args, exclude=NOT_IN_FINGERPRINT)
    args.run_fingerprint, args.sft_fingerprint = fp, json.dumps(report.fingerprint(args, SFT_FLAGS), sort_keys=True)
    done = lambda v, s: report.load_run(report.run_path(out, v["variant"], s), fp, v["variant"], s)  # noqa: E731
    todo = [(v, s) for s in args.seeds for v in variants if done(v, s) is None]
    if todo and not args.report_only:
        prepare_data(args)  # writes the generated tokenizer and data once; workers read them
        if not args.tokenizer:
            args.tokenizer = str(out / "tokenizer")
        need = sorted({s for _, s in todo if not (out / "sft" / f"seed{s}.safetensors").is_file()})
        print(f"{len(variants)} variants x {len(args.seeds)} seeds: {len(todo)} runs to do, "
              f"{len(need)} SFTs; --jobs {args.jobs}", flush=True)
        _execute(args, [("sft", s) for s in need], _done_line)
        _execute(args, [("run", s, v) for v, s in todo], _done_line)  # seed-major: a cut run has whole seeds
    runs = [r for s in args.seeds for v in variants if (r := done(v, s))]
    missing = len(variants) * len(args.seeds) - len(runs)
    if not runs:
        raise ValueError(f"no finished runs under {out / 'runs'} for these flags")
    rows = report.summarize(runs, variants)
    pairs = [(a + sfx, b + sfx) for sfx in ("", NO_TIS) for a, b in CONTRASTS]
    pairs += [(s[0], s[0] + NO_TIS) for s in SETTINGS]  # what TIS buys in each setting
    comps = report.contrasts(runs, pairs)
    table = report.markdown(rows, comps)
    print(table)
    (out / "table.md").write_text(table + "\n")
    (out / "per_seed.md").write_text(report.per_seed_markdown(runs, variants) + "\n")
    saved = {"args": vars(args), "rows": rows, "contrasts": comps, "missing_runs": missing,
             "runs": [{k: v for k, v in r.items() if k != "fingerprint"} for r in runs]}
    report.write_atomic(out / "results.json", lambda tmp: tmp.write_text(json.dumps(saved, indent=1)))
    pngs = report.plot(runs, variants, out)
    print(f"{out / 'table.md'}, {', '.join(str(p) for p in pngs)}, {out / 'results.json'}"
          f"{f'; {missing} runs missing' if missing else ''}; {time.perf_counter() - start:.0f} s", flush=True)
    return {"rows": rows, "runs": runs, "contrasts": comps}



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
    ap.add_argument("--invariance", choices=INVARIANCE_LEVELS, default="standard",
                    help="numerics level of the engine and the trainer's scoring (default standard, as real stacks)")
    ap.add_argument("--settings", nargs="*", help="setting names (default: all six), or '<setting>, no TIS'")
    ap.add_argument("--tis", default="both", choices=["on", "off", "both"],
                    help="the bare setting names of --settings run with TIS, without, or both")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    ap.add_argument("--jobs", type=int, default=1, help="processes for the SFTs and runs (one thread each)")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: table and plots of the finished runs under --out")
    ap.add_argument("--sft-steps", type=int, default=800)
    ap.add_argument("--sft-batch", type=int, default=32)
    ap.add_argument("--sft-lr", type=float, default=3e-3)
    ap.add_argument("--steps", type=int, default=40, help="GRPO steps per setting")
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
    check_ranges(ap, args, ints=dict(jobs=1, num_digits=1, num_train=1, num_test=1, max_operand=1, eval_size=1,
                                     max_prompt_length=1, max_seq_len=2, sft_steps=0, sft_batch=1, steps=1,
                                     num_prompts=1, group_size=1, max_new_tokens=1, micro_batch_size=1, eval_every=0),
                 positive=("sft_lr", "lr", "clip_eps", "tis_cap"), nonnegative=("temperature",),
                 fractions=("drop_carry",))
    try:
        variants_of(args)
    except ValueError as err:
        ap.error(str(err))
    return args


if __name__ == "__main__":
    try:
        run(parse_args())
    except ValueError as err:
        print(f"ablation_moeresq: {err}", file=sys.stderr)
        sys.exit(2)
