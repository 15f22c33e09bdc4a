"""The GRPO loop on the one `Trainer`, for every caller: examples/grpo_moeresq.py (the CLI, any
layout, any rollout) and examples/ablation_moeresq.py (one call per setting and seed).

    settings = GRPOSettings(steps=20, num_prompts=8, group_size=8, ...)
    run = run_grpo(trainer, task, rollout, settings)   # run.history: one record per step

Each step: the rollout (``publish``/``generate``: `rl.rollouts.client`, `rl.rollouts.vllm` or any
object with that interface) samples ``group_size`` answers per prompt of ``task.sample`` (`rl.tasks.catalog`);
the task rewards them; `build_rl_batch` recomputes the old log-probs on the trainer (router replay:
``trainer.cfg.rl.router_replay``) and normalises the rewards per group; the rollout/trainer
consistency (KL, Pearson, expert agreement) is logged; ``ppo_epochs`` x ``minibatches`` clipped
policy-gradient steps (`PolicyLoss`) update the trainer; the new weights are published (two
completion points: training could resume at the snapshot, the next rollout waits for the load).
The greedy held-out accuracy (`rl.evaluate`) is measured before RL and every ``eval_every`` steps.

Rollout correction: ``settings.correction`` (a `RolloutCorrection`, e.g. from verl's fields through
`rollout_correction.from_verl_config`: token/sequence TIS, MIS, rejection) replaces the plain token
TIS of ``tis_cap``; the loss applies its weights and mask, and each step logs verl's batch metrics
(`correct_batch`, ``rollout_corr/...``).

Overlap (``trainer.cfg.rl.max_staleness`` = k > 0, `rl.overlap`): the step is `sample_requests`
(on the rollout's thread: generation with version max(0, m - k)) and `update_on` (the trainer),
the rollout generating the batches of steps n+1..n+k while step n trains; each record adds
``sample_index``, ``async/staleness``, ``async/wait_s`` (the trainer idle, waiting for the rollout),
``async/dropped`` and ``async/rollout_busy_s``; `GRPORun.sample_versions` lists who sampled what.
"""
from __future__ import annotations

import copy
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_fp4.model.capacity import refuse_for_rollout
from megatron_fp4.rl.evaluate import check_sync, greedy_eval
from megatron_fp4.rl.algo.grpo import build_rl_batch, consistency, ppo_updates
from megatron_fp4.rl.overlap import Generations, StalenessCounter, sample_version, staleness
from megatron_fp4.rl.algo.policy_loss import PolicyLoss
from megatron_fp4.rl.resume import load_state, rng_state, save_state, set_rng_state
from megatron_fp4.rl.rollouts.client import InProcessRollout
from megatron_fp4.rl.algo.rollout_correction import RolloutCorrection, correct_batch
from megatron_fp4.rl.algo.scorer import PolicyScorer
from megatron_fp4.rollout.engine import RolloutEngine
from megatron_fp4.rollout.sampling import SamplingParams
from megatron_fp4.rollout.weight_sync.publisher import InProcessTransport, WeightPublisher, WeightReceiver


