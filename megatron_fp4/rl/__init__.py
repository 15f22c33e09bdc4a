"""RL post-training on the one `Trainer`, for every layout (a layer on top of training, rollout and
the HF/vLLM integrations: it joins them). Everything RL lives here.

- `loop`: the GRPO loop (`GRPOSettings`, `run_grpo`); `overlap`: rollout and training overlapped
  with bounded staleness (``rl.max_staleness``); `evaluate`: the greedy held-out eval, the
  weight-sync check; `flags`: the example's command-line flags
- `algo/`: advantages, the policy loss and rollout correction, scoring, router replay, SFT
- `rollouts/`: the rollout clients and the rollout process
- `tasks/`: tasks, rewards, verl-format RL datasets
"""
from megatron_fp4.rl.algo.grpo import (build_rl_batch, consistency, grpo_advantages, policy_update, ppo_updates,
                                       response_values, switch_to_rl)
from megatron_fp4.rl.algo.is_correction import Rejection, RolloutCorrection, policy_loss, truncated_is_weights
from megatron_fp4.rl.loop import GRPORun, GRPOSettings, run_grpo
from megatron_fp4.rl.algo.policy_loss import PolicyLoss
from megatron_fp4.rl.rollouts.client import InProcessRollout, RemoteRollout
from megatron_fp4.rl.rollouts.factory import ROLLOUT_KINDS, make_rollout
from megatron_fp4.rl.algo.scorer import PolicyScorer
from megatron_fp4.rl.algo.sft import ResponseNLL, sft_pair, sft_step

__all__ = ["grpo_advantages", "build_rl_batch", "consistency", "policy_update", "ppo_updates", "response_values",
           "switch_to_rl", "PolicyScorer", "InProcessRollout", "RemoteRollout", "make_rollout", "ROLLOUT_KINDS",
           "ResponseNLL", "sft_pair", "sft_step", "GRPOSettings", "GRPORun", "run_grpo", "PolicyLoss", "policy_loss",
           "RolloutCorrection", "Rejection", "truncated_is_weights"]
