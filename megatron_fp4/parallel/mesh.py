"""The process groups of a layout: `ParallelMesh`, built from a validated `ParallelDims` (dims.py).

The groups come from `torch.distributed.device_mesh` (it runs on gloo and NCCL alike): the dense
grid ``pp × dp × tp`` is an `init_device_mesh`, the expert grid ``edp × ep × etp`` of each stage
its ``dp, tp`` ranks flattened and unflattened again (Megatron's parallel folding, see dims.py),
``world`` the whole mesh flattened. Only ``embed`` (pp > 1: the first and the last stage, which
hold the two copies of tied embeddings) is a group DeviceMesh cannot express (two stages that are
not a slice of the pp axis); the mesh creates it with `new_group`. Each rank's group lists equal
`ParallelDims.groups` (checked when built); ``mesh.device_mesh`` / ``mesh.expert_mesh`` are the
DeviceMeshes, for DTensor.

Nothing here is global: build a `ParallelMesh` once and pass it to whoever needs a group. A single
process is a mesh whose dims are all ones and that has no groups (`single()`).
Device and backend are decided in one place (`resolve_device`): gloo on CPU, NCCL on CUDA.

Every group the mesh creates (each axis, plus ``world`` for whole-mesh decisions such as the NaN
guard's) gets the same timeout, ``parallel.timeout_s``: a hung or stopped peer makes the waiting
collectives fail after that long instead of blocking for torch's default of 30 minutes, and
`peer_failure` turns that failure into a message naming this rank and its groups.

Elastic restarts (``torchrun --max-restarts N``): torchrun's agent hosts one TCPStore for the whole
job and, by default, hands it to every attempt's workers (TORCHELASTIC_USE_AGENT_STORE=True). torch
keys each group by a counter ("default_pg/0/...", "default_pg/1/..."), the same in every attempt,
so after a restart gloo's connectFullMesh can read the address a dead worker of the previous
attempt published ("Connection refused", or a hang). `_restart_store` gives each attempt its own
key prefix, ``megatron_fp4/attempt_<TORCHELASTIC_RESTART_COUNT>/``, on that same store.
"""
from __future__ import annotations

import dataclasses
import gc
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megatron_fp4.config.choices import check_choice
from megatron_fp4.parallel.dims import DENSE_AXES, EXPERT_AXES, ParallelDims, resolve_dp

__all__ = ["ParallelMesh", "ParallelDims", "resolve_dp", "resolve_device", "backend_for", "PeerFailureError",
           "world_size_from_env", "shutdown_process_groups"]


def resolve_device(preference: str = "auto") -> torch.device:
    """`auto` → CUDA (this process's LOCAL_RANK) when available, else CPU."""
    check_choice("device", preference, ("auto", "cpu", "cuda"))
    if preference == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is visible; use device=auto or cpu")
    if preference != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class PeerFailureError(RuntimeError):
    """A collective failed because a peer rank hung, stopped or died (timeout or lost connection)."""


# How the backends word a lost peer: gloo "Timed out waiting ...ms for recv", "Connection closed by
# peer", "Connection reset"; NCCL's watchdog "Watchdog caught collective operation timeout".
_PEER_FAILURE_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")


def world_size_from_env() -> int:
    """The number of processes of this job (torchrun's WORLD_SIZE; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def shutdown_process_groups(barrier: bool = True) -> None:
    """The end of a job, after its last collective and after dropping the objects that hold groups
    (trainer, mesh): with `barrier` (every rank ends here together) a barrier over the default
    group, so no rank tears down while a peer still waits in a collective with it; then every group
    destroyed, while the interpreter is alive. Nothing when torch.distributed is not initialized.

    Why not leave it to the process exit: a gloo worker thread completes a work (waking the rank's
    main thread in `wait`) *before* it drops its own reference to the work and so to the work's
    tensors. A main thread faster than that reaches interpreter finalization first; the worker's
    drop then frees a tensor that has a Python object, which takes the GIL, and a finalizing Python
    ends any thread taking the GIL (pthread_exit) -- inside a noexcept destructor: std::terminate,
    "terminate called without an active exception", SIGABRT, exit code -6, rarely and only under
    load. Destroying a group joins its worker threads (after their drop); a group still referenced
    from Python lives on with its threads, hence the collect first."""
    if not dist.is_initialized():
        return
    if barrier:
        dist.barrier()
    gc.collect()  # reference cycles of the finished trainer still holding groups
    dist.destroy_process_group()


def _restart_store(timeout_s: float):
    """Under torchrun's shared agent store: a client of it whose keys are prefixed by this restart
    attempt (see the module docstring). None otherwise (plain env:// rendezvous: rank 0 hosts a
    fresh store every attempt, nothing stale to read)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"megatron_fp4/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _size(axis: str) -> property:
    return property(lambda mesh: getattr(mesh.dims, axis), doc=f"``dims.{axis}``")


