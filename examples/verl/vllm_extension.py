"""verl's vLLM worker extension plus a read-back of the served weights, for `ppo_vllm`'s sync check.

    rollout.engine_kwargs.vllm.worker_extension_cls=vllm_extension.DigestExtension

`DigestExtension` is verl's `vLLMColocateWorkerExtension` (weight updates from the actor, everything
verl's vLLM server asks of its workers) with one method more, `megatron_fp4_weight_digests(path)`,
which verl's `vLLMHttpServer.collective_rpc` calls by name: SHA-256 per tensor, under HF names, of
what vLLM holds in its parameters (fused tensors split back, `integrations.vllm.readback`), written
as JSON to `path` (verl's `collective_rpc` returns nothing to its caller). vLLM imports it by name in
its worker: `ppo_vllm` puts this folder on the Ray workers' PYTHONPATH.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from megatron_fp4.integrations.vllm.readback import digests_of, hf_tensors_of


class DigestExtension(vLLMColocateWorkerExtension):
    def megatron_fp4_weight_digests(self, path: str) -> None:
        hf_cfg = json.loads((Path(self.model_runner.vllm_config.model_config.model) / "config.json").read_text())
        tmp = f"{path}.tmp{os.getpid()}"
        Path(tmp).write_text(json.dumps(digests_of(hf_tensors_of(self.model_runner.model, hf_cfg))))
        os.replace(tmp, path)
