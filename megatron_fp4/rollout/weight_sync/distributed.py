"""Weight sync across processes: torch.distributed broadcast on a dedicated group (gloo or NCCL).

    # trainer process (rank `src` of `group`)
    publisher = WeightPublisher(model, [DistributedTransport(group, src=0)])
    # each rollout process
    DistributedReceiver(WeightReceiver(engine), group, src=0).start()   # background thread

One update, all on `group` (created by the caller with `dist.new_group`, so it never collides with
training collectives; or any object with `rank()`, `size()`, `broadcast(tensor, src)` and
`all_gather(tensor) -> list` — a group of its own outside torch.distributed's registry, ranks being
its group ranks, e.g. verl's `verl.topology.PeerGroup`, which checks a shared token on
join):
  1. broadcast the header: version, manifest {name: (shape, dtype)}, bucket layout (metas, bytes)
  2. gather every rollout's verdict on the manifest; broadcast go / no-go. A mismatch stops the
     update here: no bucket is sent and nothing is overwritten. (A publisher that says go anyway
     finds the refusing rollout still in step: it drops the buckets and repeats its refusal.)
  3. broadcast the buckets one by one into fresh receive buffers (the rollout's staging copy)
  4. every rollout swaps them in (engine write lock) and the verdicts are gathered again.
A `null` header tells the receivers to stop.

Every message but the buckets is JSON in a uint8 tensor behind an int64 length (`parallel.wire`;
never pickle, so never `broadcast_object_list` / `gather_object`): what a peer sends is parsed as data, checked for
its form (`buckets.manifest_from_json` / `layout_from_json`) and size (`MAX_HEADER_BYTES`,
`MAX_VERDICT_BYTES`), and a malformed message is a failure naming the sender, never code.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch
import torch.distributed as dist

from megatron_fp4.parallel.wire import (MalformedMessage, ProtocolError, all_gather_json, broadcast_json,
                                        broadcast_tensor, group_rank, is_peer_group, is_src)
from megatron_fp4.rollout.weight_sync.buckets import (Bucket, BucketError, bucket_layout, check_layout, layout_from_json,
                                                      layout_to_json, manifest_from_json, manifest_to_json)
from megatron_fp4.rollout.weight_sync.publisher import WeightSyncError

MAX_HEADER_BYTES = 1 << 30  # a manifest + layout of ~10^6 chunks; more is not a header
MAX_VERDICT_BYTES = 1 << 20  # a verdict is a rollout name and an error message
_PUBLISHER = "rank {} (the publisher)"


def _broadcast_json(obj, src: int, group, device: torch.device):
    """`obj` from `src`, parsed as JSON everywhere else."""
    return broadcast_json(obj, src, group, device, MAX_HEADER_BYTES, _PUBLISHER.format(src))


def _gather_json(obj, src: int, group, device: torch.device) -> Optional[list]:
    """Every group rank's `obj` on `src` (None elsewhere), in group-rank order; an entry is a
    `ProtocolError` where that rank's message was not JSON or too large. An allgather: the verdicts
    are small and gloo's gather needs equal sizes anyway."""
    out = all_gather_json(obj, group, device, MAX_VERDICT_BYTES, strict=False, what="verdict")
    return out if is_src(src, group) else None


def _check_verdict(verdict, rank: int) -> tuple:
    """A rollout's verdict must be {"rollout": name, "error": message-or-null}."""
    if isinstance(verdict, ProtocolError):
        return f"group rank {rank}", str(verdict)
    if (not isinstance(verdict, dict) or set(verdict) != {"rollout", "error"}
            or not isinstance(verdict["rollout"], str) or not isinstance(verdict["error"], (str, type(None)))):
        return f"group rank {rank}", ("sent a malformed verdict (expected {'rollout': name, 'error': message "
                                      "or null}); it was not used")
    return verdict["rollout"], verdict["error"]