@dataclass
class GRPOSettings:
    """Everything the loop reads besides the trainer's config (defaults: the carry recipe). The config
    holds the rest, each in one place: the seed of the sampling and minibatch shuffle (``schedule.seed``),
    the scoring level (``numerics.invariance``), where checkpoints go and whether to resume (``checkpoint.dir``,
    ``checkpoint.load``), staleness and packing (``rl.*``)."""
    steps: int = 20  # GRPO steps (a rollout batch each, ppo_epochs x minibatches optimizer steps: not train_steps)
    num_prompts: int = 8
    group_size: int = 8
    max_new_tokens: int = 24
    temperature: float = 1.0
    # rows per scoring/update micro-batch of a rollout batch (rl.max_tokens_per_micro_batch > 0: packed instead)
    micro_batch_size: int = 32
    ppo_epochs: int = 1
    minibatches: int = 1
    clip_eps: float = 0.2
    tis_cap: Optional[float] = 2.0  # token TIS cap; ignored when `correction` is set
    kl_coef: float = 0.0  # k3 KL to the policy the loop starts from (frozen)
    correction: Optional[RolloutCorrection] = None
    eval_every: int = 5  # 0: only after the last step
    check_sync: bool = False  # after every publish: wait for the load, compare the served weights' digests
    # GRPO steps (each ppo_epochs x minibatches trainer steps, so not checkpoint.save_interval's unit) between
    # checkpoints to checkpoint.dir with the loop's state (rl.resume); 0: none
    checkpoint_every: int = 0

    def __post_init__(self):
        for name in ("steps", "num_prompts", "group_size", "max_new_tokens", "micro_batch_size", "ppo_epochs",
                     "minibatches"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"GRPOSettings.{name}={getattr(self, name)} must be >= 1")
        if self.checkpoint_every < 0:
            raise ValueError(f"GRPOSettings.checkpoint_every={self.checkpoint_every} must be >= 0 (0: no checkpoints)")
        if self.eval_every < 0:
            raise ValueError(f"GRPOSettings.eval_every={self.eval_every} must be >= 0 (0: only after the last step)")
        if self.minibatches > self.num_prompts * self.group_size:
            raise ValueError(f"GRPOSettings.minibatches={self.minibatches} is more than the "
                             f"{self.num_prompts * self.group_size} rows of a rollout batch (num_prompts x group_size)")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"GRPOSettings.temperature={self.temperature} must be a finite number >= 0 (0: greedy)")
        policy_loss_for(self)  # clip_eps, tis_cap, kl_coef and the correction: refused now, not at the first update


@dataclass
class GRPORun:
    history: list = field(default_factory=list)  # one record per step (see `grpo_step`)
    eval_before: float = float("nan")  # greedy accuracy of the starting policy
    eval_before_groups: dict = field(default_factory=dict)
    staleness_histogram: dict = field(default_factory=dict)  # {versions behind: batches} (rl.max_staleness > 0)
    token_staleness_histogram: dict = field(default_factory=dict)  # {versions behind: generated tokens}
    dropped: int = 0  # batches dropped as too stale (rl.staleness_policy=drop)

    @property
    def sample_versions(self) -> list:
        """The policy version that generated each step's batch."""
        return [h["rollout_version"] for h in self.history]

    @property
    def evals(self) -> list:
        """[(steps done, accuracy, {group: accuracy})], before RL first."""
        return [(0, self.eval_before, self.eval_before_groups)] + \
            [(h["step"] + 1, h["eval_acc"], h["eval_groups"]) for h in self.history if "eval_acc" in h]


class EngineCopyRollout(InProcessRollout):
    """`InProcessRollout` with the engine's numerics chosen here, not by the config: ``mode``, a
    ``dtype`` copy of the model (bf16: the engine gap of real stacks, docs/consistency.md) and
    ``invariance`` (the ablation's rollout: "standard" kernels by default)."""

    def __init__(self, trainer, pad_id: int, mode: str, dtype: Optional[torch.dtype] = None,
                 invariance: str = "standard", bucket_bytes: int = 1 << 20, name: str = "rollout0"):
        self.engine = RolloutEngine(copy.deepcopy(trainer.model), mode=mode, pad_id=pad_id, dtype=dtype, name=name,
                                    invariance=invariance)
        self.publisher = WeightPublisher(trainer.model, [InProcessTransport(WeightReceiver(self.engine))], bucket_bytes)


def micro_batch_for(rows: int, mesh, cap: int = 32) -> int:
    """`cap` rows, or with a pipeline the largest divisor of a dp share of `rows` that is at most
    `cap` and leaves >= pp micro-batches."""
    if mesh.pp == 1:
        return cap
    share = rows // mesh.dp
    bound = min(cap, share // mesh.pp)
    return max([d for d in range(1, bound + 1) if share % d == 0] or [1])


def policy_loss_for(settings: GRPOSettings) -> PolicyLoss:
    """The update's loss: token TIS at ``tis_cap``, or the configured rollout correction."""
    if settings.correction is not None:
        return PolicyLoss(settings.clip_eps, None, settings.kl_coef, correction=settings.correction)
    return PolicyLoss(settings.clip_eps, settings.tis_cap, settings.kl_coef)


def sampling_params(settings: GRPOSettings, seed: int, step: int, num: int, stop_token_ids) -> list:
    """One `SamplingParams` per request, seeded by (the run's ``schedule.seed``, step, request): the same
    draws on any layout."""
    return [SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                           stop_token_ids=stop_token_ids, seed=seed * 1_000_003 + step * 10_007 + i)
            for i in range(num)]


