"""verl rollout replica "megatron_fp4" (`RolloutReplicaRegistry`, the registry verl's trainer and
agent loop resolve `actor_rollout_ref.rollout.name` through, beside vllm/sglang/trtllm).

verl's agent loop never calls a rollout directly: it sends each request to a replica's server
actor (`server.generate.remote(prompt_ids=..., sampling_params=..., request_id=...)` -> `TokenOutput`)
and drives sleep/wake-up through it. vLLM's server is a separate engine process; ours has no engine
of its own: the model lives in the verl worker that holds the `MegatronFP4Rollout` (the hybrid
`ActorRolloutRefWorker.rollout`, or `CheckpointEngineWorker.server_adapter` in colocated/standalone
mode, where verl's checkpoint engine delivers the weights), and `MegatronFP4Server` forwards each
call into that worker with Ray's `__ray_call__` (which runs a function on the actor instance, as
verl's own replicas use it to read a worker's node and devices).

Needs Ray for `launch_servers` (the server is a Ray actor next to its worker). Text only: no
multi-modal inputs, no OpenAI HTTP endpoint (`server_address` is None); requests go through
`server_handle`, which is what verl's agent loop uses.
"""
from __future__ import annotations

from typing import Any, Optional

from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

NAME = "megatron_fp4"


def find_rollout(worker):
    """The MegatronFP4Rollout a verl worker instance holds (hybrid worker, checkpoint-engine worker, or
    either inside verl's fused/colocated worker dict)."""
    from megatron_fp4.verl.rollout import MegatronFP4Rollout

    candidates = [getattr(worker, "rollout", None), getattr(worker, "server_adapter", None)]
    for inner in list(getattr(worker, "worker_dict", {}).values()) + list(getattr(worker, "fused_worker_dict", {}).values()):
        candidates += [getattr(inner, "rollout", None), getattr(inner, "server_adapter", None)]
    for candidate in candidates:
        if isinstance(candidate, MegatronFP4Rollout):
            return candidate
    raise ValueError(f"{type(worker).__name__} holds no MegatronFP4Rollout; set actor_rollout_ref.rollout.name="
                     f"{NAME} so verl's workers build it")


def _generate_on_worker(worker, prompt_ids, sampling_params, seed):
    return find_rollout(worker).generate_tokens(prompt_ids, sampling_params, seed)


def _call_on_worker(worker, method: str, *args):
    """Run the rollout's async `resume`/`release` to completion right here: Ray's `__ray_call__` does
    not await, and they never suspend (they only mark what is resident; nothing is offloaded on CPU)."""
    coro = getattr(find_rollout(worker), method)(*args)
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError(f"MegatronFP4Rollout.{method} suspended; it must complete without awaiting")


class MegatronFP4Server:
    """The per-replica server verl's agent loop talks to. `workers` are the handles of the verl worker
    actors of this replica (one: the rollout runs in one process)."""

    def __init__(self, config=None, model_config=None, rollout_mode=None, workers=(), replica_rank: int = 0,
                 node_rank: int = 0, **kwargs):
        if len(workers) != 1:
            raise ValueError(f"a megatron_fp4 rollout replica runs in one worker process, got {len(workers)}; "
                             "set actor_rollout_ref.rollout.tensor_model_parallel_size=1 (and data/pipeline 1)")
        self.config, self.model_config, self.rollout_mode = config, model_config, rollout_mode
        self.worker = workers[0]
        self.replica_rank, self.node_rank = replica_rank, node_rank

    async def _on_worker(self, fn, *args):
        return await self.worker.__ray_call__.remote(fn, *args)

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Optional[list] = None, video_data: Optional[list] = None,
                       audio_data: Optional[list] = None, mm_processor_kwargs: Optional[dict] = None,
                       priority: int = 0, **kwargs) -> TokenOutput:
        if image_data or video_data or audio_data:
            raise ValueError(f"request {request_id}: the megatron_fp4 rollout is text-only")
        return await self._on_worker(_generate_on_worker, list(prompt_ids), dict(sampling_params), None)

    async def wake_up(self):
        await self._on_worker(_call_on_worker, "resume", ["weights", "kv_cache"])

    async def sleep(self):
        await self._on_worker(_call_on_worker, "release")

    async def clear_kv_cache(self):
        pass  # the KV cache lives per request; nothing outlives a generate call

    release_kv_cache = resume_kv_cache = clear_kv_cache

    async def abort_all_requests(self, reject_request: bool = False) -> dict:
        return {"aborted_count": 0, "request_ids": []}  # requests run to completion inside one call

    async def resume_generation(self):
        pass

    async def start_profile(self, **kwargs):
        pass

    async def stop_profile(self):
        pass


class MegatronFP4Replica(RolloutReplica):
    """verl's `RolloutReplica` for rollout.name "megatron_fp4": one worker per replica, one server."""

    server_cls = MegatronFP4Server

    def rollout_worker_use_gpu(self) -> bool:
        from verl.utils.device import get_device_name

        return get_device_name() != "cpu"

    async def launch_servers(self):
        import ray

        if len(self.workers) != self.world_size or self.world_size != 1:
            raise ValueError(f"replica {self.replica_rank}: {len(self.workers)} workers for world size "
                             f"{self.world_size}; a megatron_fp4 replica is one worker (tensor/data/pipeline "
                             "parallel size 1)")
        node_id = await self.workers[0].__ray_call__.remote(lambda worker: ray.get_runtime_context().get_node_id())
        server = ray.remote(self.server_cls).options(
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=node_id,
                                                                                             soft=False),
            name=f"megatron_fp4_server_{self.replica_rank}{self.name_suffix}", max_concurrency=self.max_concurrency,
            num_cpus=0,
        ).remote(config=self.config, model_config=self.model_config, rollout_mode=self.rollout_mode,
                 workers=self.workers, replica_rank=self.replica_rank)
        self.servers = [server]
        self._server_handle = server


RolloutReplicaRegistry.register(NAME, lambda: MegatronFP4Replica)
