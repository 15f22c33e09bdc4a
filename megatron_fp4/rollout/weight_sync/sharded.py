"""Publishing from a sharded trainer: pipeline stages and expert shards gathered bucket by bucket.

    publisher = ShardedWeightPublisher(lambda: local_hf_state_dict(trainer.model), trainer.mesh,
                                       transports if rank == 0 else [], bucket_bytes=4 << 20)
    handle = publisher.publish(version)     # every trainer rank calls it (collective)

No rank ever holds the whole model (under tensor parallelism a stage's tp ranks all-gather its
cut weights whole at the snapshot, `full_tp_tensors`; the lowest one owns and sends them). Every
trainer rank calls `publish` with the same version:

1. *snapshot* (the first completion point, on every rank): a rank copies the tensors it *owns* —
   of its local tensors, those no lower rank also holds (dp and expert-dp replicas send once) —
   and returns; its share of the weights is all it copies.
2. *delivery*, in the background: the source rank (`src`, rank 0 of the mesh) walks the bucket plan
   (`buckets.plan_buckets`, computed on every rank from the same global manifest) and materialises
   one bucket at a time, receiving each chunk from its owner over a process group of its own;
   the owners' background threads send their chunks in the same order. Each bucket goes through
   the source's transports (in-process or `DistributedTransport`) as soon as it is complete and is
   then dropped, so the source holds its own share plus at most two buckets (the one being sent,
   still referenced by the consumer's loop, and the next one being gathered). `wait_loaded()` on the source
   is the second completion point (the rollouts loaded); on the other ranks it means "sent".

Which names and shapes exist is agreed once, at construction (collective): every rank's local
(name, shape, dtype) list goes round as JSON in a uint8 tensor (`parallel.wire`, never pickle).
"""
from __future__ import annotations

import weakref
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_fp4.parallel.wire import all_gather_json
from megatron_fp4.rollout.weight_sync.buckets import (Bucket, _bytes_of, manifest_from_json, manifest_of, manifest_to_json,
                                                      plan_buckets)
from megatron_fp4.rollout.weight_sync.publisher import PublishHandle, WeightPublisher


def agree_on_owners(local: dict, group) -> tuple[dict, dict]:
    """(global manifest name -> (shape, dtype) in rank-then-local order, owner group rank of each
    name: the lowest rank holding it). Collective over `group`; refuses ranks that disagree."""
    mine = manifest_to_json(manifest_of(local.items()))
    manifest, owners = {}, {}
    for rank, theirs in enumerate(all_gather_json(mine, group, what="name list")):
        for name, spec in manifest_from_json(theirs).items():
            if name in manifest and manifest[name] != spec:
                raise ValueError(f"rank {rank} holds {name!r} as {spec}, rank {owners[name]} as {manifest[name]}: "
                                 "replicas of one tensor must agree")
            if name not in manifest:
                manifest[name], owners[name] = spec, rank
    return manifest, owners


def full_tp_tensors(named: dict, model, mesh) -> dict:
    """`named` with every tensor-parallel shard (a view of a parameter of `model` that carries
    ``tp_shard``) replaced by the whole tensor, all-gathered over this rank's tp group (collective
    over it: the tp ranks of a stage list the same names in the same order). A kv head several
    ranks share (``tp_replicas``) is taken once. Expert-tensor parallel (``etp`` > 1): every HF
    per-expert tensor is this rank's ffn slice, all-gathered over the etp group along the ffn dim."""
    if mesh.tp == 1:
        return named
    etp = getattr(mesh, "etp", 1)
    shards = {(p.data_ptr(), tuple(p.shape)): p for p in model.parameters() if getattr(p, "tp_shard", None) is not None}
    out = {}
    for name, t in named.items():
        p = shards.get((t.data_ptr(), tuple(t.shape)))
        dim = _etp_dim(name) if etp > 1 else None
        if dim is not None:
            parts = [torch.empty_like(t) for _ in range(etp)]
            dist.all_gather(parts, t.contiguous(), group=mesh.group("etp"))
            out[name] = torch.cat(parts, dim=dim)
            continue
        if p is None:
            out[name] = t
            continue
        parts = [torch.empty_like(t) for _ in range(mesh.tp)]
        dist.all_gather(parts, t.contiguous(), group=mesh.group("tp"))
        out[name] = torch.cat(parts[::getattr(p, "tp_replicas", 1)], dim=p.tp_shard[0])
    return out


_ETP_DIMS = ((".gate_proj.weight", 0), (".up_proj.weight", 0), (".down_proj.weight", 1))  # the ffn dim


def _etp_dim(name: str):
    """The ffn dim of an HF per-expert tensor (None: not an expert's)."""
    if ".mlp.experts." not in name:
        return None
    dim = next((d for suffix, d in _ETP_DIMS if name.endswith(suffix)), None)
    if dim is None:
        raise ValueError(f"ShardedWeightPublisher under parallel.etp > 1: {name} is not a per-expert HF tensor "
                         "(an etp rank holds a slice of every expert); publish layout='checkpoint'")
    return dim


