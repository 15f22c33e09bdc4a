"""Rollout-vs-training consistency ablation (the MoEResQ paper's table, on our tiny model).

    python tools/consistency_report.py --out outputs/consistency            # main-job LM training first
    python tools/consistency_report.py --checkpoint outputs/tiny_moe/checkpoints/step_00000300 --out ...

For each FP4 scope (experts, experts+attention) and each (train_mode, rollout_mode) setting:

    bf16/bf16 | fp4/fp4 (no compensation) | fp4/fp4_resq (rollout-only) | fp4_resq/fp4_resq (MoEResQ)

the rollout side generates answers to arithmetic prompts with KV-cache decoding, batched one way;
the training side re-scores the rollout's own tokens with one full-sequence forward, batched
another way (reversed order, smaller micro-batches, so other padding). Same weights on both sides.

The engine gap. Run on identical code the two sides differ only by fp32 summation order (~1e-7),
which is not what RL sees: the rollout is another engine (vLLM/SGLang: bf16 activations, other
kernels) than the trainer. The rollout side here therefore models that engine:

- ``--rollout-dtype bf16`` (default): the rollout engine runs a bf16 copy of the model
  (`RolloutEngine(dtype=torch.bfloat16)`: weights, activations, KV cache and logits in bf16; the
  router weight stays fp32 and the router computes in fp32, as on the trainer). The trainer stays
  fp32. This is a real mechanism of the engine gap, of realistic size (bf16 rounding, 2^-9 relative).
- ``--bf16-weights``: round the weights to bf16 on both sides first, as when both engines load one
  bf16 checkpoint: their FP4 weight codes then agree and the gap is in the activations only. By
  default the trainer keeps its fp32 weights and only the rollout copy is rounded (this project's
  weight sync), so some FP4 *weight* codes differ too, which no activation compensation can undo.
- ``--engine-noise EPS``: additionally add Gaussian noise of relative size EPS (per token,
  EPS · rms(h) · N(0, 1) per element) to the rollout's hidden state at every decoder-layer input.
  A *synthetic* stand-in for kernel differences (accumulation order, fused ops), to dial the gap.

``--rollout vllm`` replaces the modelled engine by vLLM itself: vLLM + the `megatron_fp4` plugin
generates on an `export_for_vllm` directory of the same fp32 weights per (scope, setting), with the
routed experts from the plugin (`integrations/vllm/worker.py`; in its own process with
``--vllm-python`` / env MEGATRON_FP4_VLLM_PYTHON, else in this one), and the trainer re-scores as
below (one table; docs/vllm.md).

The report always also runs the no-gap table (fp32 on both sides, no noise) unless
``--no-baseline``. It prints the tables, a routing-sharpness line (how close the router's k-th
and (k+1)-th experts are: the margin a tiny input difference must cross to flip an expert), and
writes table.md, results.json and consistency.png under --out.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_fp4.config import default_config_path, load_config  # noqa: E402
from megatron_fp4.fp4 import Numerics, apply_numerics  # noqa: E402
from megatron_fp4.model import Router, build_model  # noqa: E402
from megatron_fp4.model.specs import numerics_from_config  # noqa: E402
from megatron_fp4.rollout import RolloutEngine, SamplingParams  # noqa: E402
from megatron_fp4.rollout.consistency import add_engine_noise, kl_bootstrap, rescore, router_margins  # noqa: E402
from megatron_fp4.training.data import ArithmeticTokenizer, make_problem  # noqa: E402

SETTINGS = [("BF16 both", "bf16", "bf16"), ("FP4 both, no compensation", "fp4", "fp4"),
            ("FP4, rollout-only compensation", "fp4", "fp4_resq"), ("MoEResQ (both compensated)", "fp4_resq", "fp4_resq")]
SCOPES = ["experts", "experts+attention"]
COLUMNS = ["pearson", "mean_abs_diff", "max_abs_diff", "expert_agreement", "kl"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Gap:
    """What separates the rollout engine from the trainer (the trainer is always fp32)."""

    rollout_dtype: str = "bf16"
    noise: float = 0.0
    bf16_weights: bool = False  # both sides start from bf16-rounded weights (same FP4 weight codes)
    invariance: str = "batch"  # the numerics level of both sides (fp4/invariant.py)

    @property
    def label(self) -> str:
        weights = "; bf16 weights on both sides" if self.bf16_weights else ""
        kernels = "" if self.invariance != "standard" else "; standard kernels (no row-invariant level)"
        if self.rollout_dtype == "fp32" and self.noise == 0:
            return f"no engine gap (fp32 rollout, fp32 trainer{weights}{kernels})"
        noise = f" + hidden-state noise {self.noise:g}" if self.noise else ""
        return f"{self.rollout_dtype} rollout{noise}, fp32 trainer{weights}{kernels}"


NO_GAP = Gap("fp32", 0.0)


def base_config(args):
    path = args.config or default_config_path()
    overrides = ["logging.tensorboard_dir=null", "checkpoint.dir=null"] + list(args.override or [])
    return load_config(path, overrides) if path else load_config(None, overrides)


def trained_weights(cfg, args) -> dict:
    """Weights to compare with: a checkpoint, the main job's LM training run in-process with the
    Trainer (same config, same seed), or the init."""
    steps = cfg.schedule.train_steps if args.train_steps is None else args.train_steps
    if args.checkpoint or steps > 0:
        from megatron_fp4.training.trainer import Trainer
        trainer = Trainer(cfg, build_data=args.checkpoint is None)
        if args.checkpoint:
            trainer.load_checkpoint(args.checkpoint)
        for step in range(0 if args.checkpoint else steps):
            out = trainer.train_step()
            if step % 50 == 0 or step == steps - 1:
                print(f"LM training step {step}: loss {out['loss']:.3f}", file=sys.stderr)
        return {k: v.detach().float().clone() for k, v in trainer.model.state_dict().items()}
    return build_model(cfg).state_dict()


def prompts(n: int, seed: int, tok) -> list:
    rng = random.Random(f"consistency:{seed}")
    return [tok.encode(make_problem(rng)[0], add_eos=False) for _ in range(n)]


def measure(cfg, weights, scope, train_mode, rollout_mode, tok, gap: Gap = NO_GAP, num_prompts: int = 64,
            max_new_tokens: int = 8, rollout_batch: int = 16, train_batch: int = 6, seed: int = 0) -> dict:
    """Rollout (engine with `gap`) generates, the fp32 trainer re-scores; metrics over all tokens."""
    cfg = copy.deepcopy(cfg)
    cfg.fp4.scope = scope
    cfg.numerics.invariance = gap.invariance  # the trainer's model re-scores at the rollout's level, fixed at build
    train_model = build_model(cfg)
    apply_numerics(train_model, numerics_from_config(cfg, "train"))
    if train_model.fp4_mode is not None:
        train_model.set_fp4_mode(train_mode)  # its training-side mode, at build (rescore checks it)
    if gap.bf16_weights:
        weights = {k: v.to(torch.bfloat16).to(v.dtype) if v.is_floating_point() else v for k, v in weights.items()}
    train_model.load_state_dict(weights)
    dtype = DTYPES[gap.rollout_dtype]
    engine = RolloutEngine(copy.deepcopy(train_model), mode=rollout_mode, pad_id=tok.pad_id,
                           dtype=None if dtype == torch.float32 else dtype, invariance=gap.invariance)
    hooks = add_engine_noise(engine.model, gap.noise, seed) if gap.noise else []
    ps = prompts(num_prompts, seed, tok)
    params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed * 100_003 + i,
                             stop_token_ids=(tok.eos_id,)) for i in range(len(ps))]
    gens = []  # rollout: batches of `rollout_batch` in prompt order
    for s in range(0, len(ps), rollout_batch):
        gens.append(engine.generate(ps[s:s + rollout_batch], params[s:s + rollout_batch],
                                    return_routing=True, return_distributions=True))
    for h in hooks:
        h.remove()
    flat = {k: [x for g in gens for x in getattr(g, k)] for k in
            ("prompt_ids", "response_ids", "log_probs", "routing", "distributions")}
    return rescore(train_model, flat, tok.pad_id, train_mode, gap.invariance, train_batch, reverse=True)


def ablation(cfg, weights, tok, gap: Gap = NO_GAP, scopes=SCOPES, settings=SETTINGS, **kwargs) -> list:
    """One table: a row per (scope, setting) under `gap`. kwargs go to `measure`."""
    rows = []
    for scope in scopes:
        for name, train_mode, rollout_mode in settings:
            m = measure(cfg, weights, scope, train_mode, rollout_mode, tok, gap, **kwargs)
            rows.append({"gap": gap.label, "rollout_dtype": gap.rollout_dtype, "engine_noise": gap.noise,
                         "bf16_weights": gap.bf16_weights, "invariance": gap.invariance,
                         "scope": scope, "setting": name, "train_mode": train_mode, "rollout_mode": rollout_mode, **m})
    return rows


VLLM_GAP = "vLLM rollout (fp32, megatron_fp4 plugin), fp32 trainer"


def vllm_ablation(cfg, weights, tok, work_dir, python=None, scopes=SCOPES, settings=SETTINGS, num_prompts: int = 64,
                  max_new_tokens: int = 8, train_batch: int = 6, seed: int = 0) -> list:
    """The table with vLLM + the plugin as the rollout side: each (scope, setting) exported by
    `export_for_vllm` (fp32 weights, its quantization_config carrying the rollout recipe), all served
    by one vLLM worker (`integrations/vllm/worker.py`, own process when `python` is given), the same
    prompts and seeds; the fp32 trainer (batch-invariant scoring) re-scores as in `measure`
    (`rollout.consistency.rescore`: reversed order, other padding)."""
    from megatron_fp4.integrations.vllm import export_for_vllm
    from megatron_fp4.integrations.vllm.remote import run_vllm_rollout

    work_dir = Path(work_dir)
    ps = prompts(num_prompts, seed, tok)
    models, jobs = {}, []
    for scope in scopes:
        for name, train_mode, rollout_mode in settings:
            c = copy.deepcopy(cfg)
            c.fp4.scope, c.fp4.train_mode, c.fp4.rollout_mode = scope, train_mode, rollout_mode
            c.numerics.invariance = "batch"
            model = build_model(c)
            model.load_state_dict(weights)
            apply_numerics(model, Numerics(invariance=c.numerics.invariance))  # at the level the plugin serves (built so)
            key = f"{scope}/{name}"
            out = export_for_vllm(model, c, work_dir / f"hf_{len(jobs)}", dtype=None, overwrite=True)
            models[key] = model
            jobs.append({"name": key, "model": str(out)})
    spec = {"jobs": jobs, "prompts": ps, "max_tokens": max_new_tokens, "temperature": 1.0,
            "seeds": [seed * 100_003 + i for i in range(len(ps))], "stop_token_ids": [tok.eos_id],
            "dtype": "float32", "routing": True, "distributions": True}
    gens = run_vllm_rollout(spec, work_dir, python=python)
    rows = []
    for scope in scopes:
        for name, train_mode, rollout_mode in settings:
            key = f"{scope}/{name}"
            g = gens[key]
            flat = {"prompt_ids": ps, "response_ids": g["tokens"], "log_probs": g["logprobs"],
                    "routing": g["routing"], "distributions": g["dist"]}
            m = rescore(models[key], flat, tok.pad_id, train_mode, "batch", train_batch, reverse=True)
            rows.append({"gap": VLLM_GAP, "rollout": "vllm", "rollout_dtype": "fp32", "engine_noise": 0.0,
                         "bf16_weights": False, "invariance": "batch", "scope": scope, "setting": name,
                         "train_mode": train_mode, "rollout_mode": rollout_mode, **m})
    return rows


def routing_sharpness(cfg, weights, tok, num: int = 64, seed: int = 0) -> dict:
    """Router statistics (`rollout.consistency.router_margins`: entropy, top-k mass, the margin
    between the last chosen and the first rejected expert) of an fp32, bf16-mode forward over `num`
    full problems (prompt, answer, eos)."""
    model = build_model(cfg)
    model.load_state_dict(weights)
    model.set_fp4_mode("bf16")
    rng = random.Random(f"routing:{seed}")
    seqs = [tok.encode("".join(make_problem(rng)), add_eos=True) for _ in range(num)]
    probs = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: probs.append(out[1])) for m in model.modules()
             if isinstance(m, Router)]
    with torch.no_grad():
        for s in seqs:
            model(torch.tensor([s]))
    for h in hooks:
        h.remove()
    return router_margins(torch.cat(probs), cfg.model.top_k)  # rows [tokens * layers, E]


def _se(row: dict, column: str) -> str:
    """' ± s.e.' of the KL (`consistency.kl_bootstrap` over the row's requests), else ''."""
    if column != "kl" or len(row.get("kl_per_request") or ()) < 2:
        return ""
    return f" ± {float(kl_bootstrap([row['kl_per_request']], [row['tokens_per_request']]).std()):.1e}"


def markdown(rows) -> str:
    """Markdown tables, one per engine gap (in order of appearance); the KL with its standard error
    over requests."""
    out = []
    for gap in dict.fromkeys(r["gap"] for r in rows):
        out += [f"### {gap}", "", "| scope | setting | train | rollout | " + " | ".join(COLUMNS) + " | tokens |",
                "|" + "---|" * (len(COLUMNS) + 5)]
        for r in (r for r in rows if r["gap"] == gap):
            vals = " | ".join(f"{r[c]:.6f}" if c in ("pearson", "expert_agreement") else f"{r[c]:.2e}{_se(r, c)}"
                              for c in COLUMNS)
            out.append(f"| {r['scope']} | {r['setting']} | {r['train_mode']} | {r['rollout_mode']} | {vals} "
                       f"| {r['num_tokens']} |")
        out.append("")
    return "\n".join(out)


def ordering(rows) -> list:
    """Per (gap, scope): the settings ranked by mean |Δ log-prob| (closest first)."""
    lines = []
    for gap in dict.fromkeys(r["gap"] for r in rows):
        for scope in dict.fromkeys(r["scope"] for r in rows):
            rs = sorted((r for r in rows if r["gap"] == gap and r["scope"] == scope), key=lambda r: r["mean_abs_diff"])
            lines.append(f"{gap} | {scope}: " + " < ".join(f"{r['setting']} ({r['mean_abs_diff']:.1e})" for r in rs))
    return lines


PLOT_METRICS = [("pearson", "1 − Pearson r (token log-prob)", lambda v: 1.0 - v),
                ("expert_agreement", "1 − top-k expert-set agreement", lambda v: 1.0 - v),
                ("mean_abs_diff", "mean |Δ log-prob|", lambda v: v),
                ("kl", "KL(rollout ‖ train) per token", lambda v: v)]
FLOOR = 1e-9  # log axes: exact agreement (0), values below it and fp32-noise negatives of KL sit here


def plot(rows, path: Path) -> None:
    """Grid: one row of panels per engine gap, one panel per metric (all 'lower = more consistent',
    log scale); in each panel the four settings, one bar per FP4 scope."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gaps = list(dict.fromkeys(r["gap"] for r in rows))
    scopes = list(dict.fromkeys(r["scope"] for r in rows))
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    fig, axes = plt.subplots(len(gaps), len(PLOT_METRICS), figsize=(4.4 * len(PLOT_METRICS), 3.9 * len(gaps)),
                             squeeze=False)
    width = 0.8 / len(scopes)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    short = {"BF16 both": "BF16\nboth", "FP4 both, no compensation": "FP4 both\nno comp.",
             "FP4, rollout-only compensation": "FP4 rollout-\nonly comp.",
             "MoEResQ (both compensated)": "MoEResQ\nboth"}
    for gi, gap in enumerate(gaps):
        for mi, (metric, title, f) in enumerate(PLOT_METRICS):
            ax = axes[gi][mi]
            panel = []
            for j, scope in enumerate(scopes):
                vals = [max(f(r[metric]), FLOOR) for s in settings for r in rows
                        if r["gap"] == gap and r["scope"] == scope and r["setting"] == s]
                xs = [i + (j - (len(scopes) - 1) / 2) * width for i in range(len(vals))]
                ax.bar(xs, vals, width, label=scope, color=colors[j % len(colors)])
                for x, v in zip(xs, vals):
                    ax.text(x, v * 1.15, f"≤{FLOOR:g}" if v <= FLOOR else f"{v:.1e}", ha="center", va="bottom",
                            fontsize=6, rotation=90)
                panel += vals
            ax.set_yscale("log")
            ax.set_ylim(min(panel) / 4, max(panel) * 40)  # room for the value labels
            ax.set_xticks(range(len(settings)))
            ax.set_xticklabels([short.get(s, s) for s in settings], fontsize=8)
            ax.grid(axis="y", which="major", alpha=0.3)
            ax.set_title(title, fontsize=10)
            if mi == 0:
                ax.set_ylabel(gap.replace(", ", ",\n"), fontsize=9)
    axes[0][0].legend(fontsize=8, title="FP4 scope", title_fontsize=8, loc="upper left")
    fig.suptitle("Rollout vs trainer consistency (lower = more consistent; log scale per panel; "
                 f"'≤{FLOOR:g}': exact agreement, KL ≤ 0 or below {FLOOR:g}, drawn at {FLOOR:g})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def select(args) -> tuple:
    """(scopes, settings) named by --scopes / --settings; ValueError naming the unknown one."""
    scopes = args.scopes.split(",") if args.scopes else SCOPES
    modes = {f"{t}/{r}": (n, t, r) for n, t, r in SETTINGS}
    settings = [modes[m] if m in modes else None for m in args.settings.split(",")] if args.settings else SETTINGS
    if any(s not in SCOPES for s in scopes) or None in settings:
        raise ValueError(f"--scopes/--settings: unknown name in {args.scopes or ''!r} / {args.settings or ''!r}; scopes "
                         f"are {', '.join(SCOPES)}; settings are {', '.join(modes)}")
    return scopes, settings


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="trainer checkpoint directory (default: train in-process, see --train-steps)")
    ap.add_argument("--config", help="YAML config (default: the embedded megatron_fp4/configs/tiny_moe.yaml)")
    ap.add_argument("--override", action="append", help="dotted config override, e.g. model.init_std=0.1")
    ap.add_argument("--train-steps", type=int, default=None,
                    help="LM training steps when no --checkpoint (default: the config's schedule.train_steps, "
                         "i.e. the main job; 0: random init)")
    ap.add_argument("--rollout-dtype", choices=sorted(DTYPES), default="bf16",
                    help="rollout engine's dtype (trainer stays fp32); bf16 = the realistic engine gap")
    ap.add_argument("--engine-noise", type=float, default=0.0,
                    help="synthetic relative noise on the rollout's hidden state at every layer input (0: off)")
    ap.add_argument("--bf16-weights", action="store_true",
                    help="round the weights to bf16 for both sides (both engines load one bf16 checkpoint, so their "
                         "FP4 weight codes agree); default: the trainer keeps fp32 weights and only the rollout's "
                         "copy is rounded, as this project's weight sync does")
    ap.add_argument("--rollout", choices=["engine", "vllm"], default="engine",
                    help="rollout side: this project's engine (the engine-gap tables) or vLLM + the megatron_fp4 plugin "
                         "on the same weights (a table of its own; docs/vllm.md)")
    ap.add_argument("--vllm-python", help="the vLLM environment's python (default: env MEGATRON_FP4_VLLM_PYTHON, else "
                                          "vllm in this process); vLLM then runs in its own process")
    ap.add_argument("--settings", help="comma-separated subset of the settings by train/rollout mode, e.g. "
                                       "'fp4_resq/fp4_resq,bf16/bf16' (default: all four)")
    ap.add_argument("--scopes", help=f"comma-separated subset of {','.join(SCOPES)} (default: both)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the no-gap (fp32 both sides) table")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--rollout-batch", type=int, default=16)
    ap.add_argument("--train-batch", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="outputs/consistency", help="directory for table.md, results.json, consistency.png")
    args = ap.parse_args(argv)
    if args.engine_noise < 0:
        raise ValueError(f"--engine-noise must be >= 0, got {args.engine_noise}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    tok = ArithmeticTokenizer()
    cfg = base_config(args)
    if cfg.model.vocab_size < tok.vocab_size:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size} < tokenizer vocab {tok.vocab_size}; raise it")
    try:
        scopes, settings = select(args)
        if args.rollout == "vllm":
            from megatron_fp4.integrations.vllm.remote import vllm_python
            python = vllm_python(args.vllm_python)
    except ValueError as e:
        ap.error(str(e))
    weights = trained_weights(cfg, args)
    sharp = routing_sharpness(cfg, weights, tok, seed=args.seed)
    gaps = [Gap(args.rollout_dtype, args.engine_noise, args.bf16_weights)]
    baseline = Gap("fp32", 0.0, args.bf16_weights)
    if not args.no_baseline and gaps[0] != baseline:
        gaps.append(baseline)
    if not args.no_baseline:  # the same without the batch-invariant mode: what it removes
        gaps.append(Gap("fp32", 0.0, args.bf16_weights, invariance="standard"))
    kw = dict(num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, rollout_batch=args.rollout_batch,
              train_batch=args.train_batch, seed=args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.rollout == "vllm":
        rows = vllm_ablation(cfg, weights, tok, out / "vllm", python, scopes, settings,
                             args.num_prompts, args.max_new_tokens, args.train_batch, args.seed)
    else:
        rows = [r for gap in gaps for r in ablation(cfg, weights, tok, gap, scopes, settings, **kw)]
    sharp_line = (f"routing (trained router, {sharp['num_router_rows']} token-layer rows): normalized entropy "
                  f"{sharp['normalized_entropy']:.3f} (1 = uniform), top-k mass {sharp['topk_mass']:.3f}, median "
                  f"margin p_k - p_k+1 {sharp['median_margin']:.3e}, margin < 1e-2: {sharp['frac_margin_lt_1e-2']:.1%},"
                  f" < 1e-3: {sharp['frac_margin_lt_1e-3']:.1%}")
    text = markdown(rows) + "\n" + sharp_line + "\n\nranked by mean |Δ log-prob| (closest first):\n" + \
        "\n".join("- " + line for line in ordering(rows)) + "\n"
    print(text)
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"routing": sharp, "rows": rows}, indent=2))
    plot(rows, out / "consistency.png")
    print(f"wrote {out / 'table.md'}, {out / 'results.json'}, {out / 'consistency.png'}")
    return rows


if __name__ == "__main__":
    main()