def sample_requests(task, settings: GRPOSettings, seed: int, index: int) -> tuple[list, list]:
    """Batch `index`'s requests: ``group_size`` copies of each of ``num_prompts`` task items (drawn
    in batch order), one seeded `SamplingParams` each (`sampling_params`)."""
    items = [it for it in task.sample(settings.num_prompts) for _ in range(settings.group_size)]
    return items, sampling_params(settings, seed, index, len(items), task.stop_token_ids)


def update_on(trainer, task, scorer, loss, settings: GRPOSettings, step: int, shuffle_rng, items: list, gen) -> dict:
    """Reward `gen` (the generations of `items`), build the batch (the trainer's log-probs now: the
    proximal policy; the rollout's: the behaviour policy, version ``gen.version``), update; the
    step's record without the publish."""
    completions = [task.tok.decode(r, stop_at_eos=True) for r in gen.response_ids]
    rewards = torch.tensor([task.reward(it, c) for it, c in zip(items, completions)])
    batch = build_rl_batch(gen, rewards, settings.group_size, scorer, task.tok.pad_id,
                           router_replay=trainer.cfg.rl.router_replay)  # rl.router_replay: off | r2 | r3
    cons = consistency(gen, batch)
    corrected = correct_batch(batch, settings.correction) if settings.correction is not None else {}
    result = ppo_updates(trainer, batch, loss, settings.micro_batch_size, settings.ppo_epochs, settings.minibatches,
                         shuffle_rng, getattr(scorer, "max_tokens", 0))  # rl.max_tokens_per_micro_batch: packed
    record = {"step": step, "rollout_version": gen.version,
              "reward": float(rewards.mean()), "loss": result["loss"], "grad_norm": result["grad_norm"],
              "kl": result["kl"], "num_updates": result["num_updates"], "temperature": settings.temperature,
              "texts": [it[1] for it in items], "completions": completions, "rewards": rewards.tolist(),
              "references": [it[2] for it in items],
              **{f"consistency/{k}": v for k, v in cons.items() if k != "kl_method"}, **corrected}
    if gen.version == step and (step == 0 or settings.check_sync):  # rollout vs trainer log-probs, same weights
        P = batch["prompt_len"]
        record["lp_diffs"] = torch.cat([(batch["old_log_probs"][i, P:P + len(r)] - gen.log_probs[i]).abs()
                                        for i, r in enumerate(gen.response_ids)])
    return record


def grpo_step(trainer, task, rollout, scorer, loss, settings: GRPOSettings, step: int, shuffle_rng) -> dict:
    """The synchronous step: sample with version ``step``, update, publish version ``step + 1``; the
    step's record (``handle``: the publish, not waited for unless ``check_sync``)."""
    items, params = sample_requests(task, settings, trainer.cfg.schedule.seed, step)
    gen = rollout.generate([ids for ids, _, _ in items], params, return_routing=True, min_version=step)
    record = update_on(trainer, task, scorer, loss, settings, step, shuffle_rng, items, gen)
    return {**record, **publish_record(trainer, rollout, settings, step, wait=False)}


def publish_record(trainer, rollout, settings: GRPOSettings, step: int, wait: bool) -> dict:
    """Publish version ``step + 1`` (returns at the snapshot; `wait`: also waits for the load);
    with ``check_sync`` wait for the load and compare what the rollout serves (costs the overlap)."""
    handle = rollout.publish(step + 1)
    served = None
    if wait or settings.check_sync:
        handle.wait_loaded()
    if settings.check_sync:
        served = check_sync(trainer, rollout, step + 1)
    return {"published_version": handle.version, "weight_sync/snapshot_s": handle.snapshot_s,
            "weight_sync/served_sha": served, "handle": handle}


def _quiet(*_a, **_k) -> None:
    return None


