"""Supervised warm-up before RL, on any layout: response-only NLL of (prompt, solution) pairs from
verl-format rows, through the same data-parallel split and micro-batching as the policy updates
(`grpo.policy_update`), so the pipeline schedule runs it when there is one.

For the carry task (`rl.tasks.carry_task`) the target is the *sloppy teacher*'s solution,
which forgets each carry with probability `drop_carry`: the SFT policy then samples the carry
sometimes but greedy decoding drops it, which is what gives GRPO a rule to learn.
"""
from __future__ import annotations

import random

import torch

from megatron_fp4.rl.tasks import carry_task, math_task
from megatron_fp4.rl.algo.grpo import policy_update
from megatron_fp4.rollout.engine import pad_prompt_response, positions_from_mask
from megatron_fp4.rollout.scoring import log_probs_from_logits
from megatron_fp4.training.step_loss import StepLoss


class ResponseNLL(StepLoss):
    """Mean negative log-likelihood of the response tokens of a micro-batch in verl's layout
    (``input_ids``, ``attention_mask``, ``response_mask``): the SFT loss."""

    batch_keys = ("input_ids", "attention_mask", "response_mask")

    def model_inputs(self, mb: dict) -> dict:
        am = mb["attention_mask"]
        return {"tokens": mb["input_ids"], "positions": positions_from_mask(am), "attention_mask": am}

    def loss(self, logits: torch.Tensor, mb: dict):
        lp, _ = log_probs_from_logits(logits, mb["input_ids"], mb["response_mask"])
        mask = mb["response_mask"].to(lp.dtype)
        return -(lp * mask).sum() / mask.sum(), {}


def sft_pair(row: dict, tok, drop_carry: float, rng: random.Random) -> tuple[list, list]:
    """(prompt ids, target ids) of one row: its reference solution, or for the carry task the sloppy
    teacher's (each carry forgotten with probability `drop_carry`, drawn from `rng`)."""
    prompt, target = math_task.sft_text(row, tok)
    if row["data_source"] == carry_task.DATA_SOURCE:
        info = row["extra_info"]
        text = carry_task.teacher_solution({"a": info["a"], "b": info["b"]}, drop_carry, rng)
        target = tok.encode(text, add_special_tokens=False) + [tok.eos_id]
    return prompt, target


def sft_step(trainer, rows: list, tok, batch_size: int, micro_batch_size: int, drop_carry: float,
             rng: random.Random) -> dict:
    """One optimizer step of `ResponseNLL` on `batch_size` rows drawn from `rows` by `rng` (every
    rank passes the same rng state and takes its data-parallel share)."""
    picked = [rows[rng.randrange(len(rows))] for _ in range(batch_size)]
    pairs = [sft_pair(r, tok, drop_carry, rng) for r in picked]
    batch = pad_prompt_response([p for p, _ in pairs], [t for _, t in pairs], tok.pad_id)
    return policy_update(trainer, batch, RESPONSE_NLL, micro_batch_size)


RESPONSE_NLL = ResponseNLL()
