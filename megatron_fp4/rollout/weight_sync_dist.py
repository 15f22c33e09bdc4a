"""Weight sync across processes: torch.distributed broadcast on a dedicated group (gloo or NCCL).

    # trainer process (rank `src` of `group`)
    publisher = WeightPublisher(model, [DistributedTransport(group, src=0)])
    # each rollout process
    DistributedReceiver(WeightReceiver(engine), group, src=0).start()   # background thread

One update, all on `group` (created by the caller with `dist.new_group`, so it never collides with
training collectives; or any object with `rank()`, `size()`, `broadcast(tensor, src)`,
`broadcast_object(obj, src)` and `gather_object(obj, dst)` — a group of its own outside
torch.distributed's registry, ranks being its group ranks, e.g. verl's `integrations.verl.topology.PeerGroup`):
  1. broadcast the header: version, manifest {name: (shape, dtype)}, bucket layout (metas, bytes)
  2. gather every rollout's verdict on the manifest; broadcast go / no-go. A mismatch stops the
     update here: no bucket is sent and nothing is overwritten.
  3. broadcast the buckets one by one into fresh receive buffers (the rollout's staging copy)
  4. every rollout swaps them in (engine write lock) and the verdicts are gathered again.
A `None` header tells the receivers to stop.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.distributed as dist

from megatron_fp4.rollout.buckets import Bucket, bucket_layout
from megatron_fp4.rollout.weight_sync import WeightSyncError


def _is_peer_group(group) -> bool:
    return hasattr(group, "broadcast_object")


def _gather_verdicts(verdict, src: int, group) -> Optional[list]:
    if _is_peer_group(group):
        return group.gather_object(verdict, src)
    is_src = dist.get_rank() == src
    out = [None] * dist.get_world_size(group) if is_src else None
    dist.gather_object(verdict, out, dst=src, group=group)
    return out


def _broadcast_object(obj, src: int, group):
    if _is_peer_group(group):
        return group.broadcast_object(obj, src)
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _broadcast_tensor(tensor: torch.Tensor, src: int, group) -> None:
    if _is_peer_group(group):
        group.broadcast(tensor, src)
    else:
        dist.broadcast(tensor, src=src, group=group)


class DistributedTransport:
    """Trainer side of the cross-process sync (this process is global rank `src`)."""

    def __init__(self, group, src: int = 0, device: Optional[torch.device] = None, name: Optional[str] = None):
        self.group, self.src = group, src
        self.device = device or torch.device("cpu")
        self.name = name or (getattr(group, "name", "peer-group") if _is_peer_group(group)
                             else f"dist-group-ranks{sorted(dist.get_process_group_ranks(group))}")

    def _failures(self, verdicts: list) -> dict:
        return {v[0]: v[1] for v in verdicts if v is not None and v[1] is not None}

    def send(self, version: int, manifest: dict, buckets: list) -> None:
        header = {"version": version, "manifest": manifest, "layout": bucket_layout(buckets)}
        try:
            _broadcast_object(header, self.src, self.group)
            failures = self._failures(_gather_verdicts(None, self.src, self.group))
            _broadcast_object(not failures, self.src, self.group)
            if failures:
                raise WeightSyncError(failures, version)
            for b in buckets:
                if b.buffer.numel():
                    _broadcast_tensor(b.buffer.to(self.device), self.src, self.group)
            failures = self._failures(_gather_verdicts(None, self.src, self.group))
        except WeightSyncError:
            raise
        except Exception as err:  # a peer died or the group broke: name the group and the version
            raise WeightSyncError({self.name: f"{type(err).__name__}: {err}"}, version) from err
        if failures:
            raise WeightSyncError(failures, version)

    def close(self) -> None:
        """Tell every receiver of the group to stop serving."""
        _broadcast_object(None, self.src, self.group)


class DistributedReceiver:
    """Rollout side: serves updates from `src` on `group` into a `WeightReceiver`."""

    def __init__(self, receiver, group, src: int = 0, device: Optional[torch.device] = None):
        self.receiver, self.group, self.src = receiver, group, src
        self.device = device or torch.device("cpu")
        self.versions: list = []
        self.errors: list = []
        self.current_version: Optional[int] = None
        self._thread: Optional[threading.Thread] = None

    def serve_one(self) -> bool:
        """Take part in one update; False once the trainer said stop."""
        header = _broadcast_object(None, self.src, self.group)
        if header is None:
            return False
        version, manifest = header["version"], header["manifest"]
        self.current_version = version  # for a receiver that wants to know it at validate()
        verdict = None
        try:
            self.receiver.validate(manifest)
        except Exception as err:  # noqa: BLE001 - reported to the trainer, engine untouched
            verdict = f"{type(err).__name__}: {err}"
        _gather_verdicts((self.receiver.name, verdict), self.src, self.group)
        if not _broadcast_object(None, self.src, self.group):
            self.errors.append((version, verdict or "another rollout rejected the manifest"))
            return True
        buckets = []
        for metas, nbytes in header["layout"]:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            if nbytes:
                _broadcast_tensor(buf, self.src, self.group)
            buckets.append(Bucket(metas, buf.cpu()))
        verdict = None
        try:
            self.receiver.load(version, manifest, buckets)
            self.versions.append(version)
        except Exception as err:  # noqa: BLE001 - the previous version keeps serving
            verdict = f"{type(err).__name__}: {err}"
            self.errors.append((version, verdict))
        _gather_verdicts((self.receiver.name, verdict), self.src, self.group)
        return True

    def serve_forever(self) -> None:
        while self.serve_one():
            pass

    def start(self) -> "DistributedReceiver":
        """Serve in a background thread; generation keeps running on the caller's thread."""
        self._thread = threading.Thread(target=self.serve_forever, name="weight-sync-recv", daemon=True)
        self._thread.start()
        return self

    def join(self, timeout: Optional[float] = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