def run_grpo(trainer, task, rollout, settings: GRPOSettings, say: Callable = _quiet,
             scorer: Optional[PolicyScorer] = None) -> GRPORun:
    """`settings.steps` GRPO steps from the trainer's current weights (version 0 is published first).
    `scorer`: the trainer-side log-probs (default: a new `PolicyScorer`, keeping the starting policy
    as the KL reference when ``kl_coef`` is set). `say`: progress lines (rank 0 of a sharded run).
    ``rl.max_staleness`` > 0: rollout and training overlapped (`rl.overlap`)."""
    refuse_for_rollout(trainer.cfg.model.moe_capacity_factor)  # any rollout: vLLM drops nothing either
    rl, ckpt = trainer.cfg.rl, trainer.cfg.checkpoint
    if settings.checkpoint_every and not ckpt.dir:
        raise ValueError("GRPOSettings.checkpoint_every needs checkpoint.dir (where the trainer's checkpoints and the "
                         "loop's state go)")
    if ckpt.load and settings.kl_coef:
        raise ValueError("resuming GRPO (checkpoint.load) with kl_coef > 0: the KL reference (the starting policy) is "
                         "not in the checkpoint; resume with kl_coef=0")
    if rl.max_staleness and rl.staleness_policy == "drop" and settings.check_sync:
        raise ValueError("check_sync with rl.staleness_policy=drop: the rollout is generating when a version is "
                         "published, so its weights cannot be compared then; use staleness_policy=wait")
    start = time.perf_counter()
    if scorer is None:
        scorer = PolicyScorer(trainer, settings.micro_batch_size, keep_reference=bool(settings.kl_coef))
    loss = policy_loss_for(settings)
    run = GRPORun()
    shuffle_rng = random.Random(f"grpo-minibatches:{trainer.cfg.schedule.seed}")
    resumed = resume_loop(trainer, task, shuffle_rng, run, say) if ckpt.load else None
    first = resumed[0]["step"] if resumed else 0  # the version the trainer's weights are now
    rollout.publish(first).wait_loaded()
    if settings.check_sync:
        check_sync(trainer, rollout, first)
    if resumed is None:
        run.eval_before, run.eval_before_groups = greedy_eval(rollout, task, 0)
    say(f"greedy eval accuracy {run.eval_before:.3f} on {task.description}; rollout: {type(rollout).__name__}"
        + (f"; max staleness {rl.max_staleness} ({rl.staleness_policy})" if rl.max_staleness else ""), flush=True)
    say(f"{'step':>4} {'reward':>7} {'eval':>6} {'pearson':>9} {'experts':>8} {'sync ms':>8} {'loss':>8}"
        + (f" {'version':>7} {'span':>4} {'wait s':>6} {'kl b|p':>8}" if rl.max_staleness else ""), flush=True)
    steps = _overlapped_steps(trainer, task, rollout, scorer, loss, settings, shuffle_rng, run, resumed) \
        if rl.max_staleness else _synchronous_steps(trainer, task, rollout, scorer, loss, settings, shuffle_rng, run,
                                                    first)
    for record, handle in steps:
        run.history.append(record)
        say(f"{record['step']:>4} {record['reward']:>7.3f} {record.get('eval_acc', float('nan')):>6.3f} "
            f"{record['consistency/pearson']:>9.6f} {record.get('consistency/expert_agreement', float('nan')):>8.4f} "
            f"{handle.snapshot_s * 1e3:>8.1f} {record['loss']:>+8.4f}"
            + (f" {record['rollout_version']:>7} {record['async/version_span_max']:>4} {record['async/wait_s']:>6.2f}"
               f" {record['async/mismatch_kl']:>8.2e}" if rl.max_staleness else ""),
            flush=True)
    handle.wait_loaded()
    say(f"{settings.steps} GRPO steps in {time.perf_counter() - start:.0f} s", flush=True)
    return run


def _evaluate_after(record: dict, handle, rollout, task, settings: GRPOSettings, step: int) -> None:
    if step == settings.steps - 1 or (settings.eval_every and (step + 1) % settings.eval_every == 0):
        handle.wait_loaded()  # evaluate the policy this step produced
        record["eval_acc"], record["eval_groups"] = greedy_eval(rollout, task, step + 1)


