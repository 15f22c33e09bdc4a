"""The ablation's run files, statistics, table and plots (examples/ablation_moeresq.py runs them).

Run files: one JSON per (variant, seed) under ``<out>/runs/``, written atomically, with the
fingerprint of the flags that made it (a file from other flags is refused, not mixed in).

Intervals: 95 % Student-t over seeds, mean ± t(0.975, n-1) · s / sqrt(n) with s the sample std
(ddof 1). The t quantile is computed here (Simpson integration of the t density, bisection on its
CDF) so that no scipy is needed; tests/unit/test_ablation_report.py checks it against scipy.stats.t.
Paired contrasts: the same seed shares the SFT checkpoint, the RL prompts and the sampling seeds
across settings, so the per-seed difference of two settings has its own (usually narrower) interval.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import statistics
from pathlib import Path

CONSISTENCY = ("pearson", "kl", "expert_agreement", "mean_abs_diff")


def fingerprint(args, keys=None, exclude=()) -> dict:
    """The flags a result depends on (`keys`, or all but `exclude`), to refuse stale files."""
    return {k: v for k, v in sorted(vars(args).items())
            if (k in keys if keys is not None else k not in exclude)}


def _slug(variant: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", variant.lower()).strip("-")


def run_path(out: Path, variant: str, seed: int) -> Path:
    return out / "runs" / f"{_slug(variant)}.seed{seed}.json"


def write_atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def load_run(path: Path, fp: dict, variant: str | None = None, seed: int | None = None):
    """A finished run's record, or None when there is none. A file from other flags, one that holds
    another (variant, seed) than its name says (it would be counted twice and hide a missing run), or
    one that is not a whole run record is refused: a ValueError naming the file and the fix."""
    if not path.is_file():
        return None
    try:
        rec = json.loads(path.read_text())
        problem = record_problem(rec, variant, seed)
    except (ValueError, UnicodeDecodeError) as err:
        problem = f"not JSON ({err})"
    if problem is not None:
        raise ValueError(f"{path}: not a run record of this example ({problem}); delete it to rerun")
    theirs = rec["fingerprint"]
    diff = sorted(k for k in set(fp) | set(theirs) if fp.get(k) != theirs.get(k))
    if diff:
        k = diff[0]
        raise ValueError(f"{path} was made with --{k.replace('_', '-')}={theirs.get(k)!r}, this run has "
                         f"{fp.get(k)!r}: use another --out or delete {path.parent} to rerun")
    return rec


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _fraction(x) -> bool:
    return _number(x) and 0 <= x <= 1


def record_problem(rec, variant: str | None = None, seed: int | None = None) -> str | None:
    """What is wrong with a run record (None: nothing): the keys the table reads, each of its form —
    accuracies are fractions in [0, 1], every step has its numbers, the evals start at step 0."""
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not an object"
    if not isinstance(rec.get("fingerprint"), dict):
        return f"fingerprint {rec.get('fingerprint')!r} is not an object of flags"
    if variant is not None and rec.get("variant") != variant:
        return f"it holds variant {rec.get('variant')!r}, not {variant!r}"
    if seed is not None and (not isinstance(rec.get("seed"), int) or rec.get("seed") != seed):
        return f"it holds seed {rec.get('seed')!r}, not {seed}"
    history, evals = rec.get("history"), rec.get("evals")
    if not isinstance(history, list) or not history:
        return "no history (one entry per GRPO step)"
    for h in history:
        bad = [k for k in ("step", "reward", "loss", *CONSISTENCY) if not isinstance(h, dict) or not _number(h.get(k))]
        if bad:
            return f"history entry {h!r:.80} lacks a number for {bad[0]!r}"
    if not isinstance(evals, list) or not evals:
        return "no evals ([step, accuracy] pairs)"
    for e in evals:
        if not (isinstance(e, list) and len(e) == 2 and isinstance(e[0], int) and _fraction(e[1])):
            return f"eval {e!r:.80} is not [step, accuracy in [0, 1]]"
    if evals[0][0] != 0:
        return f"the first eval is at step {evals[0][0]}, not 0 (the policy before RL)"
    groups = rec.get("eval_groups", [])
    if not isinstance(groups, list) or not all(
            isinstance(g, list) and len(g) == 2 and isinstance(g[1], dict) and all(map(_fraction, g[1].values()))
            for g in groups):
        return "eval_groups is not a list of [step, {group: accuracy in [0, 1]}]"
    return None


def t_cdf(x: float, df: int, intervals: int = 4000) -> float:
    """P(T <= x) for Student's t with `df` degrees of freedom (Simpson's rule on [0, |x|])."""
    if df < 1:
        raise ValueError(f"t distribution needs df >= 1, got {df}")
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    pdf = lambda t: c * (1 + t * t / df) ** (-(df + 1) / 2)  # noqa: E731
    a, n = abs(x), intervals
    h = a / n
    area = pdf(0.0) + pdf(a) + sum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, n))
    half = area * h / 3
    return 0.5 + half if x >= 0 else 0.5 - half


@functools.lru_cache(maxsize=None)
def t_quantile(p: float, df: int) -> float:
    """The `p` quantile (0.5 < p < 1) of Student's t, by bisection on `t_cdf` to 1e-10."""
    if not 0.5 < p < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1, got {p}")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2
    while hi - lo > 1e-10:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def mean_ci(xs, level: float = 0.95) -> dict:
    """{'mean', 'half', 'lo', 'hi', 'n', 'std'}: Student-t interval over `xs` (NaNs dropped; half is
    NaN for n < 2)."""
    xs = [float(x) for x in xs if not math.isnan(x)]
    n = len(xs)
    if n == 0:
        return {"mean": math.nan, "half": math.nan, "lo": math.nan, "hi": math.nan, "n": 0, "std": math.nan}
    m = statistics.fmean(xs)
    if n < 2:
        return {"mean": m, "half": math.nan, "lo": math.nan, "hi": math.nan, "n": 1, "std": math.nan}
    s = statistics.stdev(xs)
    half = t_quantile(0.5 + level / 2, n - 1) * s / math.sqrt(n)
    return {"mean": m, "half": half, "lo": m - half, "hi": m + half, "n": n, "std": s}


