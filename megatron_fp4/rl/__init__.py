"""RL post-training on the one `Trainer`, for every layout (a layer on top of training, rollout and
the HF/vLLM integrations: it joins them). Everything RL lives here.

- `loop`: the GRPO loop (`GRPOSettings`, `run_grpo`: the GRPO example and the ablation run it);
  `overlap`: rollout and training overlapped with bounded staleness (``rl.max_staleness``);
  `evaluate`: the greedy held-out eval, the weight-sync check; `tasks`: the RL tasks
- `policy_loss`: `PolicyLoss` (the clipped policy loss as a training step's loss); `is_correction`:
  the rollout correction math (verl's TIS/MIS, rejection, mismatch metrics) and `policy_loss`;
  `rollout_correction`: verl's config fields, the batch-level step (`correct_batch`)
- `rewards`: rule-based rewards by data_source; `data`: verl-format RL datasets, the carry and math tasks

- `grpo`: group advantages, the RL batch (old/rollout/reference log-probs), PPO minibatch updates
  through the pipeline or not, `switch_to_rl`
- `scorer`: `PolicyScorer`, the trainer's log-probs of an RL batch on any layout
- `replay`: router replay (``rl.router_replay``: off | r2 | r3), the routes `build_rl_batch` replays
- `rollout_client`: `InProcessRollout`, `RemoteRollout` (a separate rollout process fed by the
  sharded publisher), `make_rollout`
- `sft`: the supervised warm-up (`ResponseNLL`, the carry task's sloppy teacher) on any layout
- `rollout_worker`: the rollout process; `wire`: generations as JSON + tensors between processes
"""
from megatron_fp4.rl.grpo import (build_rl_batch, consistency, grpo_advantages, policy_update, ppo_updates,
                                  response_values, switch_to_rl)
from megatron_fp4.rl.is_correction import Rejection, RolloutCorrection, policy_loss, truncated_is_weights
from megatron_fp4.rl.loop import GRPORun, GRPOSettings, run_grpo
from megatron_fp4.rl.policy_loss import PolicyLoss
from megatron_fp4.rl.rollout_client import InProcessRollout, RemoteRollout, make_rollout
from megatron_fp4.rl.scorer import PolicyScorer
from megatron_fp4.rl.sft import ResponseNLL, sft_pair, sft_step

__all__ = ["grpo_advantages", "build_rl_batch", "consistency", "policy_update", "ppo_updates", "response_values",
           "switch_to_rl", "PolicyScorer", "InProcessRollout", "RemoteRollout", "make_rollout",
           "ResponseNLL", "sft_pair", "sft_step", "GRPOSettings", "GRPORun", "run_grpo", "PolicyLoss", "policy_loss",
           "RolloutCorrection", "Rejection", "truncated_is_weights"]