def resume_loop(trainer, task, shuffle_rng, run: GRPORun, say: Callable) -> tuple[dict, list]:
    """Load the newest checkpoint of ``checkpoint.load`` (``auto``: of checkpoint.dir, as the CLI does) and the
    loop's state saved with it (`rl.resume`): the RNGs and ``run``'s accounting restored; (state, [(index, items,
    generation)] in flight)."""
    ckpt = trainer.cfg.checkpoint
    root = ckpt.dir if ckpt.load == "auto" else ckpt.load
    trainer.load_checkpoint(root)
    state, pending = load_state(root, trainer.step)
    set_rng_state(task.rng, state["sampler_rng"], "task sampler")
    set_rng_state(shuffle_rng, state["shuffle_rng"], "minibatch shuffle")
    run.eval_before, run.eval_before_groups = state["eval_before"], state["eval_before_groups"]
    run.dropped = state["dropped"]
    say(f"resumed GRPO at step {state['step']} (trainer step {trainer.step}) with batches "
        f"{[index for index, _, _ in pending]} in flight", flush=True)
    return state, pending


def save_loop(trainer, task, settings: GRPOSettings, step: int, shuffle_rng, run: GRPORun, launched: int,
              counter: Optional[StalenessCounter], pending: list) -> None:
    """After `step`, every ``checkpoint_every`` steps: the loop's state (`rl.resume`; rank 0 writes it),
    then the trainer's checkpoint (collective). `pending`: [(index, items, generation)] in flight."""
    if not settings.checkpoint_every or (step + 1) % settings.checkpoint_every:
        return
    root = trainer.cfg.checkpoint.dir
    if trainer.mesh.rank == 0:
        state = {"step": step + 1, "launched": launched, "trainer_step": trainer.step,
                 "sampler_rng": rng_state(task.rng), "shuffle_rng": rng_state(shuffle_rng),
                 "dropped": counter.dropped if counter else 0, "histogram": counter.histogram if counter else {},
                 "token_histogram": counter.token_histogram if counter else {}, "eval_before": run.eval_before,
                 "eval_before_groups": run.eval_before_groups}
        save_state(root, trainer.step, state, pending)
    trainer.save_checkpoint(root)


def _synchronous_steps(trainer, task, rollout, scorer, loss, settings: GRPOSettings, shuffle_rng, run: GRPORun,
                       first: int = 0):
    """Today's loop (``rl.max_staleness = 0``): (record, publish handle) per step from step `first`."""
    handle = None
    for step in range(first, settings.steps):
        if handle is not None:
            handle.wait_loaded()  # the rollout must serve the newest policy (raises WeightSyncError)
        record = grpo_step(trainer, task, rollout, scorer, loss, settings, step, shuffle_rng)
        handle = record.pop("handle")
        _evaluate_after(record, handle, rollout, task, settings, step)
        save_loop(trainer, task, settings, step, shuffle_rng, run, step + 1, None, [])
        yield record, handle


def version_metrics(gen, step: int, counter: StalenessCounter) -> dict:
    """Versions per token of the batch trained at `step`: the span (newest - oldest version) per
    sample (mean, max), the staleness of every token (a histogram {versions behind: tokens}, also
    summed over the run in `counter`; a token beyond the bound raises)."""
    spans, lags = [], []
    for i in range(len(gen.response_ids)):
        v = gen.versions_of(i)
        if len(v):
            spans.append(int(v.max() - v.min()))
            lags.append(step - v)
    lag = torch.cat(lags) if lags else torch.zeros(0, dtype=torch.long)
    hist = {int(n): int(c) for n, c in zip(*torch.unique(lag, return_counts=True))}
    counter.count_tokens(hist)
    return {"async/version_span_mean": sum(spans) / max(len(spans), 1), "async/version_span_max": max(spans, default=0),
            "async/token_staleness_mean": float(lag.double().mean()) if lag.numel() else 0.0,
            "async/token_staleness_max": int(lag.max()) if lag.numel() else 0, "token_staleness_histogram": hist}


