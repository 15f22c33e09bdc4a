"""The rollout side of the GRPO loop: where generations come from.

- `factory`: `make_rollout(kind, ...)`, the one way to get a rollout of each kind (engine,
  engine-process, vllm, vllm-serve); every kind is a `megatron_fp4.rollout.protocol.Rollout`
- `client`: `InProcessRollout`, `RemoteRollout` (a separate rollout process fed by the sharded
  publisher)
- `worker`: the rollout process; `worker_main` its entry (`python -m megatron_fp4.rl.rollouts.worker_main`)
- `vllm`: `VLLMRollout` (vLLM with the plugin in a process of its own); `vllm_server`: that process
- `wire`: generations as JSON headers + tensors between processes, never pickle
"""