def fmt(ci: dict, digits: int = 3) -> str:
    if ci["n"] == 0:
        return "n/a"
    if math.isnan(ci["half"]):
        return f"{ci['mean']:.{digits}f}"
    return f"{ci['mean']:.{digits}f} ± {ci['half']:.{digits}f}"


def fmt_g(ci: dict) -> str:
    if ci["n"] == 0:
        return "n/a"
    return f"{ci['mean']:.2e}" if math.isnan(ci["half"]) else f"{ci['mean']:.2e} ± {ci['half']:.1e}"


def area(evals) -> float:
    """Mean held-out accuracy over the evaluations after RL started (the area under the curve / steps)."""
    after = [acc for step, acc in evals if step > 0]
    return statistics.fmean(after) if after else math.nan


def run_metrics(r: dict) -> dict:
    """Per-run scalars the table aggregates over seeds."""
    accs = [acc for _, acc in r["evals"]]
    out = {"acc_sft": accs[0], "acc_final": accs[-1], "acc_best": max(accs[1:] or accs), "acc_area": area(r["evals"]),
           "reward_last": statistics.fmean(h["reward"] for h in r["history"][-5:]),
           # the carry task's held-out problems with a carry (the rule RL has to learn); NaN for other tasks
           "acc_carry_final": (r.get("eval_groups") or [[0, {}]])[-1][1].get("carry", math.nan)}
    for key in CONSISTENCY:
        out[key] = statistics.fmean(h[key] for h in r["history"])
    return out


