"""The task runner and trainer of `ppo_vllm`: verl's own, plus checks.

`CheckedTaskRunner.run` is verl's v0 `TaskRunner.run` (`main_ppo_v0`) cut to what this run uses (no
critic, reward model or teacher): verl's `BaseTaskRunner` builds the actor/rollout worker group and
the resource pool, verl's `create_rl_dataset` reads the parquet files, and `CheckedPPOTrainer` (a
`RayPPOTrainer`) runs `init_workers()` and `fit()`. The subclass adds, and changes nothing else:

- after every `checkpoint_manager.update_weights` (the sync before the first rollout and after each
  update): the actor's weights as the engine hands them to the rollout (`get_per_tensor_param`, HF
  names) against the weights vLLM serves (`vllm_extension.DigestExtension`), SHA-256 per tensor;
- at every step's old-log-prob pass: max |old_log_probs (actor) - rollout_log_probs (vLLM)| over the
  response tokens.

Records go as JSON lines to the file named by MEGATRON_FP4_PPO_CHECKS (and stdout). Ray's workers
import this module by name (`ppo_vllm` puts this folder on their PYTHONPATH).
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile

import ray
import torch.distributed as dist
from verl.trainer.main_ppo_v0 import BaseTaskRunner
from verl.trainer.ppo.ray_trainer import RayPPOTrainer, Role
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.rollout.replica import RolloutReplicaRegistry
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMReplica

from megatron_fp4.integrations.vllm.readback import digests_of

ENV_CHECKS = "MEGATRON_FP4_PPO_CHECKS"


def _record(rec: dict) -> None:
    print("ppo_vllm check:", json.dumps(rec), flush=True)
    with open(os.environ[ENV_CHECKS], "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")


def _actor_digests(actor) -> dict:
    """On the worker-group actor (verl may fuse roles into a `WorkerDict`): the engine's sync tensors."""
    worker = actor.worker_dict.get("actor_rollout", next(iter(actor.worker_dict.values()))) \
        if hasattr(actor, "worker_dict") else actor
    params, _ = worker.actor.engine.get_per_tensor_param()
    return digests_of(dict(params))


class GlooActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's hybrid worker with torch.distributed started on gloo first: verl's
    `initialize_global_process_group_ray` asks torch for `cpu:gloo,cpu:gloo` on the CPU platform, which
    torch rejects, and leaves an initialised group as it is (verl's Worker has set RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT in this process)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def _node_id(actor) -> tuple[str, str]:
    return ray.get_runtime_context().get_node_id(), ""


class _NodeQuery:
    """Stands in for a worker handle while verl's `vLLMReplica.launch_servers` asks every worker for
    (node id, `get_accelerator_ids()[get_resource_name()][0]`): Ray has no accelerator ids under "CPU"
    (KeyError), so this asks for the node id only and gives no device list (vLLM's CPU build runs on
    CPU cores). verl's server keeps the handles only to count them."""

    def __init__(self, handle):
        self.handle, self.__ray_call__ = handle, self

    def remote(self, fn):
        return self.handle.__ray_call__.remote(_node_id)


class CPUvLLMReplica(vLLMReplica):
    """verl's vLLM replica; `launch_servers` (verl's) runs with `_NodeQuery` handles, nothing else differs."""

    async def launch_servers(self):
        workers, self.workers = self.workers, [_NodeQuery(w) for w in self.workers]
        try:
            await super().launch_servers()
        finally:
            self.workers = workers


class CheckedPPOTrainer(RayPPOTrainer):
    def init_workers(self):
        super().init_workers()
        update = self.checkpoint_manager.update_weights

        def checked_update(global_steps=None):
            result = update(global_steps)
            self._check_sync(global_steps)
            return result

        self.checkpoint_manager.update_weights = checked_update

    def _check_sync(self, global_steps) -> None:
        ours = ray.get(self.actor_rollout_wg.workers[0].__ray_call__.remote(_actor_digests))
        served = {}
        for r, replica in enumerate(self.checkpoint_manager.replicas):
            for s, server in enumerate(replica.servers):
                fd, path = tempfile.mkstemp(prefix="vllm_digests.", suffix=".json")
                os.close(fd)
                ray.get(server.collective_rpc.remote("megatron_fp4_weight_digests", kwargs={"path": path}))
                with open(path, encoding="utf-8") as f:
                    served[f"{r}.{s}"] = json.load(f)
                os.unlink(path)
        differ = {k: sorted(n for n in set(ours) | set(d) if ours.get(n) != d.get(n)) for k, d in served.items()}
        _record({"kind": "sync", "global_steps": global_steps, "tensors": len(ours), "servers": len(served),
                 "weights_sha256": hashlib.sha256(repr(sorted(ours.items())).encode()).hexdigest(),
                 "equal": bool(served) and not any(differ.values()),
                 "differ": {k: v[:4] for k, v in differ.items() if v}})

    def _compute_old_log_prob(self, batch):
        old, mfu = super()._compute_old_log_prob(batch)
        if "rollout_log_probs" in batch.batch.keys():
            mask = batch.batch["response_mask"].bool()
            diff = (old.batch["old_log_probs"].float() - batch.batch["rollout_log_probs"].float()).abs()[mask]
            _record({"kind": "step", "global_steps": self.global_steps, "tokens": int(mask.sum()),
                     "max_abs_logprob_diff": float(diff.max()) if diff.numel() else 0.0,
                     "mean_abs_logprob_diff": float(diff.mean()) if diff.numel() else 0.0,
                     "abs_logprob_diffs": diff.tolist()})
        return old, mfu


@ray.remote(num_cpus=1)
class CheckedTaskRunner(BaseTaskRunner):
    def run(self, config):
        from omegaconf import OmegaConf
        from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler
        from verl.utils.config import omega_conf_to_dataclass
        from verl.utils.dataset.rl_dataset import collate_fn
        from verl.workers.config import HFModelConfig

        OmegaConf.resolve(config)
        RolloutReplicaRegistry.register("vllm", lambda: CPUvLLMReplica)  # in this process only
        _, worker_group_cls = self.add_actor_rollout_worker(config)
        for role in (Role.ActorRollout, Role.ActorRolloutRef):
            if role in self.role_worker_mapping:
                self.role_worker_mapping[role] = ray.remote(GlooActorRolloutRefWorker)
        model_config: HFModelConfig = omega_conf_to_dataclass(config.actor_rollout_ref.model)
        pools = self.init_resource_pool_mgr(config)
        data = {split: create_rl_dataset(files, config.data, model_config.tokenizer, model_config.processor,
                                         is_train=split == "train")
                for split, files in (("train", config.data.train_files), ("val", config.data.val_files))}
        trainer = CheckedPPOTrainer(config=config, tokenizer=model_config.tokenizer, processor=model_config.processor,
                                    role_worker_mapping=self.role_worker_mapping, resource_pool_manager=pools,
                                    ray_worker_group_cls=worker_group_cls, train_dataset=data["train"],
                                    val_dataset=data["val"], collate_fn=collate_fn,
                                    train_sampler=create_rl_sampler(config.data, data["train"]))
        trainer.init_workers()
        trainer.fit()
