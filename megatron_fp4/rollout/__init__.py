"""Rollout: KV-cache generation with the training numerics, weight sync, consistency metrics.

- `engine`: `RolloutEngine`, `GenerationOutput`, padding helpers; `sampling`: `SamplingParams`
- `scoring`: `TokenLogProbs` (the one per-micro-batch scoring: the Trainer's on a layout), `compute_log_probs`,
  `score` (it on a bare single-process model)
- `weight_sync/`: the two-completion-point protocol (`WeightPublisher`, `WeightReceiver`,
  `InProcessTransport`, `PublishHandle`, `WeightSyncError`), across processes, from sharded
  trainers, its wire format and its authenticated process group
- `consistency`: `consistency_metrics`, `compare_generation`

The rollout correction and the policy losses that apply it are RL: `megatron_fp4.rl.algo.is_correction`.
"""
from megatron_fp4.rollout.consistency import compare_generation, consistency_metrics
from megatron_fp4.rollout.engine import GenerationOutput, RolloutEngine, pad_prompt_response
from megatron_fp4.rollout.sampling import SamplingParams
from megatron_fp4.rollout.scoring import compute_log_probs, score
from megatron_fp4.rollout.weight_sync.publisher import (InProcessTransport, PublishHandle, WeightPublisher, WeightReceiver,
                                                        WeightSyncError)

__all__ = [
    "RolloutEngine", "GenerationOutput", "SamplingParams", "pad_prompt_response", "compute_log_probs", "score",
    "WeightPublisher", "WeightReceiver", "InProcessTransport", "PublishHandle", "WeightSyncError",
    "consistency_metrics", "compare_generation",
]
