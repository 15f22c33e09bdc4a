"""Greedy held-out evaluation of the policy a rollout serves, and the weight-sync check.

- `greedy_eval(rollout, task, min_version)`: (accuracy, accuracy per eval group) of greedy decoding
  (temperature 0) on the task's eval items; an answer is right when its reward is > 0
- `check_sync(trainer, rollout, version)`: the rollout serves `version` and its weights are the
  trainer's, bit for bit (SHA-256 per HF name)
"""
from __future__ import annotations

import hashlib

from megatron_fp4.rollout.sampling import SamplingParams


def greedy_eval(rollout, task, min_version: int = 0) -> tuple[float, dict]:
    """(fraction of the eval items answered right, {group: fraction} over `task.eval_groups()`)."""
    items = task.eval_items()
    if not items:  # an accuracy over no problems would read as 0.000
        raise ValueError(f"greedy eval: the task has no eval problems ({task.description}); set an eval size >= 1")
    params = SamplingParams(max_new_tokens=task.eval_tokens, temperature=0.0, stop_token_ids=task.stop_token_ids)
    gen = rollout.generate([ids for ids, _, _ in items], [params] * len(items), min_version=min_version)
    right = [task.reward(it, task.tok.decode(r, stop_at_eos=True)) > 0 for it, r in zip(items, gen.response_ids)]
    by_group = {}
    for name, ok in zip(task.eval_groups() or (), right):
        if name is not None:
            by_group.setdefault(name, []).append(ok)
    return sum(right) / len(right), {g: sum(v) / len(v) for g, v in sorted(by_group.items())}


def check_sync(trainer, rollout, version: int) -> str:
    """The rollout serves `version` and its weights equal the trainer's (SHA-256 per HF name), or a
    RuntimeError naming the first that differ; returns one SHA-256 over them all."""
    from megatron_fp4.rl.rollouts.worker import weight_digests

    served, ours = rollout.digests(), weight_digests(trainer.model)
    differ = sorted(n for n in set(ours) | set(served["digests"]) if ours.get(n) != served["digests"].get(n))
    if served["version"] != version or differ:
        raise RuntimeError(f"weight sync check: the rollout serves version {served['version']} (expected {version}); "
                           f"{len(differ)} of {len(ours)} weights differ from the trainer's, e.g. {differ[:3]}")
    return hashlib.sha256(repr(sorted(ours.items())).encode()).hexdigest()
