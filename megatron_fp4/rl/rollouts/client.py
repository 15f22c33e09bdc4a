"""The trainer's view of its rollout engine: `publish(version)` and `generate(...)`, whatever the layout.

    rollout = make_rollout("engine", trainer, pad_id, bucket_bytes)    # collective under torchrun
    handle = rollout.publish(step)                           # returns at the snapshot
    handle.wait_loaded()                                     # the next rollout waits for the load
    gen = rollout.generate(prompts, params)                  # the same GenerationOutput on every rank

- `InProcessRollout` (a single process, as the GRPO example always ran): the engine holds its own
  copy of the model, fed by a `WeightPublisher` through an `InProcessTransport` under the model's
  own names (HF names are for crossing a process boundary).
- `RemoteRollout` (a sharded trainer under torchrun): trainer rank 0 starts the rollout process
  (`python -m megatron_fp4.rl.rollouts.worker_main`, spec as JSON on its command line, the shared token
  in its environment, never pickle) and serves two token-authenticated `PeerGroup`s on the
  address it advertises: *weights* (a `ShardedWeightPublisher` over the whole mesh gathers pipeline
  stages and expert shards bucket by bucket and sends them under HF names through a
  `DistributedTransport`) and *control* (generation requests as JSON, results as JSON + tensors).
  Rank 0 then broadcasts each generation to every trainer rank (`rl.rollouts.wire`), so all ranks build
  the same RL batch. Two completion points as everywhere: `publish` returns on every rank once
  its own shard is snapshotted; `wait_loaded` on rank 0 returns once the rollout has loaded it.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_fp4.integrations.hf.sharded import local_hf_state_dict
from megatron_fp4.parallel.wire import broadcast_json
from megatron_fp4.rl.rollouts.worker import weight_digests
from megatron_fp4.rl.rollouts.wire import broadcast_generation, expected_generation, params_to_json
from megatron_fp4.rollout.engine import RolloutEngine
from megatron_fp4.rollout.weight_sync.peer_group import TOKEN_ENV, PeerGroup, new_sync_token, reserve_port, sync_token_from_env
from megatron_fp4.rollout.weight_sync.publisher import InProcessTransport, WeightPublisher, WeightReceiver
from megatron_fp4.rollout.weight_sync.distributed import DistributedTransport
from megatron_fp4.rollout.weight_sync.sharded import ShardedWeightPublisher

# torchrun's variables: the rollout process is not a rank of the trainer's job.
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


class InProcessRollout:
    """The engine in this process (a single-process trainer): its own copy of the model, fed by a
    `WeightPublisher` through an `InProcessTransport` under the model's own names (nothing crosses a
    process boundary, so nothing is renamed)."""

    def __init__(self, trainer, pad_id: int, bucket_bytes: int = 1 << 20, name: str = "rollout0"):
        cfg = trainer.cfg
        self.engine = RolloutEngine(copy.deepcopy(trainer.model), mode=cfg.fp4.rollout_mode, pad_id=pad_id, name=name,
                                    invariance=cfg.numerics.invariance, inflight_updates=cfg.rl.inflight_updates)
        self.publisher = WeightPublisher(lambda: trainer.model.state_dict().items(),
                                         [InProcessTransport(WeightReceiver(self.engine))], bucket_bytes)

    @property
    def is_source(self) -> bool:
        return True

    def publish(self, version: int):
        return self.publisher.publish(version)

    def generate(self, prompts: Sequence, params: Sequence, return_routing: bool = False, min_version: int = 0):
        return self.engine.generate(prompts, list(params), return_routing=return_routing)

    def served_version(self) -> int:
        return self.engine.version

    def digests(self) -> dict:
        return {"version": self.engine.version, "digests": weight_digests(self.engine.model)}

    def close(self) -> None:
        self.publisher.wait()


class RemoteRollout:
    """The engine on a process of its own, fed by every rank of a sharded trainer (see the module doc).
    Collective: every trainer rank constructs it and calls `publish`, `generate` and `close`."""

    def __init__(self, trainer, pad_id: int, bucket_bytes: int = 4 << 20, addr: str = "127.0.0.1",
                 name: str = "rollout0", timeout_s: Optional[float] = None, threads: int = 1):
        self._start(trainer, bucket_bytes, addr, name, timeout_s, lambda: (
            sys.executable, "megatron_fp4.rl.rollouts.worker_main",
            {"config": trainer.cfg.to_dict(), "pad_id": int(pad_id), "threads": int(threads)}, {}))

    def _start(self, trainer, bucket_bytes: int, addr: str, name: str, timeout_s: Optional[float], launch) -> None:
        """Rank 0 starts the rollout process (``launch()`` → python, module, spec, extra env: called on
        rank 0 only) and joins its weights and control groups; every rank builds the publisher."""
        self.mesh, self.model_cfg = trainer.mesh, trainer.cfg.model
        self.timeout_s = float(timeout_s or trainer.cfg.parallel.timeout_s)
        self.is_source = self.mesh.rank == 0
        self.proc = self.control = self.weights = None
        self._device = torch.device("cpu")
        transports = []
        if self.is_source:
            python, module, spec, extra_env = launch()
            token = sync_token_from_env() or new_sync_token()
            weights_socket, control_socket = reserve_port(addr), reserve_port(addr)
            spec = dict(spec, addr=addr, name=name, timeout_s=self.timeout_s,
                        weights_port=weights_socket.getsockname()[1], control_port=control_socket.getsockname()[1])
            env = _worker_env(token)
            env.update(extra_env)
            self.proc = subprocess.Popen([python, "-m", module, json.dumps(spec)], env=env)
            self.weights, self.control = self._join(lambda: (
                PeerGroup(addr, spec["weights_port"], 0, 2, self._device, self.timeout_s, weights_socket, token=token),
                PeerGroup(addr, spec["control_port"], 0, 2, self._device, self.timeout_s, control_socket, token=token)))
            self.transport = DistributedTransport(self.weights, src=0, name=name)
            transports = [self.transport]
        self.publisher = hf_publisher(trainer, self.mesh, transports, bucket_bytes, self.timeout_s)

    def _join(self, build):
        """`build()` (the groups' join, which blocks until the rollout process joins), failing fast
        with its exit code if the rollout process dies first instead of waiting for the timeout."""
        result = {}

        def target():
            try:
                result["value"] = build()
            except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread
                result["error"] = err
        thread = threading.Thread(target=target, name="rollout-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            if thread.is_alive() and self.proc.poll() is not None:
                raise RuntimeError(f"the rollout process exited with code {self.proc.returncode} before joining the "
                                   "trainer (its error is printed above)")
        if "error" in result:
            self.proc.kill()
            raise result["error"]
        return result["value"]

    def publish(self, version: int):
        return self.publisher.publish(version)

    def _request(self, request: dict) -> dict:
        broadcast_json(request, 0, self.control, self._device)
        status = broadcast_json(None, 1, self.control, self._device)
        if not isinstance(status, dict) or status.get("error", "") is not None:
            error = status.get("error") if isinstance(status, dict) else status
            raise RuntimeError(f"the rollout process failed {request['op']!r}: {str(error)[:2000]}")
        return status

    def fetch(self, prompts: Sequence, params: Sequence, return_routing: bool = False, min_version: int = 0):
        """Rank 0 only: the rollout process's generation (not yet shared with the other ranks; the
        overlapped loop runs this on a thread of its own while the trainer works)."""
        expect = expected_generation(prompts, params, return_routing, self.model_cfg)
        self._request({"op": "generate", "prompts": expect["prompt_ids"],
                       "params": [params_to_json(p) for p in params], "return_routing": bool(return_routing),
                       "min_version": int(min_version)})
        return broadcast_generation(None, 1, self.control, expect=expect)

    def share(self, gen, prompts: Sequence, params: Sequence, return_routing: bool = False):
        """Collective over the trainer mesh: rank 0's `gen` (from `fetch`) on every rank."""
        if not self.mesh.is_distributed:
            return gen
        expect = expected_generation(prompts, params, return_routing, self.model_cfg)
        return broadcast_generation(gen, 0, self.mesh.group("world"), self.mesh.device, expect=expect)

    def generate(self, prompts: Sequence, params: Sequence, return_routing: bool = False, min_version: int = 0):
        """Collective over the trainer mesh: rank 0 asks the rollout process, every rank gets the result."""
        gen = self.fetch(prompts, params, return_routing, min_version) if self.is_source else None
        return self.share(gen, prompts, params, return_routing)

    def served_version(self) -> int:
        """The version the rollout process serves now (collective: asked by rank 0, sent to all)."""
        if not self.mesh.is_distributed:
            return int(self._request({"op": "version"})["version"])
        version = torch.tensor([self._request({"op": "version"})["version"] if self.is_source else 0],
                               device=self.mesh.device)
        dist.broadcast(version, src=0, group=self.mesh.group("world"))
        return int(version)

    def exit_code(self) -> Optional[int]:
        """The rollout process's exit code if it has died (rank 0), else None."""
        return None if self.proc is None else self.proc.poll()

    def digests(self) -> dict:
        """Rank 0 only: {"version", "digests": HF name -> SHA-256} of the weights the rollout serves."""
        status = self._request({"op": "digests"})
        return {"version": status["version"], "digests": status["digests"]}

    def close(self) -> None:
        """Wait for the last update, stop the rollout process (collective). A rollout process that
        already died is not waited for: one RuntimeError with its exit code."""
        if self.is_source and self.proc.poll() is not None:
            self.weights.close()
            self.control.close()
            raise RuntimeError(f"the rollout process had exited with code {self.proc.returncode} before close()")
        self.publisher.wait()
        if not self.is_source:
            return
        try:
            self.transport.close()
            broadcast_json(None, 0, self.control, self._device)
            code = self.proc.wait(timeout=self.timeout_s)
            if code != 0:
                raise RuntimeError(f"the rollout process exited with code {code}")
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.weights.close()
            self.control.close()


def _worker_env(token: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV}
    env[TOKEN_ENV] = token
    root = str(Path(__file__).resolve().parents[2])  # the rollout process imports this same tree
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def hf_publisher(trainer, mesh, transports: list, bucket_bytes: int, timeout_s: float):
    """The trainer's weights under HF names: a sharded trainer's every rank (`ShardedWeightPublisher`),
    else one `WeightPublisher`; `transports` on rank 0 only."""
    named = lambda: local_hf_state_dict(trainer.model)  # noqa: E731
    if mesh.is_distributed:
        return ShardedWeightPublisher(named, mesh, transports, bucket_bytes, timeout_s, model=trainer.model)
    return WeightPublisher(lambda: named().items(), transports, bucket_bytes, timeout_s)
