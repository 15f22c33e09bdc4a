"""GRPO with MoEResQ on the embedded arithmetic task, on CPU in minutes.

    python examples/grpo_moeresq.py --steps 20 --sft-steps 150 --logdir outputs/grpo/tensorboard

Each step: the rollout engine (its own model copy, `fp4.rollout_mode`) samples `group_size`
answers per prompt; the reward is `check_answer`; advantages are group-normalised (GRPO); the
trainer recomputes old log-probs with `fp4.train_mode`, logs rollout-vs-train consistency, and
takes one clipped policy-gradient step with truncated IS (rollout vs old log-probs); then the
new weights are published to the rollout (two completion points: training resumes at snapshot,
the next rollout waits for the load). Reward, consistency and weight-sync latency go to TensorBoard.
`--sft-steps` first trains the LM objective so the policy has something to reinforce.
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_fp4.config import load_config  # noqa: E402
from megatron_fp4.rollout import (InProcessTransport, RolloutEngine, SamplingParams, WeightPublisher,  # noqa: E402
                                  WeightReceiver, compute_log_probs, consistency_metrics, pad_prompt_response,
                                  policy_loss)
from megatron_fp4.training.data import ArithmeticTokenizer, check_answer, make_problem  # noqa: E402
from megatron_fp4.training.trainer import Trainer  # noqa: E402

TOK = ArithmeticTokenizer()


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """rewards [num_prompts * group_size] (groups contiguous) -> (r - group mean) / (group std + eps)."""
    r = rewards.view(-1, group_size).double()
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + eps)).view(-1).float()


def make_batch(gen, rewards, group_size: int, trainer_model) -> dict:
    """Padded training batch with old (trainer-recomputed) and rollout log-probs at response positions."""
    batch = pad_prompt_response(gen.prompt_ids, gen.response_ids, TOK.pad_id)
    with torch.no_grad():
        old = compute_log_probs(trainer_model, batch["input_ids"], batch["attention_mask"], batch["response_mask"],
                                return_routing=True)
    rollout_lp = torch.zeros_like(old.log_probs)
    P = batch["prompt_len"]
    for i, lp in enumerate(gen.log_probs):
        rollout_lp[i, P:P + len(lp)] = lp
    batch.update(old_log_probs=old.log_probs, rollout_log_probs=rollout_lp, train_routing=old.routing,
                 advantages=grpo_advantages(rewards, group_size))
    return batch


def consistency(gen, batch) -> dict:
    P = batch["prompt_len"]
    train_lp = torch.cat([batch["old_log_probs"][i, P:P + len(r)] for i, r in enumerate(gen.response_ids)])
    train_rt = torch.cat([batch["train_routing"][i, P:P + len(r)] for i, r in enumerate(gen.response_ids)])
    return consistency_metrics(torch.cat(gen.log_probs), train_lp, torch.cat(gen.routing), train_rt)


def policy_update(trainer, batch: dict, micro_batch_size: int, clip_eps: float, tis_cap) -> dict:
    """One optimizer step on the GRPO loss through the trainer (clipping, NaN guard, LR schedule)."""
    keys = ("input_ids", "attention_mask", "response_mask", "old_log_probs", "rollout_log_probs", "advantages")
    B = batch["input_ids"].shape[0]
    micro = [{k: batch[k][s:s + micro_batch_size] for k in keys} for s in range(0, B, micro_batch_size)]

    def loss_fn(model, mb):
        lp = compute_log_probs(model, mb["input_ids"], mb["attention_mask"], mb["response_mask"]).log_probs
        return policy_loss(lp, mb["old_log_probs"], mb["advantages"][:, None], mb["response_mask"], clip_eps,
                           mb["rollout_log_probs"], tis_cap)
    return trainer.train_step_with_loss(micro, loss_fn)


def run(args) -> list:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    overrides = ["logging.tensorboard_dir=null", "checkpoint.dir=null", f"optimizer.lr={args.lr}",
                 "schedule.warmup_steps=0", f"schedule.train_steps={max(args.steps + args.sft_steps, 1)}",
                 f"model.vocab_size={TOK.vocab_size}"]  # no unused ids the decoder could not print
    cfg = load_config(args.config, overrides + list(args.override or []))
    trainer = Trainer(cfg, build_data=args.sft_steps > 0)
    for _ in range(args.sft_steps):
        trainer.train_step()
    engine = RolloutEngine(copy.deepcopy(trainer.model), mode=cfg.fp4.rollout_mode, pad_id=TOK.pad_id)
    publisher = WeightPublisher(trainer.model, [InProcessTransport(WeightReceiver(engine))], args.bucket_mb << 20)
    publisher.publish(0).wait_loaded()
    writer = None
    if args.logdir:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(args.logdir)
    rng = random.Random(f"grpo:{args.seed}")
    history, handle = [], None
    for step in range(args.steps):
        if handle is not None:
            handle.wait_loaded()  # the rollout must serve the newest policy (raises WeightSyncError)
        problems = [make_problem(rng, args.max_operand) for _ in range(args.num_prompts)]
        texts = [p for p, _ in problems for _ in range(args.group_size)]
        params = [SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 stop_token_ids=(TOK.eos_id,), seed=args.seed * 1_000_003 + step * 10_007 + i)
                  for i in range(len(texts))]
        gen = engine.generate([TOK.encode(t, add_eos=False) for t in texts], params, return_routing=True)
        completions = [TOK.decode(r, stop_at_eos=True) for r in gen.response_ids]
        rewards = torch.tensor([float(check_answer(t, c)) for t, c in zip(texts, completions)])
        batch = make_batch(gen, rewards, args.group_size, trainer.model)
        cons = consistency(gen, batch)
        result = policy_update(trainer, batch, args.micro_batch_size, args.clip_eps, args.tis_cap)
        handle = publisher.publish(step + 1)  # returns at snapshot: training could go on right now
        record = {"step": step, "rollout_version": gen.version, "published_version": handle.version,
                  "reward": float(rewards.mean()), "loss": result["loss"], "grad_norm": result["grad_norm"],
                  "weight_sync/snapshot_s": handle.snapshot_s, "texts": texts, "completions": completions,
                  "rewards": rewards.tolist(), **{f"consistency/{k}": v for k, v in cons.items() if k != "kl_method"}}
        if step == 0:  # before any update: rollout vs trainer log-probs of the same weights
            P = batch["prompt_len"]
            record["lp_diffs"] = torch.cat([(batch["old_log_probs"][i, P:P + len(r)] - gen.log_probs[i]).abs()
                                            for i, r in enumerate(gen.response_ids)])
        history.append(record)
        print(f"step {step}: v{gen.version} reward {record['reward']:.3f} loss {result['loss']:+.4f} "
              f"r(lp) {cons['pearson']:.6f} experts {cons.get('expert_agreement', float('nan')):.4f} "
              f"snapshot {handle.snapshot_s * 1e3:.1f} ms", flush=True)
    handle.wait_loaded()
    for record, h in zip(history, publisher.history[1:]):
        record["weight_sync/load_s"] = h.load_s
    if writer is not None:
        for r in history:
            for k, v in r.items():
                if isinstance(v, float) and k not in ("step",):
                    writer.add_scalar(k if "/" in k else f"grpo/{k}", v, r["step"])
        writer.close()
    history[-1]["final_rollout_version"] = engine.version
    return history


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parent / "configs" / "tiny_moe.yaml"))
    ap.add_argument("--override", action="append", help="dotted config override, e.g. fp4.scope=experts+attention")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sft-steps", type=int, default=150, help="LM warm-up steps before RL (0 = from scratch)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--max-operand", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip-eps", type=float, default=0.2)
    ap.add_argument("--tis-cap", type=float, default=2.0, help="truncated IS clip C (rollout vs old log-probs)")
    ap.add_argument("--bucket-mb", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--logdir", default="outputs/grpo/tensorboard")
    return ap.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