@dataclass
class ParallelMesh:
    """This rank's place in a layout: the layout's sizes (`dims`), its rank, device and process groups."""

    dims: ParallelDims = field(default_factory=ParallelDims)  # the sizes of every axis (validated by the builders)
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    groups: dict = field(default_factory=dict)  # axis -> ProcessGroup (None when single process)
    ranks: dict = field(default_factory=dict)  # axis -> list of global ranks in this rank's group
    timeout_s: float = 300.0  # of every group above
    device_mesh: Optional[object] = None  # DeviceMesh over DENSE_AXES (None when single process)
    expert_mesh: Optional[object] = None  # DeviceMesh over this stage's edp × ep × etp
    tp_meshes: dict = field(default_factory=dict)  # replicas -> the tp axis as a DeviceMesh (`tp_device_mesh`)

    # the sizes, read from `dims` (cp: the dp axis holds dp_data × cp ranks, dims.py; groups["cp"] one sequence's)
    world_size, pp, dp, tp, ep, etp, cp = map(_size, ("world_size", "pp", "dp", "tp", "ep", "etp", "cp"))

    @property
    def data_dp(self) -> int:
        """Data-parallel replicas (ranks reading different data): dp / cp."""
        return self.dp // self.cp

    @property
    def backend(self) -> str:
        return backend_for(self.device)

    def coord(self, axis: str) -> int:
        return self.dims.coords(self.rank)[axis]

    def size(self, axis: str) -> int:
        return self.dims.size(axis)

    def group(self, axis: str):
        return self.groups.get(axis)

    @property
    def is_distributed(self) -> bool:
        """Built over a torch.distributed process group (any size), not `single()`."""
        return bool(self.groups)

    @property
    def is_first_stage(self) -> bool:
        return self.coord("pp") == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord("pp") == self.pp - 1

    @classmethod
    def single(cls, device: Optional[torch.device] = None) -> "ParallelMesh":
        return cls(device=device or torch.device("cpu"))

    @classmethod
    def from_env(cls, cfg) -> "ParallelMesh":
        """The mesh of `cfg` for this process: torchrun's WORLD_SIZE, the layout of ``cfg.parallel``
        (validated: `ParallelDims.from_config`), ``cfg.device`` and ``parallel.timeout_s``; a mesh
        of size 1 for one process."""
        dims = ParallelDims.from_config(cfg, world_size_from_env())
        device = resolve_device(cfg.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if dims.world_size == 1 and not dist.is_initialized():
            return cls.single(device)
        return cls.from_dims(dims, device, cfg.parallel.timeout_s)

    @classmethod
    def build(cls, pp: int, dp: int, ep: int = 1, tp: int = 1, device: Optional[torch.device] = None,
              timeout_s: float = 300.0, etp: int = 1, cp: int = 1) -> "ParallelMesh":
        """Create (or join) the default process group and this rank's group on every axis of the
        layout ``pp × dp × tp`` (experts: ``edp × ep × etp``), checked against the world size.
        `dp` counts every rank holding the same parameters: data replicas × `cp`."""
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        return cls.from_dims(ParallelDims(world, pp, dp, tp, ep, etp, cp), device, timeout_s)

    @classmethod
    def from_dims(cls, dims: ParallelDims, device: Optional[torch.device] = None,
                  timeout_s: float = 300.0) -> "ParallelMesh":
        """The mesh of `dims` (validated here): the default process group joined (or created) and
        every group of every axis built, collectively, in the same order on every rank."""
        device = device or resolve_device("auto")
        if not dist.is_initialized():
            if "RANK" not in os.environ:
                if dims.pp * max(dims.dp, 1) * dims.tp != 1:
                    raise ValueError("a multi-process layout needs torchrun (RANK/WORLD_SIZE are not set)")
                return cls.single(device)
            store = _restart_store(timeout_s)
            if store is None:
                dist.init_process_group(backend_for(device), timeout=timedelta(seconds=timeout_s))
            else:
                dist.init_process_group(backend_for(device), timeout=timedelta(seconds=timeout_s), store=store,
                                        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        dims = dataclasses.replace(dims, world_size=dist.get_world_size()).validate()
        mesh = cls(dims, rank=dist.get_rank(), device=device, timeout_s=timeout_s)
        mesh._build_groups(dims)
        return mesh

    def _build_groups(self, dims: ParallelDims) -> None:
        """DeviceMesh for every axis it can express (dense grid, expert grid refolded from each
        stage's dp × tp ranks, the whole world flattened); `new_group` for ``embed``."""
        from torch.distributed.device_mesh import init_device_mesh

        options = self._group_options()  # every group: the mesh's timeout
        stage_axes = EXPERT_AXES[1:]  # edp, ep, etp: one stage's dp × tp ranks refolded
        dense = init_device_mesh(self.device.type, dims.shape(DENSE_AXES), mesh_dim_names=DENSE_AXES,
                                 backend_override=dict.fromkeys(DENSE_AXES, options))
        stage = dense["dp", "tp"]._flatten("dp_tp", backend_override=options)
        expert = stage._unflatten(0, dims.shape(stage_axes), stage_axes,
                                  backend_override=dict.fromkeys(stage_axes, options))
        world = dense._flatten("world", backend_override=options)
        self.device_mesh, self.expert_mesh = dense, expert
        built = {**{a: dense.get_group(a) for a in DENSE_AXES}, **{a: expert.get_group(a) for a in stage_axes},
                 "world": world.get_group("world")}
        for axis, group in built.items():
            ranks = dims.group_of(axis, self.rank)
            if dist.get_process_group_ranks(group) != ranks:  # torch's layout must be ours, rank for rank
                raise RuntimeError(f"DeviceMesh built the {axis} group {dist.get_process_group_ranks(group)}, "
                                   f"expected {ranks}")
            self.groups[axis], self.ranks[axis] = group, ranks
        for axis in ("embed", "cp") if dims.cp > 1 else ("embed",):  # embed: two non-adjacent stages
            for ranks in dims.groups(axis):
                group = self.new_group(ranks)
                if self.rank in ranks:
                    self.groups[axis], self.ranks[axis] = group, ranks

    def tp_device_mesh(self, replicas: int = 1):
        """The tp axis as a DeviceMesh (DTensor views of tp shards, e.g. in checkpoints); with
        `replicas` > 1 unflattened as (tp / replicas) shards × replicas (a kv head several ranks
        share). Collective the first time for each `replicas` (every rank, same order); cached."""
        if replicas not in self.tp_meshes:
            tp = self.device_mesh["tp"]
            self.tp_meshes[replicas] = tp if replicas == 1 else tp._unflatten(
                0, (self.tp // replicas, replicas), ("tp_shard", "tp_replica"),
                backend_override=dict.fromkeys(("tp_shard", "tp_replica"), self._group_options()))
        return self.tp_meshes[replicas]

    def _group_options(self):
        """Backend options carrying the mesh's timeout (DeviceMesh passes them to every group)."""
        backend = dist.ProcessGroupNCCL.Options() if self.backend == "nccl" else dist.ProcessGroupGloo._Options()
        backend._timeout = timedelta(seconds=self.timeout_s)
        return backend

    def new_group(self, ranks: list[int], pg_options=None):
        """A process group over `ranks` with the mesh's timeout (collective: every rank calls it for
        every group, in the same order). Whoever needs an extra group asks the mesh for it;
        `pg_options` are backend options (e.g. NCCL's CTA cap for GC-MoE's transfer group)."""
        return dist.new_group(ranks, timeout=timedelta(seconds=self.timeout_s), pg_options=pg_options)

    def second_group(self, axis: str, pg_options=None):
        """A second process group over this rank's `axis` ranks (for a thread that runs collectives
        beside the main one: gloo is not safe with two threads on one group). Collective the first
        time: every rank creates every group of the axis, in the same order; cached afterwards."""
        key = f"{axis}#2"
        if key not in self.groups and self.is_distributed:
            for ranks in self.dims.groups(axis):
                group = self.new_group(ranks, pg_options)
                if self.rank in ranks:
                    self.groups[key] = group
        return self.groups.get(key)

    def ranks_with(self, flag: bool) -> list[int]:
        """Global ranks whose `flag` is True: one all-reduce over the whole mesh, so every rank gets
        the same list and takes the same decision (the NaN guard's skip or stop)."""
        if self.world_size == 1 or self.group("world") is None:
            return [self.rank] if flag else []
        flags = torch.zeros(self.world_size, dtype=torch.float32, device=self.device)
        flags[self.rank] = float(flag)
        try:
            dist.all_reduce(flags, group=self.group("world"))
        except RuntimeError as err:
            raise (self.peer_failure(err) or err) from err
        return [r for r, v in enumerate(flags.tolist()) if v > 0]

    def peer_failure(self, err: BaseException) -> Optional[PeerFailureError]:
        """A clear error for a collective that failed because a peer hung or died, else None."""
        text = str(err)
        if not any(word in text.lower() for word in _PEER_FAILURE_WORDS):
            return None
        groups = ", ".join(f"{axis} {ranks}" for axis, ranks in self.ranks.items() if axis != "world" and len(ranks) > 1)
        first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
        return PeerFailureError(
            f"rank {self.rank}: a collective did not complete within parallel.timeout_s={self.timeout_s:g}s or lost "
            f"its peer: another rank of this job hung, was stopped or died (this rank's groups: {groups or 'none'}). "
            f"Check the other ranks' logs; raise parallel.timeout_s if steps legitimately take longer. "
            f"Backend said: {first}")
