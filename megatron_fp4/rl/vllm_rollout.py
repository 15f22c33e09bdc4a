"""vLLM as the GRPO rollout, in a process (and environment) of its own, synced every step.

    rollout = VLLMRollout(trainer, pad_id, bucket_bytes, work_dir="outputs/grpo/vllm",
                          python="/path/to/venv-vllm/bin/python")     # or env MEGATRON_FP4_VLLM_PYTHON
    rollout.publish(step).wait_loaded(); gen = rollout.generate(prompts, params, return_routing=True)

The same interface and channels as `rl.rollout_client.RemoteRollout` (it is one): trainer rank 0
writes a shape template of the model (`export_for_vllm`: config.json with the plugin's
`quantization_config`, weights of a fresh init, replaced by the first publish), starts
`python -m megatron_fp4.rl.vllm_server` on it (the vLLM python: `python=`, env
MEGATRON_FP4_VLLM_PYTHON, else this interpreter when vllm imports here) and serves the two
token-authenticated `PeerGroup`s. Weights go under HF names: a single-process trainer through a
`WeightPublisher`, a sharded one through the `ShardedWeightPublisher` (every rank's shard).
Two completion points as everywhere: `publish` returns at the snapshot, `wait_loaded` once vLLM
has loaded the version (`live.update_weights`: checked whole before anything is written).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch

from megatron_fp4.integrations.hf.sharded import local_hf_state_dict
from megatron_fp4.rl.rollout_client import RemoteRollout, _worker_env
from megatron_fp4.rollout.peer_group import PeerGroup, new_sync_token, reserve_port, sync_token_from_env
from megatron_fp4.rollout.weight_sync import WeightPublisher
from megatron_fp4.rollout.weight_sync_dist import DistributedTransport
from megatron_fp4.rollout.weight_sync_sharded import ShardedWeightPublisher

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def resolve_python(python: Optional[str]) -> str:
    """The vLLM environment's python (remote.vllm_python), else this one if vllm imports here."""
    from megatron_fp4.integrations.vllm import vllm_available
    from megatron_fp4.integrations.vllm.remote import ENV_PYTHON, vllm_python

    found = vllm_python(python)
    if found:
        return found
    cap = vllm_available()
    if not cap:
        raise RuntimeError(f"--rollout vllm: {cap.reason}; pass --vllm-python or set {ENV_PYTHON} to the vLLM venv's "
                           "python (tools/vllm_env.sh creates one)")
    return sys.executable


class VLLMRollout(RemoteRollout):
    """`RemoteRollout` whose rollout process is vLLM + the plugin (module doc). Collective."""

    def __init__(self, trainer, pad_id: int, bucket_bytes: int = 4 << 20, work_dir="outputs/vllm_rollout",
                 python: Optional[str] = None, addr: str = "127.0.0.1", name: str = "vllm0",
                 timeout_s: Optional[float] = None, threads: int = 1):
        cfg = trainer.cfg
        if cfg.dtype not in DTYPES:
            raise ValueError(f"--rollout vllm: dtype {cfg.dtype!r} is not served (fp32 or bf16)")
        self.mesh, self.model_cfg = trainer.mesh, cfg.model
        self.timeout_s = float(timeout_s or cfg.parallel.timeout_s)
        self.is_source = self.mesh.rank == 0
        self.proc = self.control = self.weights = None
        self._device = torch.device("cpu")
        transports = []
        if self.is_source:
            from megatron_fp4.integrations.vllm import export_for_vllm
            from megatron_fp4.model import build_model

            python = resolve_python(python)
            template = export_for_vllm(build_model(cfg), cfg, Path(work_dir) / "hf", dtype=None, overwrite=True)
            token = sync_token_from_env() or new_sync_token()
            weights_socket, control_socket = reserve_port(addr), reserve_port(addr)
            spec = {"model": str(template), "dtype": DTYPES[cfg.dtype], "addr": addr, "pad_id": int(pad_id),
                    "weights_port": weights_socket.getsockname()[1], "control_port": control_socket.getsockname()[1],
                    "name": name, "timeout_s": self.timeout_s, "threads": int(threads)}
            env = _worker_env(token)
            env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"})
            self.proc = subprocess.Popen([python, "-m", "megatron_fp4.rl.vllm_server", json.dumps(spec)],
                                         env=env)
            self.weights, self.control = self._join(lambda: (
                PeerGroup(addr, spec["weights_port"], 0, 2, self._device, self.timeout_s, weights_socket, token=token),
                PeerGroup(addr, spec["control_port"], 0, 2, self._device, self.timeout_s, control_socket, token=token)))
            self.transport = DistributedTransport(self.weights, src=0, name=name)
            transports = [self.transport]
        named = lambda: local_hf_state_dict(trainer.model)  # noqa: E731
        self.publisher = ShardedWeightPublisher(named, self.mesh, transports, bucket_bytes, self.timeout_s,
                                                model=trainer.model) \
            if self.mesh.is_distributed else WeightPublisher(lambda: named().items(), transports, bucket_bytes,
                                                              self.timeout_s)

    def generate(self, prompts, params, return_routing: bool = False, min_version: int = 0):
        if self.mesh.is_distributed:
            return super().generate(prompts, params, return_routing, min_version)
        from megatron_fp4.rl.wire import broadcast_generation, expected_generation, params_to_json

        expect = expected_generation(prompts, params, return_routing, self.model_cfg)
        self._request({"op": "generate", "prompts": expect["prompt_ids"], "params": [params_to_json(p) for p in params],
                       "return_routing": bool(return_routing), "min_version": int(min_version)})
        return broadcast_generation(None, 1, self.control, expect=expect)

    def served_version(self) -> int:
        if self.mesh.is_distributed:
            return super().served_version()
        return int(self._request({"op": "version"})["version"])
