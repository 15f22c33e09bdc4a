"""What the trainer asks of a rollout, whatever serves it (`megatron_fp4.rl.rollouts.make_rollout`
builds one of each kind; verl drives its own through `megatron_fp4.verl.rollout`).

    rollout = make_rollout("engine", trainer, pad_id, bucket_bytes)   # collective under torchrun
    handle = rollout.publish(version)        # returns once the snapshot exists: keep training
    handle.wait_loaded()                     # the rollout now serves `version` (or WeightSyncError)
    gen = rollout.generate(prompts, params)  # the same GenerationOutput on every trainer rank
    rollout.served_version(); rollout.digests(); rollout.close()

Weights keep the model's own names inside one process and travel under the family's HF names
across a process boundary (what vLLM, SGLang and verl load).
"""
from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from megatron_fp4.rollout.engine import GenerationOutput
from megatron_fp4.rollout.weight_sync.publisher import PublishHandle


@runtime_checkable
class Rollout(Protocol):
    """A rollout fed by the trainer's weights. Collective: every trainer rank constructs it and calls
    `publish`, `generate` and `close`; `is_source` is the rank that talks to the rollout."""

    is_source: bool

    def publish(self, version: int) -> PublishHandle:
        """Snapshot the trainer's weights as `version` and send them; returns at the snapshot."""

    def generate(self, prompts: Sequence, params: Sequence, return_routing: bool = False,
                 min_version: int = 0) -> GenerationOutput:
        """Generate with a version ≥ `min_version` (waiting for its load); every rank gets the result."""

    def served_version(self) -> int:
        """The weight version the rollout serves now."""

    def digests(self) -> dict:
        """Source rank: ``{"version", "digests": HF name -> SHA-256}`` of the weights served."""

    def close(self) -> None:
        """Wait for publishes in flight, stop the rollout's processes and groups."""
