"""Rollout and training overlapped (``rl.max_staleness``) against the synchronous loop, side by side.

    OMP_NUM_THREADS=1 python benchmarks/bench_async_rl.py --seeds 0 1 2 3      # the README's GRPO recipe
    OMP_NUM_THREADS=1 python benchmarks/bench_async_rl.py --seeds 0 1 --sft-steps 200 --steps 10   # quicker
    python benchmarks/bench_async_rl.py --quick                                 # a smoke run (tests)
    VENV=/path/to/.venv-vllm/bin/python; PYTHONPATH=$PWD OMP_NUM_THREADS=1 $VENV benchmarks/bench_async_rl.py \
        --rollout vllm --seeds 0 1 --sft-steps 200 --steps 10                 # vLLM + the plugin as the rollout

Per seed: the GRPO example's carry task and SFT warm-up once (examples/grpo_moeresq.py `build`),
then from that same SFT state each staleness (default 0 and 1, ``wait``: deterministic) runs
``--steps`` GRPO steps with the rollout in a process of its own (``--rollout engine-process``, the
default: the own engine; ``vllm``: vLLM + the plugin, `rl.rollouts.vllm.VLLMRollout`;
``vllm-serve``: a `vllm serve` process, `VLLMServeRollout`; the vLLM kinds need the vLLM
environment: this interpreter when vllm imports here, else ``--vllm-python`` /
MEGATRON_FP4_VLLM_PYTHON, and run the model with head_dim 64, 2 heads, 1 kv head: vLLM's CPU
attention rejects head_dim 16), rollout and trainer processes on the machine's cores, alternating
the order of the settings from seed to seed. Printed per setting: seconds per GRPO step (steps 0 ..
n-2: the rollout process's start, the evals and the last step with the final eval are left out), the
rollout's and the trainer's share of it, and the held-out greedy accuracy after RL with a 95 %
t-interval over the seeds, and the train/rollout mismatch (the mean over the steps of
``consistency/kl``, the KL of the rollout's log-probs against the trainer's recomputed ones, =
``async/mismatch_kl`` when overlapped, and of ``consistency/expert_agreement``, the share of routed
experts the two sides agree on: NaN where the rollout returns no routes, vllm-serve); then the speed
ratio staleness k ÷ staleness 0 per seed and its mean. Timings depend on the machine's load: the
ratio is measured side by side, never asserted by a test.

Process CPU time (steadier on a shared machine): over the same steps the trainer process's and the
rollout's CPU seconds per step (`/proc/<pid>/stat`, the rollout process and its children: vllm
serve's engine core); for each side's main thread (the trainer's updates, the rollout's generations:
for vllm-serve, the main thread of the rollout's busiest process, its engine core) its run-queue
wait (`/proc/<pid>/schedstat`: runnable but not running — the machine's load, not the protocol) and
its blocked share (1 - (CPU + run-queue wait) / wall: waiting for the other side, what the overlap
removes); and the speed-up the CPU seconds allow on two free cores, (trainer + rollout) ÷
max(trainer, rollout), per setting and across them (the synchronous loop's CPU seconds per step over
the overlapped one's busier side: an upper bound of the steps/s ratio, reached when neither side
ever waits).
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_fp4.rl import make_rollout, switch_to_rl  # noqa: E402
from megatron_fp4.rl.loop import run_grpo  # noqa: E402

BENCH_ROLLOUTS = ("engine-process", "vllm", "vllm-serve")  # a rollout in a process of its own
# vLLM's CPU attention backend rejects the example model's head_dim 16 (docs/vllm.md): the vLLM kinds
# run the model with head_dim 64 (2 heads, 1 kv head) unless a --set of these fields follows
VLLM_MODEL = ("model.head_dim=64", "model.num_heads=2", "model.num_kv_heads=1")
# Two-sided 95 % Student t quantiles by degrees of freedom (n - 1 seeds); beyond 10: the normal's.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def load_example():
    spec = importlib.util.spec_from_file_location("grpo_moeresq", ROOT / "examples" / "grpo_moeresq.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    return ex


def interval(values: list) -> str:
    """mean ± the 95 % t half-width (one seed: the value alone)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.3f}"
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return f"{mean:.3f} ± {half:.3f}"


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` so far, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main_thread_s(pid: int) -> tuple:
    """(CPU s, run-queue wait s) of process `pid`'s main thread so far (/proc/<pid>/schedstat)."""
    cpu_ns, wait_ns = Path(f"/proc/{pid}/schedstat").read_text().split()[:2]
    return int(cpu_ns) / 1e9, int(wait_ns) / 1e9


def process_tree(pid: int) -> list:
    """`pid` and its descendants alive now (/proc/<pid>/task/<tid>/children), bounded by the process count."""
    out, todo = [], [pid]
    while todo and len(out) < 4096:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:  # the thread or process ended meanwhile
                pass
    return out


def cpu_or_0(pid: int) -> float:
    """`process_cpu_s`, 0 for a process that ended meanwhile."""
    try:
        return process_cpu_s(pid)
    except OSError:
        return 0.0


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and its descendants alive now."""
    return sum(cpu_or_0(p) for p in process_tree(pid))


class RolloutProcess:
    """The rollout's processes as the bench samples them: the process the client started (the own
    engine's or vLLM's rollout server; vllm-serve's API server, whose engine core is a child) and the
    one whose main thread generates (the busiest of its tree when first asked: vllm serve's engine core)."""

    def __init__(self, rollout):
        proc = getattr(rollout, "proc", None) or getattr(getattr(rollout, "server", None), "proc", None)
        if proc is None:
            raise RuntimeError(f"{type(rollout).__name__} has no rollout process to measure")
        self.pid, self.main = proc.pid, None

    def sample(self) -> tuple:
        if self.main is None:
            self.main = max(process_tree(self.pid), key=cpu_or_0)
        return (tree_cpu_s(self.pid), *main_thread_s(self.main))


def sample(rollout: RolloutProcess) -> tuple:
    """(wall, trainer CPU, rollout CPU, trainer main CPU, trainer main wait, rollout main CPU, rollout main wait)."""
    tree, r_cpu, r_wait = rollout.sample()
    return (time.perf_counter(), time.process_time(), tree, *main_thread_s(os.getpid()), r_cpu, r_wait)


def rollout_options(own, seed: int) -> dict:
    """make_rollout's options for the bench's ``--rollout`` kind."""
    if own.rollout == "engine-process":
        return {}
    return {"python": own.vllm_python, "work_dir": Path(own.work_dir) / f"seed{seed}"}


def one_setting(ex, args, own, trainer, task, sft_state: dict, staleness: int) -> dict:
    """GRPO from the SFT state with ``rl.max_staleness = staleness``: s/step, accuracy, busy times, mismatch."""
    trainer.model.load_state_dict(sft_state)
    switch_to_rl(trainer, args.lr, args.rl_weight_decay, args.rl_aux_coef)  # a fresh Adam for each setting
    trainer.cfg.rl.max_staleness, trainer.cfg.rl.staleness_policy = staleness, "wait"
    settings = ex.settings_of(args, None)
    rollout = make_rollout(own.rollout, trainer, task.tok.pad_id, args.bucket_mb << 20,
                           **rollout_options(own, args.seed))
    marks = []  # the progress lines' `sample`s: the header, then one after each step
    try:
        proc = RolloutProcess(rollout)
        run = run_grpo(trainer, task, rollout, settings, say=lambda *a, **k: marks.append(sample(proc)))
        # the header to step steps - 2's line: no eval, process start or final wait
        wall, trainer_cpu, rollout_cpu, t_cpu, t_wait, r_cpu, r_wait = (marks[-3][i] - marks[1][i] for i in range(7))
    finally:
        rollout.close()
    busy = run.history[-2].get("async/rollout_busy_s", float("nan"))
    n = settings.steps - 1
    return {"s_per_step": wall / n, "trainer_cpu": trainer_cpu / n, "rollout_cpu": rollout_cpu / n,
            "trainer_runq": t_wait / n, "rollout_runq": r_wait / n, "trainer_blocked": 1 - (t_cpu + t_wait) / wall,
            "rollout_blocked": 1 - (r_cpu + r_wait) / wall,
            "acc_before": run.eval_before, "acc": run.history[-1]["eval_acc"],
            "reward": statistics.fmean(h["reward"] for h in run.history), "rollout_busy": busy / wall,
            "trainer_wait": sum(h.get("async/wait_s", 0.0) for h in run.history[:-1]) / wall,
            "versions": run.sample_versions,
            "mismatch_kl": statistics.fmean(h["consistency/kl"] for h in run.history),
            "expert_agreement": statistics.fmean(h.get("consistency/expert_agreement", math.nan)
                                                 for h in run.history)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1], help="settings to compare (the first: "
                                                                              "the baseline of the ratio)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sft-steps", type=int, default=800)
    ap.add_argument("--quick", action="store_true", help="2 seeds x 3 steps after 20 SFT steps (a smoke run)")
    ap.add_argument("--rollout", choices=BENCH_ROLLOUTS, default="engine-process",
                    help="the rollout, in a process of its own: the own engine (engine-process), vLLM + the plugin "
                         "(vllm) or a vllm serve process (vllm-serve); the vLLM kinds need the vLLM environment")
    ap.add_argument("--vllm-python", help="--rollout vllm / vllm-serve: the vLLM environment's python (default: env "
                                          "MEGATRON_FP4_VLLM_PYTHON, else this one when vllm imports here)")
    ap.add_argument("--work-dir", default="outputs/bench_async_rl", help="the vLLM kinds' model templates and logs")
    own, rest = ap.parse_known_args(argv)
    if own.rollout != "engine-process":  # before the SFT warm-up (minutes): a clear error now
        from megatron_fp4.rl.rollouts.vllm import resolve_python

        try:
            own.vllm_python = resolve_python(own.vllm_python)
        except (RuntimeError, ValueError) as err:
            ap.error(f"--rollout {own.rollout} needs the vLLM environment (a venv with vllm, e.g. made by "
                     f"tools/vllm_env.sh): run this bench with its python or pass --vllm-python ({err})")
    if own.steps < 2:
        ap.error("--steps must be >= 2 (the time per step is measured over all steps but the last, which evaluates)")
    if own.quick:
        own.seeds, own.steps, own.sft_steps = own.seeds[:2], 3, 20
    if any(k < 0 for k in own.staleness) or len(set(own.staleness)) != len(own.staleness):
        ap.error(f"--staleness {own.staleness}: distinct values >= 0")
    if own.rollout != "engine-process":
        rest = [a for o in VLLM_MODEL for a in ("--set", o)] + rest  # a later --set of the field wins
        print(f"--rollout {own.rollout}: {' '.join(VLLM_MODEL)} (vLLM's CPU attention rejects head_dim 16)")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ex = load_example()
    results = {k: [] for k in own.staleness}
    for i, seed in enumerate(own.seeds):
        args = ex.parse_args(["--seed", str(seed), "--steps", str(own.steps), "--sft-steps", str(own.sft_steps),
                              "--eval-every", "0", "--logdir", "", *rest])
        t0 = time.perf_counter()
        trainer, task = ex.build(args)
        sft_state = copy.deepcopy(trainer.model.state_dict())
        print(f"seed {seed}: SFT {args.sft_steps} steps in {time.perf_counter() - t0:.0f} s", flush=True)
        order = own.staleness if i % 2 == 0 else own.staleness[::-1]  # neither setting always runs first
        for k in order:
            r = one_setting(ex, args, own, trainer, task, sft_state, k)
            results[k].append(r)
            print(f"seed {seed} staleness {k}: {r['s_per_step']:.3f} s/step, accuracy {r['acc_before']:.3f} -> "
                  f"{r['acc']:.3f}, mean reward {r['reward']:.3f}, mismatch KL {r['mismatch_kl']:.2e}, "
                  f"expert agreement {r['expert_agreement']:.4f}, versions {r['versions']}", flush=True)
    base = own.staleness[0]
    print(f"\nrollout: {own.rollout}")
    print(f"{'staleness':>9} {'s/step':>8} {'rollout busy':>12} {'trainer waits':>13} "
          f"{'held-out accuracy (95% CI)':>27} {'mismatch KL':>11} {'expert agreement':>16}")
    for k, rs in results.items():
        print(f"{k:>9} {statistics.fmean(r['s_per_step'] for r in rs):>8.3f} "
              f"{statistics.fmean(r['rollout_busy'] for r in rs) if k else float('nan'):>12.2f} "
              f"{statistics.fmean(r['trainer_wait'] for r in rs) if k else float('nan'):>13.2f} "
              f"{interval([r['acc'] for r in rs]):>27} {statistics.fmean(r['mismatch_kl'] for r in rs):>11.2e} "
              f"{statistics.fmean(r['expert_agreement'] for r in rs):>16.4f}")
    print(f"\n{'staleness':>9} {'CPU s/step: trainer':>19} {'rollout':>7} {'run-queue s/step: trainer':>25} "
          f"{'rollout':>7} {'blocked: trainer':>16} {'rollout':>7} {'2 free cores: bound':>19}")
    for k, rs in results.items():
        keys = ("trainer_cpu", "rollout_cpu", "trainer_runq", "rollout_runq", "trainer_blocked", "rollout_blocked")
        m = {key: statistics.fmean(x[key] for x in rs) for key in keys}
        t, r = m["trainer_cpu"], m["rollout_cpu"]
        print(f"{k:>9} {t:>19.3f} {r:>7.3f} {m['trainer_runq']:>25.3f} {m['rollout_runq']:>7.3f} "
              f"{m['trainer_blocked']:>16.2f} {m['rollout_blocked']:>7.2f} {(t + r) / max(t, r):>18.2f}x")
    for k in own.staleness[1:]:  # the synchronous loop runs the two sides in turn, the overlap at once
        bound = [(b["trainer_cpu"] + b["rollout_cpu"]) / max(r["trainer_cpu"], r["rollout_cpu"])
                 for b, r in zip(results[base], results[k])]
        print(f"CPU-time bound of steps/s, staleness {k} / staleness {base} on two free cores, (trainer + rollout "
              f"CPU at {base}) / max(trainer, rollout CPU at {k}): " + " ".join(f"{x:.2f}" for x in bound)
              + f" (per seed), mean {statistics.fmean(bound):.2f}x")
    for k in own.staleness[1:]:
        ratios = [b["s_per_step"] / r["s_per_step"] for b, r in zip(results[base], results[k])]
        print(f"steps/s, staleness {k} / staleness {base}: " + " ".join(f"{x:.2f}" for x in ratios)
              + f" (per seed), mean {statistics.fmean(ratios):.2f}x, median {statistics.median(ratios):.2f}x "
              "(on a loaded machine the median is the steadier number)")


if __name__ == "__main__":
    main()
