"""Rollout-vs-training consistency ablation (the MoEResQ paper's table, on our tiny model).

    python tools/consistency_report.py --out outputs/consistency            # quick LM warm-up first
    python tools/consistency_report.py --checkpoint outputs/tiny_moe/checkpoints/step_300 --out ...

For each FP4 scope (experts, experts+attention) and each (train_mode, rollout_mode) setting:

    bf16/bf16 | fp4/fp4 (no compensation) | fp4/fp4_resq (rollout-only) | fp4_resq/fp4_resq (MoEResQ)

the rollout side generates answers to arithmetic prompts with KV-cache decoding, batched one way;
the training side re-scores the rollout's own tokens with one full-sequence forward, batched
another way (reversed order, smaller micro-batches, so other padding). Same weights on both sides.
Prints a markdown table and writes table.md, results.json and consistency.png under --out.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_fp4.config import default_config_path, load_config  # noqa: E402
from megatron_fp4.model import build_model  # noqa: E402
from megatron_fp4.rollout import RolloutEngine, SamplingParams  # noqa: E402
from megatron_fp4.rollout.consistency import consistency_metrics  # noqa: E402
from megatron_fp4.rollout.scoring import score  # noqa: E402
from megatron_fp4.training.data import ArithmeticTokenizer, make_problem  # noqa: E402

SETTINGS = [("BF16 both", "bf16", "bf16"), ("FP4 both, no compensation", "fp4", "fp4"),
            ("FP4, rollout-only compensation", "fp4", "fp4_resq"), ("MoEResQ (both compensated)", "fp4_resq", "fp4_resq")]
SCOPES = ["experts", "experts+attention"]
COLUMNS = ["pearson", "mean_abs_diff", "max_abs_diff", "expert_agreement", "kl"]


def base_config(args):
    path = args.config or (Path(__file__).resolve().parents[1] / "examples/configs/tiny_moe.yaml")
    if not Path(path).exists():
        path = default_config_path() if default_config_path().exists() else None
    overrides = ["logging.tensorboard_dir=null", "checkpoint.dir=null"] + list(args.override or [])
    return load_config(path, overrides) if path else load_config(None, overrides)


def trained_weights(cfg, args) -> dict:
    """Weights to compare with: a checkpoint, a short LM warm-up with the Trainer, or the init."""
    if args.checkpoint or args.train_steps > 0:
        from megatron_fp4.training.trainer import Trainer
        trainer = Trainer(cfg, build_data=args.checkpoint is None)
        if args.checkpoint:
            trainer.load_checkpoint(args.checkpoint)
        for step in range(0 if args.checkpoint else args.train_steps):
            out = trainer.train_step()
            if step % 25 == 0 or step == args.train_steps - 1:
                print(f"warm-up step {step}: loss {out['loss']:.3f}", file=sys.stderr)
        return {k: v.detach().float().clone() for k, v in trainer.model.state_dict().items()}
    return build_model(cfg).state_dict()


def prompts(n: int, seed: int, tok) -> list:
    rng = random.Random(f"consistency:{seed}")
    return [tok.encode(make_problem(rng)[0], add_eos=False) for _ in range(n)]


def measure(cfg, weights, scope, train_mode, rollout_mode, args, tok) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg.fp4.scope = scope
    train_model = build_model(cfg)
    train_model.load_state_dict(weights)
    engine = RolloutEngine(copy.deepcopy(train_model), mode=rollout_mode, pad_id=tok.pad_id)
    ps = prompts(args.num_prompts, args.seed, tok)
    params = [SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=args.seed * 100_003 + i,
                             stop_token_ids=(tok.eos_id,)) for i in range(len(ps))]
    gens = []  # rollout: batches of `rollout_batch` in prompt order
    for s in range(0, len(ps), args.rollout_batch):
        gens.append(engine.generate(ps[s:s + args.rollout_batch], params[s:s + args.rollout_batch],
                                    return_routing=True, return_distributions=True))
    flat = {k: [x for g in gens for x in getattr(g, k)] for k in
            ("prompt_ids", "response_ids", "log_probs", "routing", "distributions")}
    order = list(range(len(ps)))[::-1]  # training side: other batch composition and padding
    train = {"log_probs": [None] * len(ps), "routing": [None] * len(ps), "distributions": [None] * len(ps)}
    for s in range(0, len(order), args.train_batch):
        idx = order[s:s + args.train_batch]
        out = score(train_model, [flat["prompt_ids"][i] for i in idx], [flat["response_ids"][i] for i in idx],
                    tok.pad_id, train_mode, return_routing=True, return_distributions=True)
        for j, i in enumerate(idx):
            for k in train:
                train[k][i] = out[k][j]
    cat = lambda xs: torch.cat(list(xs))  # noqa: E731
    return consistency_metrics(cat(flat["log_probs"]), cat(train["log_probs"]), cat(flat["routing"]),
                               cat(train["routing"]), cat(flat["distributions"]), cat(train["distributions"]))


def markdown(rows) -> str:
    head = "| scope | setting | train | rollout | " + " | ".join(COLUMNS) + " | tokens |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 5)]
    for r in rows:
        vals = " | ".join(f"{r[c]:.8f}" if c in ("pearson", "expert_agreement") else f"{r[c]:.2e}" for c in COLUMNS)
        lines.append(f"| {r['scope']} | {r['setting']} | {r['train_mode']} | {r['rollout_mode']} | {vals} | {r['num_tokens']} |")
    return "\n".join(lines)


def plot(rows, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, metric, title in zip(axes, ["pearson", "expert_agreement", "mean_abs_diff"],
                                 ["token log-prob Pearson r", "top-k expert-set agreement", "mean |Δ log-prob|"]):
        width = 0.8 / len(SCOPES)
        for j, scope in enumerate(SCOPES):
            vals = [r[metric] for r in rows if r["scope"] == scope]
            ax.bar([i + j * width for i in range(len(vals))], vals, width, label=scope)
        ax.set_xticks([i + width / 2 for i in range(len(SETTINGS))])
        ax.set_xticklabels([s[0].replace(", ", ",\n").replace(" (", "\n(") for s in SETTINGS], fontsize=7)
        ax.set_title(title)
        if metric != "mean_abs_diff":
            lo = min(r[metric] for r in rows)
            ax.set_ylim(max(0.0, lo - (1 - lo) * 0.5 - 1e-4), 1.0 + 1e-5)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", help="trainer checkpoint directory (default: random init + --train-steps warm-up)")
    ap.add_argument("--config", help="YAML config (default examples/configs/tiny_moe.yaml, else Config())")
    ap.add_argument("--override", action="append", help="dotted config override, e.g. model.init_std=0.1")
    ap.add_argument("--train-steps", type=int, default=100, help="LM warm-up steps when no --checkpoint (0: random)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--rollout-batch", type=int, default=16)
    ap.add_argument("--train-batch", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="outputs/consistency", help="directory for table.md, results.json, consistency.png")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    tok = ArithmeticTokenizer()
    cfg = base_config(args)
    if cfg.model.vocab_size < tok.vocab_size:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size} < tokenizer vocab {tok.vocab_size}; raise it")
    weights = trained_weights(cfg, args)
    rows = []
    for scope in SCOPES:
        for name, train_mode, rollout_mode in SETTINGS:
            m = measure(cfg, weights, scope, train_mode, rollout_mode, args, tok)
            rows.append({"scope": scope, "setting": name, "train_mode": train_mode, "rollout_mode": rollout_mode, **m})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows)
    print(table)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    plot(rows, out / "consistency.png")
    print(f"\nwrote {out / 'table.md'}, {out / 'results.json'}, {out / 'consistency.png'}")
    return rows


if __name__ == "__main__":
    main()