def summarize(runs: list, variants: list) -> list:
    """One row per variant (setting × TIS) that has runs: mean ± 95 % CI over seeds."""
    rows = []
    for v in variants:
        mine = sorted((r for r in runs if r["variant"] == v["variant"]), key=lambda r: r["seed"])
        if not mine:
            continue
        per = [run_metrics(r) for r in mine]
        stats = {k: mean_ci([p[k] for p in per]) for k in per[0]}
        rows.append({"variant": v["variant"], "setting": v["setting"], "train": v["train_mode"],
                     "rollout": v["rollout_mode"], "replay": v["router_replay"], "tis": v["tis"],
                     "seeds": [r["seed"] for r in mine], "stats": stats})
    return rows


def paired(runs: list, a: str, b: str, key: str) -> dict:
    """Mean ± 95 % CI over the seeds both variants ran of run_metrics(a)[key] - run_metrics(b)[key]."""
    by = {(r["variant"], r["seed"]): run_metrics(r)[key] for r in runs}
    seeds = sorted(s for (v, s) in by if v == a and (b, s) in by)
    return mean_ci([by[(a, s)] - by[(b, s)] for s in seeds])


def contrasts(runs: list, pairs: list) -> list:
    present = {r["variant"] for r in runs}
    return [{"a": a, "b": b, **{k: paired(runs, a, b, k) for k in ("acc_final", "acc_area", "kl")}}
            for a, b in pairs if a in present and b in present]


def excludes_zero(ci: dict) -> str:
    """'yes' when the 95 % interval lies on one side of 0, 'no' when it contains 0, 'n/a' below 2 seeds."""
    return "n/a" if ci["n"] < 2 else "yes" if ci["lo"] > 0 or ci["hi"] < 0 else "no"


def overlap(a: dict, b: dict) -> str:
    """Whether two settings' own 95 % intervals overlap ('n/a' below 2 seeds)."""
    if a["n"] < 2 or b["n"] < 2:
        return "n/a"
    return "overlap" if a["lo"] <= b["hi"] and b["lo"] <= a["hi"] else "disjoint"