def _decode_header(obj) -> tuple:
    if not isinstance(obj, dict) or set(obj) != {"version", "manifest", "layout"} or type(obj["version"]) is not int:
        raise MalformedMessage("the publisher's header is not {'version': int, 'manifest': ..., 'layout': ...}")
    try:
        manifest, layout = manifest_from_json(obj["manifest"]), layout_from_json(obj["layout"])
        check_layout(manifest, layout)  # sizes agree with the manifest before anything is allocated
        return obj["version"], manifest, layout
    except BucketError as err:
        raise MalformedMessage(f"the publisher's header for version {obj['version']} is malformed: {err}") from None


class DistributedTransport:
    """Trainer side of the cross-process sync (this process is rank `src`: global for a
    torch.distributed group, a group rank for a peer group)."""

    def __init__(self, group, src: int = 0, device: Optional[torch.device] = None, name: Optional[str] = None):
        self.group, self.src = group, src
        self.device = device or torch.device("cpu")
        self.name = name or (getattr(group, "name", "peer-group") if is_peer_group(group)
                             else f"dist-group-ranks{sorted(dist.get_process_group_ranks(group))}")

    def _failures(self) -> dict:
        verdicts = _gather_json(None, self.src, self.group, self.device)
        me = group_rank(self.group)
        checked = [_check_verdict(v, r) for r, v in enumerate(verdicts) if r != me]
        return {name: error for name, error in checked if error is not None}

    def send(self, version: int, manifest: dict, buckets: list) -> None:
        header = {"version": int(version), "manifest": manifest_to_json(manifest),
                  "layout": layout_to_json(bucket_layout(buckets))}
        try:
            _broadcast_json(header, self.src, self.group, self.device)
            failures = self._failures()
            _broadcast_json(not failures, self.src, self.group, self.device)
            if failures:
                raise WeightSyncError(failures, version)
            for b in buckets:
                if b.buffer.numel():
                    broadcast_tensor(b.buffer.to(self.device), self.src, self.group)
            failures = self._failures()
        except WeightSyncError:
            raise
        except Exception as err:  # a peer died or the group broke: name the group and the version
            raise WeightSyncError({self.name: f"{type(err).__name__}: {err}"}, version) from err
        if failures:
            raise WeightSyncError(failures, version)

    def close(self) -> None:
        """Tell every receiver of the group to stop serving."""
        _broadcast_json(None, self.src, self.group, self.device)


