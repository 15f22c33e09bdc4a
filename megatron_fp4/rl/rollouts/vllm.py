"""vLLM as the GRPO rollout, in a process (and environment) of its own, synced every step.

    rollout = VLLMRollout(trainer, pad_id, bucket_bytes, work_dir="outputs/grpo/vllm",
                          python="/path/to/venv-vllm/bin/python")     # or env MEGATRON_FP4_VLLM_PYTHON
    rollout.publish(step).wait_loaded(); gen = rollout.generate(prompts, params, return_routing=True)

The same interface and channels as `rl.rollouts.client.RemoteRollout` (it is one): trainer rank 0
writes a shape template of the model (`export_for_vllm`: config.json with the plugin's
`quantization_config`, weights of a fresh init, replaced by the first publish), starts
`python -m megatron_fp4.rl.rollouts.vllm_server` on it (the vLLM python: `python=`, env
MEGATRON_FP4_VLLM_PYTHON, else this interpreter when vllm imports here; VLLM_MLA_DISABLE=1 in its
environment for DeepSeek-V3, `integrations.vllm.remote.family_env`) and serves the two
token-authenticated `PeerGroup`s. Weights go under HF names: a single-process trainer through a
`WeightPublisher`, a sharded one through the `ShardedWeightPublisher` (every rank's shard).
Two completion points as everywhere: `publish` returns at the snapshot, `wait_loaded` once vLLM
has loaded the version (`live.update_weights`: checked whole before anything is written).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import torch

from megatron_fp4.rl.rollouts.client import RemoteRollout, hf_publisher
from megatron_fp4.rollout.weight_sync.peer_group import new_sync_token, sync_token_from_env

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def served_dtype(cfg, kind: str) -> str:
    """vLLM's name of the trainer's dtype; ValueError for one vLLM does not serve here."""
    if cfg.dtype not in DTYPES:
        raise ValueError(f"--rollout {kind}: dtype {cfg.dtype!r} is not served (fp32 or bf16)")
    return DTYPES[cfg.dtype]


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


def vllm_template(cfg, work_dir) -> Path:
    """A shape template of the model for vLLM to start on (`export_for_vllm` of a fresh init, fp32 kept)."""
    from megatron_fp4.integrations.vllm import export_for_vllm
    from megatron_fp4.model import build_model

    return export_for_vllm(build_model(cfg), cfg, Path(work_dir) / "hf", dtype=None, overwrite=True)


class VLLMRollout(RemoteRollout):
    """`RemoteRollout` whose rollout process is vLLM + the plugin (module doc). Collective."""

    def __init__(self, trainer, pad_id: int, bucket_bytes: int = 4 << 20, work_dir="outputs/vllm_rollout",
                 python: Optional[str] = None, addr: str = "127.0.0.1", name: str = "vllm0",
                 timeout_s: Optional[float] = None, threads: int = 1):
        cfg = trainer.cfg
        dtype = served_dtype(cfg, "vllm")

        def launch():
            from megatron_fp4.integrations.vllm.remote import family_env

            template = vllm_template(cfg, work_dir)
            spec = {"model": str(template), "dtype": dtype, "pad_id": int(pad_id), "threads": int(threads)}
            return (resolve_python(python), "megatron_fp4.rl.rollouts.vllm_server", spec,
                    {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", **family_env(template)})
        self._start(trainer, bucket_bytes, addr, name, timeout_s, launch)


class VLLMServeRollout:
    """`--rollout vllm-serve`: the rollout is a `vllm serve` process (the plugin, vLLM's OpenAI server),
    weights pushed through vLLM's weight-transfer API (`integrations.vllm.serve.VLLMServerTransport`:
    start / update / finish over HTTP, the bytes over the token-authenticated PeerGroup), generations
    from its completions API. Same interface as `VLLMRollout` (collective); vLLM's HTTP API does not
    return routed experts on CPU, so `generate` returns `routing=None` (R3 needs `--rollout vllm`).
    Overlapped (``rl.max_staleness`` > 0, also under torchrun): `fetch` on rank 0's rollout thread,
    `share` on every rank. Versions: the version served when the request starts (/weight_info), for
    every token. Under ``wait`` no version is published while a batch generates, so that is exact;
    under ``drop`` a load may land during a request and vLLM's HTTP API does not say which tokens the
    new weights produced: the start version is then a lower bound, so the staleness bound still holds."""

    def __init__(self, trainer, pad_id: int, bucket_bytes: int = 4 << 20, work_dir="outputs/vllm_serve",
                 python: Optional[str] = None, addr: str = "127.0.0.1", name: str = "vllm-serve",
                 timeout_s: Optional[float] = None, max_num_seqs: int = 64):
        from megatron_fp4.integrations.vllm.serve import VLLMServerTransport, start_vllm_server

        cfg = trainer.cfg
        dtype = served_dtype(cfg, "vllm-serve")
        self.mesh, self.model_cfg, self.pad_id = trainer.mesh, cfg.model, int(pad_id)
        self.timeout_s = float(timeout_s or cfg.parallel.timeout_s)
        self.is_source = self.mesh.rank == 0
        self.server = self.transport = None
        transports = []
        if self.is_source:
            python, template = resolve_python(python), vllm_template(cfg, work_dir)
            token = sync_token_from_env() or new_sync_token()
            extra = ["--max-model-len", str(cfg.model.max_seq_len), "--max-num-seqs", str(int(max_num_seqs)),
                     "--kv-cache-memory-bytes", str(256 << 20)]
            self.server = start_vllm_server(template, python, token, host=addr, dtype=dtype, extra=extra,
                                            log=Path(work_dir) / "vllm_serve.log", timeout_s=self.timeout_s)
            try:
                self.transport = VLLMServerTransport(self.server.url, addr, name, self.timeout_s, token)
            except BaseException:
                self.server.stop()
                raise
            transports = [self.transport]
        self.publisher = hf_publisher(trainer, self.mesh, transports, bucket_bytes, self.timeout_s)

    def publish(self, version: int):
        return self.publisher.publish(version)

    def _one(self, prompt, p) -> tuple:
        body = {"model": self.server.model, "prompt": list(map(int, prompt)), "max_tokens": int(p.max_new_tokens),
                "temperature": float(p.temperature), "seed": p.seed, "stop_token_ids": list(p.stop_token_ids),
                "logprobs": 0, "return_tokens_as_token_ids": True}
        choices = self.server.client.choices(body, timeout=self.timeout_s)
        if len(choices) != 1:
            raise RuntimeError(f"{self.server.url}/v1/completions answered one prompt with {len(choices)} choices")
        toks, lp, reason = choices[0]
        return toks, torch.tensor(lp, dtype=torch.float32), "stop" if reason == "stop" else "length"

    def _generate(self, prompts, params, min_version: int):
        from concurrent.futures import ThreadPoolExecutor

        from megatron_fp4.rl.rollouts.vllm_server import check_params
        from megatron_fp4.rollout.engine import GenerationOutput

        for p in params:
            check_params(p)
        version = self._served()
        if version < min_version:  # the publisher's loaded point precedes this: a stale server is a bug
            raise RuntimeError(f"vllm serve serves version {version}, the request needs >= {min_version}")
        with ThreadPoolExecutor(max_workers=min(len(prompts), 64) or 1) as pool:  # one request each: vLLM batches
            done = list(pool.map(self._one, prompts, params))
        return GenerationOutput(prompt_ids=[list(map(int, q)) for q in prompts], response_ids=[d[0] for d in done],
                                log_probs=[d[1] for d in done], finish_reasons=[d[2] for d in done],
                                sampled_log_probs=[torch.zeros_like(d[1]) if p.temperature == 0 else d[1].clone()
                                                   for d, p in zip(done, params)], version=version, routing=None)

    def fetch(self, prompts, params, return_routing: bool = False, min_version: int = 0):
        """Rank 0 only: the server's generation, not yet shared (the overlapped loop's rollout thread)."""
        return self._generate(prompts, params, min_version)

    def share(self, gen, prompts, params, return_routing: bool = False):
        """Collective over the trainer mesh: rank 0's `gen` on every rank (`routing` None)."""
        from megatron_fp4.rl.rollouts.wire import broadcast_generation, expected_generation

        if not self.mesh.is_distributed:
            return gen
        expect = expected_generation(prompts, params, False, self.model_cfg)
        return broadcast_generation(gen, 0, self.mesh.group("world"), self.mesh.device, expect=expect)

    def generate(self, prompts, params, return_routing: bool = False, min_version: int = 0):
        """Collective: rank 0 asks the server, every rank gets the result (`routing` None, see the class doc)."""
        return self.share(self.fetch(prompts, params, return_routing, min_version) if self.is_source else None,
                          prompts, params, return_routing)

    def exit_code(self):
        """The server process's exit code if it has died (rank 0), else None."""
        return None if self.server is None else self.server.proc.poll()

    def _served(self) -> int:
        version = self.server.client.weight_version()
        return int(version) if version and version.isdigit() else 0

    def served_version(self) -> int:
        if not self.mesh.is_distributed:
            return self._served()
        import torch.distributed as dist

        version = torch.tensor([self._served() if self.is_source else 0], device=self.mesh.device)
        dist.broadcast(version, src=0, group=self.mesh.group("world"))
        return int(version)

    def digests(self) -> dict:
        raise ValueError("--check-sync reads vLLM's parameters back in its process: use --rollout vllm (vllm serve "
                         "exposes only its own checksums of its fused parameters)")

    def close(self) -> None:
        """Wait for the last update, release the transfer, stop the server (collective)."""
        self.publisher.wait()
        if not self.is_source:
            return
        try:
            self.transport.close()
        finally:
            self.server.stop()