def markdown(rows: list, comps: list) -> str:
    head = ["setting", "train", "rollout", "replay", "TIS", "n", "acc after SFT", "acc at end (95 % CI)",
            "carry problems at end", "best eval", "mean acc over evals", "reward, last 5 steps", "KL", "1 − pearson",
            "expert agreement"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        s = r["stats"]
        pear = dict(s["pearson"], mean=1 - s["pearson"]["mean"])
        lines.append("| " + " | ".join([
            r["setting"], r["train"], r["rollout"], r["replay"], "on" if r["tis"] else "off", str(len(r["seeds"])),
            fmt(s["acc_sft"]), f"**{fmt(s['acc_final'])}**", fmt(s["acc_carry_final"]), fmt(s["acc_best"]),
            fmt(s["acc_area"]),
            fmt(s["reward_last"]), fmt_g(s["kl"]), fmt_g(pear), fmt(s["expert_agreement"], 4)]) + " |")
    if comps:
        by = {r["variant"]: r["stats"] for r in rows}
        lines += ["", "| paired over seeds: A − B | n | Δ acc at end (95 % CI) | excludes 0 | A's, B's intervals "
                  "| Δ mean acc over evals | excludes 0 | Δ KL (95 % CI) |", "|---|---|---|---|---|---|---|---|"]
        for c in comps:
            sides = [by[c["a"]]["acc_final"], by[c["b"]]["acc_final"]] if c["a"] in by and c["b"] in by else []
            lines.append(f"| {c['a']} − {c['b']} | {c['acc_final']['n']} | {fmt(c['acc_final'])} | "
                         f"{excludes_zero(c['acc_final'])} | {overlap(*sides) if sides else 'n/a'} | "
                         f"{fmt(c['acc_area'])} | {excludes_zero(c['acc_area'])} | "
                         f"{fmt_g(c['kl'])} |")
    return "\n".join(lines)


def per_seed_markdown(runs: list, variants: list) -> str:
    """Held-out accuracy per variant and seed: after SFT -> best eval -> at the end."""
    seeds = sorted({r["seed"] for r in runs})
    by = {(r["variant"], r["seed"]): r for r in runs}
    lines = ["| variant | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|" + "---|" * (len(seeds) + 1)]
    for v in variants:
        cells = []
        for s in seeds:
            r = by.get((v["variant"], s))
            m = run_metrics(r) if r else None
            cells.append(f"{m['acc_sft']:.2f} → {m['acc_best']:.2f} → {m['acc_final']:.2f}" if m else "–")
        if any(c != "–" for c in cells):
            lines.append(f"| {v['variant']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _curves(runs: list, variant: str, key: str):
    """(steps, [per-seed values]) of a per-step consistency metric or (key None) of the evals."""
    mine = [r for r in runs if r["variant"] == variant]
    if key is None:
        steps = [s for s, _ in mine[0]["evals"]]
        return steps, [[acc for _, acc in r["evals"]] for r in mine if len(r["evals"]) == len(steps)]
    steps = [h["step"] + 1 for h in mine[0]["history"]]
    return steps, [[h[key] for h in r["history"]] for r in mine]


def _draw(ax, runs: list, v: dict, key, colour: str, band: bool, label: str) -> None:
    """One variant's per-step mean over seeds (and its 95 % CI band) on `ax`."""
    steps, ys = _curves(runs, v["variant"], key)
    if key in ("pearson", "expert_agreement"):
        ys = [[1 - y for y in seq] for seq in ys]
    cis = [mean_ci(col) for col in zip(*ys)]
    ax.plot(steps, [c["mean"] for c in cis], "-" if v["tis"] else "--", color=colour,
            marker="o" if key is None else None, ms=3, label=label)
    if band and len(ys) > 1:
        ax.fill_between(steps, [c["lo"] for c in cis], [c["hi"] for c in cis], color=colour, alpha=0.15)


def plot(runs: list, variants: list, out: Path) -> list:
    """accuracy.png: one panel per setting, mean and 95 % CI band over seeds, with TIS (solid) and
    without (dashed), BF16 (grey) for reference; kl.png, pearson.png, expert_agreement.png: per-step
    mean over seeds, colour = setting, dashed = without TIS. Returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [v for v in variants if any(r["variant"] == v["variant"] for r in runs)]
    settings = list(dict.fromkeys(v["setting"] for v in present))
    colours = {s: f"C{i}" for i, s in enumerate(settings)}
    cols = min(3, len(settings))
    rows = -(-len(settings) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), sharex=True, sharey=True, squeeze=False)
    reference = next((v for v in present if v["setting"] == "BF16" and v["tis"]), None)
    for ax, setting in zip(axes.flat, settings):
        if reference is not None and setting != "BF16":
            _draw(ax, runs, reference, None, "0.6", False, "BF16 (TIS)")
        for v in (v for v in present if v["setting"] == setting):
            _draw(ax, runs, v, None, colours[setting], True, "TIS" if v["tis"] else "no TIS")
        ax.set_title(setting, fontsize=10)
        ax.set_ylim(0.0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    for ax in axes.flat[len(settings):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("GRPO step")
    fig.suptitle("held-out greedy accuracy: mean and 95 % CI over seeds", fontsize=11)
    fig.tight_layout()
    paths = [out / "accuracy.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    panels = [("kl", "KL(rollout || trainer) on sampled tokens, mean over seeds", "log"),
              ("pearson", "1 − Pearson(rollout, trainer log-probs), mean over seeds", "log"),
              ("expert_agreement", "1 − expert agreement, mean over seeds (R3: 0, the routes are replayed)", "symlog")]
    for key, title, scale in panels:
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        for v in present:
            _draw(ax, runs, v, key, colours[v["setting"]], False, v["variant"])
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
        ax.set_yscale(scale, **({"linthresh": 1e-3} if scale == "symlog" else {}))
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        paths.append(out / f"{key}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
