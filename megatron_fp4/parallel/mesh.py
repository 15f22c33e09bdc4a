"""The parallel layout as a value: named axes ``pp``, ``dp``, ``ep`` (``tp`` reserved) and their groups.

Rank order follows Megatron (tp fastest, then dp, then pp): ``rank = (pp_rank·dp + dp_rank)·tp + tp_rank``.
Expert-parallel groups are carved out of the data-parallel ranks: within one pipeline stage the dp
ranks form a grid ``edp × ep`` with ``ep`` fastest, so

- ``ep_group``:  ranks that hold different experts of the same MoE layer (all-to-all partners);
- ``edp_group``: ranks that hold the *same* experts (the data-parallel group of expert params);
- ``embed``: (pp > 1) the dp ranks of the first and of the last stage, which hold the two copies of
  tied embeddings (Megatron's embedding group): their gradients are reduced over it.

Nothing here is global: build a `ParallelMesh` once and pass it to whoever needs a group.
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

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megatron_fp4.config_validate import resolve_dp


def resolve_device(preference: str = "auto") -> torch.device:
    """`auto` → CUDA (this process's LOCAL_RANK) when available, else CPU."""
    if preference not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={preference!r} must be one of auto, cpu, cuda")
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


def layout_coords(rank: int, pp: int, dp: int, ep: int, tp: int = 1) -> dict:
    """Pure: this rank's coordinate on every axis."""
    tp_rank = rank % tp
    dp_rank = (rank // tp) % dp
    pp_rank = rank // (tp * dp)
    return {"pp": pp_rank, "dp": dp_rank, "tp": tp_rank, "ep": dp_rank % ep, "edp": dp_rank // ep}


def layout_groups(pp: int, dp: int, ep: int, tp: int = 1) -> dict[str, list[list[int]]]:
    """Pure: every group of every axis as lists of global ranks (what `new_group` is called with)."""
    def rank_of(p, d, t=0):
        return (p * dp + d) * tp + t

    groups: dict[str, list[list[int]]] = {"pp": [], "dp": [], "ep": [], "edp": [], "tp": [], "embed": []}
    for d in range(dp):
        for t in range(tp):
            groups["pp"].append([rank_of(p, d, t) for p in range(pp)])
    for p in range(pp):
        for t in range(tp):
            groups["dp"].append([rank_of(p, d, t) for d in range(dp)])
            for e_dp in range(dp // ep):
                groups["ep"].append([rank_of(p, e_dp * ep + e, t) for e in range(ep)])
            for e in range(ep):
                groups["edp"].append([rank_of(p, e_dp * ep + e, t) for e_dp in range(dp // ep)])
        for d in range(dp):
            groups["tp"].append([rank_of(p, d, t) for t in range(tp)])
    if pp > 1:  # tied embeddings: the first stage's embedding and the last stage's head, all dp ranks
        for t in range(tp):
            groups["embed"].append([rank_of(p, d, t) for p in (0, pp - 1) for d in range(dp)])
    return groups


def _restart_store(timeout_s: float):
    """Under torchrun's shared agent store: a client of it whose keys are prefixed by this restart
    attempt (see the module docstring). None otherwise (plain env:// rendezvous: rank 0 hosts a
    fresh store every attempt, nothing stale to read)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"megatron_fp4/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


@dataclass
class ParallelMesh:
    pp: int = 1
    dp: int = 1
    ep: int = 1
    tp: int = 1
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    groups: dict = field(default_factory=dict)  # axis -> ProcessGroup (None when single process)
    ranks: dict = field(default_factory=dict)  # axis -> list of global ranks in this rank's group
    timeout_s: float = 300.0  # of every group above

    @property
    def backend(self) -> str:
        return backend_for(self.device)

    def coord(self, axis: str) -> int:
        return layout_coords(self.rank, self.pp, self.dp, self.ep, self.tp)[axis]

    def size(self, axis: str) -> int:
        return {"pp": self.pp, "dp": self.dp, "ep": self.ep, "tp": self.tp, "edp": self.dp // self.ep,
                "embed": 2 * self.dp if self.pp > 1 else self.dp, "world": self.world_size}[axis]

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
        (dp = -1: what the world leaves after pp and tp), ``cfg.device`` and ``parallel.timeout_s``;
        a mesh of size 1 for one process. `cfg` must be validated for this world size
        (`Trainer` does it, once)."""
        world = world_size_from_env()
        p = cfg.parallel
        pp, dp, ep, tp = p.pp, resolve_dp(cfg, world), p.ep, p.tp
        device = resolve_device(cfg.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if world == 1 and not dist.is_initialized():
            return cls.single(device)
        return cls.build(pp, dp, ep, tp, device=device, timeout_s=p.timeout_s)

    @classmethod
    def build(cls, pp: int, dp: int, ep: int = 1, tp: int = 1, device: Optional[torch.device] = None,
              timeout_s: float = 300.0) -> "ParallelMesh":
        """Create (or join) the default process group and this rank's group on every axis.

        Every rank calls `new_group` for every group in the same order, as torch requires."""
        device = device or resolve_device("auto")
        if not dist.is_initialized():
            if "RANK" not in os.environ:
                if pp * dp * tp != 1:
                    raise ValueError("a multi-process layout needs torchrun (RANK/WORLD_SIZE are not set)")
                return cls.single(device)
            store = _restart_store(timeout_s)
            if store is None:
                dist.init_process_group(backend_for(device), timeout=timedelta(seconds=timeout_s))
            else:
                dist.init_process_group(backend_for(device), timeout=timedelta(seconds=timeout_s), store=store,
                                        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        world, rank = dist.get_world_size(), dist.get_rank()
        if pp * dp * tp != world:
            raise ValueError(f"pp×dp×tp = {pp}×{dp}×{tp} != world size {world}; fix parallel.* or the process count")
        if dp % ep:
            raise ValueError(f"ep={ep} must divide dp={dp}")
        mesh = cls(pp=pp, dp=dp, ep=ep, tp=tp, rank=rank, world_size=world, device=device, timeout_s=timeout_s)
        lists_by_axis = {**layout_groups(pp, dp, ep, tp), "world": [list(range(world))]}
        for axis, lists in lists_by_axis.items():
            for ranks in lists:
                group = mesh.new_group(ranks)
                if rank in ranks:
                    mesh.groups[axis], mesh.ranks[axis] = group, ranks
        return mesh

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
            for ranks in layout_groups(self.pp, self.dp, self.ep, self.tp)[axis]:
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
