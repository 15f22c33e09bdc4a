"""GRPO on the one `Trainer`, for every layout: group advantages, the RL batch (old, rollout and
reference log-probs at the response positions), PPO minibatch updates through
`Trainer.train_step_with_loss` with the `PolicyLoss` (the pipeline schedule when there is one).

Every trainer rank calls these with the same rollout batch and the same minibatch RNG, so every
rank builds the same batch and takes its data-parallel share of each minibatch: rank d of dp
holds the contiguous rows [d·B/dp, (d+1)·B/dp), cut into micro-batches of `micro_batch_size`, which
are exactly the single process's micro-batches (contiguous chunks of the same size), so the
gradient is the same mean over the same micro-batch losses.
"""
from __future__ import annotations

import random

import torch

from megatron_fp4.rl.algo import replay
from megatron_fp4.rl.algo.policy_loss import PolicyLoss
from megatron_fp4.rollout.consistency import consistency_metrics
from megatron_fp4.rollout.engine import pad_prompt_response
from megatron_fp4.training.forward_only import packed_micro_batches


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """rewards [num_prompts * group_size] (groups contiguous) -> (r - group mean) / (group std + eps)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not form groups of group_size={group_size}")
    r = rewards.view(-1, group_size).double()
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + eps)).view(-1).float()


def build_rl_batch(gen, rewards: torch.Tensor, group_size: int, scorer, pad_id: int,
                   router_replay: str = "off") -> dict:
    """Padded training batch of a `GenerationOutput`: tokens and masks (verl's layout), old log-probs
    (and the reference policy's) recomputed by the trainer (`scorer.score`), the rollout's
    log-probs at the response positions, and group-normalised advantages. `router_replay`
    (``rl.router_replay``, `rl/algo/replay.py`): r3 replays the rollout's routes in the scoring and puts
    them in the batch as ``replay_routing`` for the updates; r2 puts the old-log-prob pass's there."""
    replay.check_mode(router_replay)
    batch = pad_prompt_response(gen.prompt_ids, gen.response_ids, pad_id)
    routes = replay.rollout_routes(gen, batch) if router_replay == "r3" else None
    scored = scorer.score(batch, routes)
    if router_replay != "off":
        batch["replay_routing"] = routes if routes is not None else \
            replay.from_log_prob_alignment(scored["train_routing"])
    old = scored["old_log_probs"]
    rollout_lp = torch.zeros_like(old)
    P = batch["prompt_len"]
    for i, lp in enumerate(gen.log_probs):
        rollout_lp[i, P:P + len(lp)] = lp
    batch.update(old_log_probs=old, rollout_log_probs=rollout_lp, train_routing=scored["train_routing"],
                 advantages=grpo_advantages(rewards, group_size))
    if "ref_log_probs" in scored:
        batch["ref_log_probs"] = scored["ref_log_probs"]
    return batch


def response_values(batch: dict, key: str, gen) -> torch.Tensor:
    """`batch[key]` at every generated token, concatenated in request order."""
    P = batch["prompt_len"]
    return torch.cat([batch[key][i, P:P + len(r)] for i, r in enumerate(gen.response_ids)])


def consistency(gen, batch: dict) -> dict:
    """Rollout vs trainer log-probs of the same tokens (and expert agreement when both have routing)."""
    routing = batch.get("train_routing") is not None and gen.routing is not None
    return consistency_metrics(torch.cat(gen.log_probs), response_values(batch, "old_log_probs", gen),
                               torch.cat(gen.routing) if routing else None,
                               response_values(batch, "train_routing", gen) if routing else None)


def dp_share(trainer, num_rows: int) -> slice:
    """This rank's contiguous rows of a batch of `num_rows` (all of them without data parallelism)."""
    dp = trainer.mesh.dp
    if num_rows % dp:
        raise ValueError(f"a minibatch of {num_rows} rows does not split into {dp} equal data-parallel shares; "
                         f"make num_prompts × group_size / minibatches a multiple of dp={dp}")
    share = num_rows // dp
    return slice(trainer.mesh.coord("dp") * share, (trainer.mesh.coord("dp") + 1) * share)


def packed_updates(trainer, batch: dict, loss: PolicyLoss, max_tokens: int) -> list[dict]:
    """This rank's packed micro-batches of a minibatch (`training.forward_only.packed_micro_batches`:
    at most `max_tokens` tokens each, as many on every dp rank), each with its rollout correction per
    token and ``token_weight`` = its loss tokens · micro-batches · dp / the minibatch's loss tokens: the
    trainer's mean over micro-batches and dp ranks of the weighted token-means is then the token-mean
    over the whole minibatch (the padded path's, when its minibatch is one micro-batch)."""
    keys = loss.batch_keys + ("attention_mask",) + (("replay_routing",) if "replay_routing" in batch else ())
    padded = {**{k: batch[k] for k in keys}, **loss.corrections(batch)}
    micro = packed_micro_batches(padded, max_tokens, trainer.mesh, trainer.device)
    total = max(float(padded["loss_mask"].sum()), 1.0)
    scale = len(micro) * trainer.mesh.dp / total
    for mb in micro:
        mb["token_weight"] = float(mb["loss_mask"].sum()) * scale
    return micro


def policy_update(trainer, batch: dict, loss: PolicyLoss, micro_batch_size: int, max_tokens: int = 0) -> dict:
    """One optimizer step on the policy loss over `batch` (every rank passes the whole minibatch);
    `max_tokens` > 0: in packed micro-batches of at most that many tokens (`packed_updates`)."""
    if max_tokens:
        return trainer.train_step_with_loss(packed_updates(trainer, batch, loss, max_tokens), loss)
    rows = dp_share(trainer, batch["input_ids"].shape[0])
    start, stop = rows.start, rows.stop
    share = stop - start
    if trainer.pipeline is not None and (share % micro_batch_size or share // micro_batch_size < trainer.mesh.pp):
        raise ValueError(f"with parallel.pp={trainer.mesh.pp} each data-parallel share of a minibatch ({share} rows) "
                         f"must be at least pp micro-batches of the same size; micro_batch_size={micro_batch_size} "
                         f"is not (the pipeline's buffers are static): use a divisor of {share} of at most "
                         f"{share // trainer.mesh.pp}, or more rows per minibatch")
    keys = loss.batch_keys + (("replay_routing",) if "replay_routing" in batch else ())
    micro = [{k: batch[k][s:min(s + micro_batch_size, stop)].to(trainer.device) for k in keys}
             for s in range(start, stop, micro_batch_size)]
    return trainer.train_step_with_loss(micro, loss)


def ppo_updates(trainer, batch: dict, loss: PolicyLoss, micro_batch_size: int, ppo_epochs: int, minibatches: int,
                rng: random.Random, max_tokens: int = 0) -> dict:
    """`ppo_epochs` passes over the rollout batch, each cut into `minibatches` shuffled minibatches
    (one optimizer step each); the ratio to the old log-probs is what the clip then bounds.
    `max_tokens` > 0: packed micro-batches (`policy_update`).
    Returns the first step's result (loss of the policy that sampled) with the last step's kl."""
    B = batch["input_ids"].shape[0]
    per_sample = [k for k, v in batch.items() if torch.is_tensor(v) and v.shape[:1] == (B,)]
    results = []
    for _ in range(ppo_epochs):
        order = list(range(B))
        rng.shuffle(order)
        for chunk in (order[i::minibatches] for i in range(minibatches)):
            idx = torch.tensor(sorted(chunk))
            mini = {k: batch[k][idx] for k in per_sample}
            results.append(policy_update(trainer, mini, loss, micro_batch_size, max_tokens))
    return {**results[0], "kl": results[-1].get("kl", 0.0), "num_updates": len(results)}


def switch_to_rl(trainer, lr: float, weight_decay: float, aux_coef: float) -> None:
    """From SFT to RL: constant `lr`, weight decay `weight_decay`, a fresh Adam, router aux/z losses
    scaled by `aux_coef` (0: off, no auxiliary gradient at all). With every advantage 0 a step then
    leaves the weights bit-identical (tests/unit/test_rl_policy_loss.py)."""
    o = trainer.cfg.optimizer
    o.lr = o.min_lr = lr
    # AdamW's decay moves the weights even when the policy gradient is exactly 0 (all advantages 0).
    o.weight_decay = weight_decay
    # A fresh Adam for RL: SFT's momentum would otherwise keep pushing the LM direction for the
    # first RL steps (measured: greedy accuracy drifts down even with all advantages zeroed).
    trainer.reset_optimizer()
    for moe in trainer.model.moe_layers():
        moe.aux_loss_coef, moe.z_loss_coef = aux_coef, aux_coef * 0.1