class _GatheredBuckets:
    """The source's buckets, each received from its owners when the transport reaches it."""

    def __init__(self, plan: list, owners: dict, snapshot: dict, group, me: int):
        self.plan, self.owners, self.snapshot, self.group, self.me = plan, owners, snapshot, group, me
        self.live_bytes = self.max_live_bytes = 0  # gathered buffers alive at once (the memory claim)

    def __len__(self) -> int:
        return len(self.plan)

    def layout(self) -> list:
        """(metas, nbytes) per bucket, without gathering anything."""
        return list(self.plan)

    def __iter__(self):
        for metas, nbytes in self.plan:
            yield self._gather(metas, nbytes)

    def _gather(self, metas: list, nbytes: int) -> Bucket:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.live_bytes += nbytes
        self.max_live_bytes = max(self.max_live_bytes, self.live_bytes)
        weakref.finalize(buffer, self._release, nbytes)
        for m in metas:
            if not m.chunk_size:
                continue
            piece = buffer[m.offset:m.offset + m.chunk_size]
            owner = self.owners[m.name]
            if owner == self.me:
                piece.copy_(_bytes_of(self.snapshot[m.name])[m.chunk_offset:m.chunk_offset + m.chunk_size])
            else:
                dist.recv(piece, group=self.group, group_src=owner)
        return Bucket(metas, buffer)

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes


class _Plan:
    """The bucket layout for `WeightPublisher`'s header without any bytes (`bucket_layout` reads
    `metas` and `nbytes`)."""

    def __init__(self, metas, nbytes):
        self.metas, self.nbytes = metas, nbytes


class ShardedWeightPublisher(WeightPublisher):
    """`WeightPublisher` over the shards of a mesh. `local_named()` returns this rank's tensors
    under global names (e.g. `integrations.hf.sharded.local_hf_state_dict(model)`); `transports`
    are given on the source rank only. Collective at construction and at every `publish`."""

    def __init__(self, local_named: Callable[[], dict], mesh, transports: Sequence = (), bucket_bytes: int = 4 << 20,
                 timeout_s: float = 600.0, src: int = 0, model=None):
        self.mesh, self.src = mesh, src
        if mesh.tp > 1:  # tp shards are published whole (`full_tp_tensors`): which tensors they are
            if model is None:
                raise ValueError("ShardedWeightPublisher under parallel.tp > 1 needs model= (the trainer's model, "
                                 "whose tensor-parallel shards local_named() returns) to publish them whole")
            sharded_named = local_named
            local_named = lambda: full_tp_tensors(sharded_named(), model, mesh)  # noqa: E731
        self.group = mesh.new_group(list(range(mesh.world_size)))  # the gather's own group (a thread uses it)
        self.me = dist.get_rank(self.group)
        self.is_src = self.me == src
        if self.is_src and not transports:
            raise ValueError("the source rank of a ShardedWeightPublisher needs at least one transport")
        if not self.is_src and transports:
            raise ValueError(f"transports go to the source rank ({src}) only; rank {self.me} got {len(transports)}")
        super().__init__(local_named, list(transports) or [_NoTransport()], bucket_bytes, timeout_s)
        self.manifest, self.owners = agree_on_owners(local_named(), self.group)
        self.plan = plan_buckets(self.manifest, bucket_bytes)
        self.snapshot_bytes = 0
        self.gathered: list = []  # the source's _GatheredBuckets of each version (memory checks)

    def _snapshot(self) -> tuple[dict, list]:
        local = self._named()
        snapshot = {name: t.detach().clone() for name, t in local.items() if self.owners[name] == self.me}
        self.snapshot_bytes = sum(t.numel() * t.element_size() for t in snapshot.values())
        if self.is_src:
            buckets = _GatheredBuckets(self.plan, self.owners, snapshot, self.group, self.me)
            self.gathered.append(buckets)
            return self.manifest, buckets
        self._owned = snapshot
        return self.manifest, [_Plan(metas, nbytes) for metas, nbytes in self.plan]

    def _deliver(self, handle: PublishHandle, manifest: dict, buckets, t_ready: float) -> None:
        if self.is_src:
            return super()._deliver(handle, manifest, buckets, t_ready)
        try:  # an owner: send my chunks in plan order
            for metas, _ in self.plan:
                for m in metas:
                    if m.chunk_size and self.owners[m.name] == self.me:
                        piece = _bytes_of(self._owned[m.name])[m.chunk_offset:m.chunk_offset + m.chunk_size]
                        dist.send(piece.clone(), group=self.group, group_dst=self.src)
        finally:
            self._owned = {}
            handle.loaded.set()


class _NoTransport:
    """Placeholder on ranks that only send their shards to the source."""

    name = "shards-to-source"

    def send(self, version, manifest, buckets) -> None:  # pragma: no cover - never called
        raise AssertionError("a non-source rank delivers through _deliver")