class DistributedReceiver:
    """Rollout side: serves updates from `src` on `group` into a `WeightReceiver`."""

    def __init__(self, receiver, group, src: int = 0, device: Optional[torch.device] = None):
        self.receiver, self.group, self.src = receiver, group, src
        self.device = device or torch.device("cpu")
        self.versions: list = []
        self.errors: list = []
        self.current_version: Optional[int] = None
        self.failure: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None

    def _verdict(self, error: Optional[str]) -> None:
        if error is not None and len(error) > MAX_VERDICT_BYTES // 16:  # JSON escapes may grow it up to 6x
            error = error[:MAX_VERDICT_BYTES // 16] + " ..."
        _gather_json({"rollout": self.receiver.name, "error": error}, self.src, self.group, self.device)

    def serve_one(self) -> bool:
        """Take part in one update; False once the trainer said stop."""
        try:
            header = _broadcast_json(None, self.src, self.group, self.device)
        except MalformedMessage as err:
            header = err
        if header is None:
            return False
        try:
            if isinstance(header, MalformedMessage):
                raise header
            version, manifest, layout = _decode_header(header)
        except MalformedMessage as err:  # answered with a failing verdict: the publisher says no-go
            version, verdict, layout = None, str(err), None
        else:
            self.current_version = version  # for a receiver that wants to know it at validate()
            verdict = buffers = None
            try:
                self.receiver.validate(manifest)
                buffers = self._allocate(layout)  # before the verdict: a failure is reported, not fatal
            except Exception as err:  # noqa: BLE001 - reported to the trainer, engine untouched
                verdict = f"{type(err).__name__}: {err}"
        self._verdict(verdict)
        go = _broadcast_json(None, self.src, self.group, self.device)
        if not isinstance(go, bool):
            raise ProtocolError(f"the publisher's go/no-go for version {version} is {go!r} after this rollout's "
                                f"verdict {verdict!r}")
        if go and verdict is not None:  # a go after this rollout refused: the publisher broke the protocol
            return self._refuse_go(version, verdict, layout)
        if not go:
            self.errors.append((version, verdict or "another rollout rejected the manifest"))
            return True
        staged, scratch = buffers
        buckets = []
        for (metas, nbytes), buf in zip(layout, staged):
            if nbytes:
                wire = buf if scratch is None else scratch[:nbytes]
                broadcast_tensor(wire, self.src, self.group)
                if scratch is not None:
                    buf.copy_(wire)
            buckets.append(Bucket(metas, buf))
        verdict = None
        try:
            self.receiver.load(version, manifest, buckets)
            self.versions.append(version)
        except Exception as err:  # noqa: BLE001 - the previous version keeps serving
            verdict = f"{type(err).__name__}: {err}"
            self.errors.append((version, verdict))
        self._verdict(verdict)
        return True

    def _refuse_go(self, version, verdict: str, layout) -> bool:
        """The publisher said go although this rollout refused the update. Nothing is loaded (the
        previous version keeps serving) and the receiver stays in step for later updates: with a
        layout it could read, the announced buckets are received into one scratch buffer of the
        largest bucket and dropped, and the final verdict repeats the refusal (the publisher gets a
        `WeightSyncError` naming this rollout). Without one (the header itself was refused) the
        sizes that would follow are unknown, so the go counts as the no-go it should have been and
        the next message must be a header."""
        error = f"refused version {version} ({verdict}), but the publisher sent go: nothing was loaded"
        self.errors.append((version, error))
        if layout is None:
            return True
        largest = max([0] + [nbytes for _, nbytes in layout])
        try:
            scratch = torch.empty(largest, dtype=torch.uint8, device=self.device)
        except RuntimeError as err:  # cannot take the bytes: the exchange cannot go on in step
            raise ProtocolError(f"{error}; its {largest}-byte buckets cannot be received and dropped either "
                                f"({str(err).splitlines()[0]})") from None
        for _, nbytes in layout:
            if nbytes:
                broadcast_tensor(scratch[:nbytes], self.src, self.group)
        self._verdict(error)
        return True

    def _allocate(self, layout: list) -> tuple:
        """(a host buffer per bucket, one device buffer the buckets arrive through or None on CPU);
        the layout's sizes were checked against the manifest (`buckets.check_layout`)."""
        try:
            staged = [torch.empty(nbytes, dtype=torch.uint8) for _, nbytes in layout]
            largest = max([0] + [nbytes for _, nbytes in layout])
            scratch = None if self.device.type == "cpu" else torch.empty(largest, dtype=torch.uint8, device=self.device)
        except RuntimeError as err:  # out of memory
            total = sum(nbytes for _, nbytes in layout)
            raise MemoryError(f"rollout {self.receiver.name!r} cannot allocate the {total} bytes of the update's "
                              f"buckets ({str(err).splitlines()[0]}); it keeps its version") from None
        return staged, scratch

    def serve_forever(self) -> None:
        """Serve until the trainer says stop. An error that breaks the exchange itself (the group
        failed, the publisher broke the protocol) ends it: kept in `failure` and `errors`, raised."""
        try:
            while self.serve_one():
                pass
        except Exception as err:
            self.failure = err
            self.errors.append((self.current_version, f"{type(err).__name__}: {err}"))
            raise

    def _serve_quietly(self) -> None:
        try:
            self.serve_forever()
        except Exception:  # noqa: BLE001 - kept in self.failure, raised by join()
            pass

    def start(self) -> "DistributedReceiver":
        """Serve in a background thread; generation keeps running on the caller's thread."""
        self._thread = threading.Thread(target=self._serve_quietly, name="weight-sync-recv", daemon=True)
        self._thread.start()
        return self

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the serving thread; raises what ended it if the exchange broke."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self.failure is not None:
            raise RuntimeError(f"rollout {self.receiver.name!r} stopped taking weight updates: "
                               f"{type(self.failure).__name__}: {self.failure}") from self.failure