def _overlapped_steps(trainer, task, rollout, scorer, loss, settings: GRPOSettings, shuffle_rng, run: GRPORun,
                      resumed: Optional[tuple] = None):
    """``rl.max_staleness = k`` > 0 (`rl.overlap`): batch m is generated on the rollout's thread with
    version max(0, m - k) (``wait``) or whatever it serves (``drop``) while the trainer updates on
    earlier batches; (record, publish handle) per step, with ``async/*`` metrics. `resumed`:
    (state, batches in flight) of `resume_loop`, taken as generated batches."""
    k, policy, seed = trainer.cfg.rl.max_staleness, trainer.cfg.rl.staleness_policy, trainer.cfg.schedule.seed
    gens = Generations(rollout, trainer.cfg.parallel.timeout_s)
    counter = StalenessCounter(k, policy)
    run.staleness_histogram, run.token_staleness_histogram = counter.histogram, counter.token_histogram
    pending: deque = deque()
    launched, handle, first = [0], None, 0
    if resumed is not None:
        state, batches = resumed
        first, launched[0], counter.dropped = state["step"], state["launched"], state["dropped"]
        counter.histogram.update(state["histogram"])
        counter.token_histogram.update(state["token_histogram"])
        for index, items, gen in batches:
            pending.append(gens.restore(index, items, [ids for ids, _, _ in items],
                                        sampling_params(settings, seed, index, len(items), task.stop_token_ids),
                                        sample_version(index, k) if policy == "wait" else None, gen))

    def launch() -> None:
        index = launched[0]
        launched[0] += 1
        items, params = sample_requests(task, settings, seed, index)
        version = sample_version(index, k) if policy == "wait" else None
        pending.append(gens.submit(index, items, [ids for ids, _, _ in items], params, version))

    try:
        for step in range(first, settings.steps):
            # wait: the rollout serves version `step` now; every batch it samples is launched.
            # drop: k + 1 batches in flight, no more than the run still needs.
            while (launched[0] <= min(step + k, settings.steps - 1)) if policy == "wait" else \
                    (len(pending) <= k and launched[0] - counter.dropped < settings.steps):
                launch()
            t0, dropped = time.perf_counter(), counter.dropped
            while True:
                batch = pending.popleft()
                gen = gens.collect(batch)
                if counter.accept(step, gen.version_range()[0]):  # the oldest token's version
                    break
                if counter.dropped - dropped > k + 1:  # the k + 1 in flight, then a fresh one after the load
                    raise RuntimeError(f"step {step}: {counter.dropped - dropped} batches dropped in a row, the last "
                                       f"sampled with version {gen.version} after version {step} was loaded: the "
                                       "rollout does not serve the versions it loads")
                if not pending and handle is not None:  # the replacement samples the newest version (bounds the drops)
                    handle.wait_loaded()
                launch()  # a fresh batch for the dropped one
            waited = time.perf_counter() - t0
            record = update_on(trainer, task, scorer, loss, settings, step, shuffle_rng, batch.items, gen)
            t0 = time.perf_counter()
            if policy == "wait":  # version step + 1 only once the batches of version <= step are generated
                for inflight in pending:
                    gens.wait(inflight)
            waited += time.perf_counter() - t0
            record.update(publish_record(trainer, rollout, settings, step, wait=policy == "wait"))
            handle = record.pop("handle")
            record.update({"sample_index": batch.index, "async/staleness": staleness(step, gen.version),
                           "async/wait_s": waited, "async/dropped": counter.dropped - dropped,
                           "async/rollout_busy_s": gens.busy_s, **version_metrics(gen, step, counter),
                           # behaviour (the rollout, version gen.version) vs proximal (the trainer at `step`)
                           "async/mismatch_kl": record["consistency/kl"],
                           "async/mismatch_expert_agreement": record.get("consistency/expert_agreement", math.nan)})
            _evaluate_after(record, handle, gens, task, settings, step)
            if settings.checkpoint_every and (step + 1) % settings.checkpoint_every == 0:
                save_loop(trainer, task, settings, step, shuffle_rng, run, launched[0], counter,
                          [(b.index, b.items, gens.wait(b)) for b in pending])
            yield record, handle
        assert not pending, f"batches {[b.index for b in pending]} were generated and never trained on"
    finally:
        run.dropped = counter.dropped
        gens.close()
