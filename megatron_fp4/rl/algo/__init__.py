"""The RL algorithm on the one `Trainer`: advantages, the policy loss and its rollout correction,
the trainer's log-probs of an RL batch, router replay, the SFT warm-up.

- `grpo`: group advantages, the RL batch (old/rollout/reference log-probs), PPO minibatch updates, `switch_to_rl`
- `policy_loss`: `PolicyLoss` (the decoupled, clipped policy loss as a training step's loss)
- `is_correction`: the rollout-correction math (TIS/MIS, rejection, mismatch metrics) and `policy_loss`;
  `rollout_correction`: verl's config fields and the batch-level step (`correct_batch`)
- `scorer`: `PolicyScorer`, the trainer's log-probs of an RL batch on any layout (through `Trainer.forward_rows`)
- `replay`: router replay (``rl.router_replay``: off | r2 | r3)
- `sft`: the supervised warm-up (`ResponseNLL`) on any layout
"""
