"""Where the "megatron_fp4" checkpoint engine's weights flow, and the process group that carries them.

Topology (the same in both modes; `assign_ranks` is pure):
  * actor worker 0 is the only sender (rank 0). It broadcasts one full snapshot to every rollout.
    The other actor workers get rank -1: their `send_weights` walks the generator (producing each
    weight may itself be collective over the actor group) and returns. A full snapshot already
    sits on actor rank 0 (`get_per_tensor_param` gathers it), so extra senders would only add
    copies of the same bytes.
  * rollout workers get ranks 1..N.
  * mode "inprocess" when every worker reported the same process (colocated engines, tests, the
    CPU example); mode "dist" otherwise (verl's deployment: actor and rollout workers are separate
    Ray actors).

`PeerGroup` is the "dist" mode's group: a TCPStore served by rank 0 on the port it reserved in
`prepare()`, and a ProcessGroupGloo (CPU) or ProcessGroupNCCL (CUDA) built on it. It is never
registered with torch.distributed, needs no default group and cannot collide with one (verl's
workers run their own default groups for training). Ranks are group ranks.
"""
from __future__ import annotations

import datetime
import os
import pickle
import socket
from typing import Optional

import torch
import torch.distributed as dist


def host_address() -> str:
    """This host's address as other nodes reach it: Ray's node IP inside Ray, else loopback."""
    try:
        import ray
        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except ImportError:  # pragma: no cover - verl depends on ray
        pass
    return "127.0.0.1"


def reserve_port() -> socket.socket:
    """A listening socket on a free port, handed to rank 0's TCPStore (no window for another process
    to take the port between `prepare()` and `init_process_group`)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    sock.listen()
    return sock


def process_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def assign_ranks(actor_wg_world_size: int, rollout_world_size: int, metadata: list) -> tuple:
    """Pure: (actor kwargs lists, rollout kwargs lists) for `init_process_group`; see the module doc."""
    if actor_wg_world_size < 1 or rollout_world_size < 1:
        raise ValueError(f"need at least one actor and one rollout worker, got actor_wg_world_size="
                         f"{actor_wg_world_size}, rollout_world_size={rollout_world_size}")
    if len(metadata) != actor_wg_world_size + rollout_world_size:
        raise ValueError(f"got {len(metadata)} prepare() results for {actor_wg_world_size} actor + "
                         f"{rollout_world_size} rollout workers; pass every worker's, actor workers first")
    master = metadata[0]
    mode = "inprocess" if len({m["process"] for m in metadata}) == 1 else "dist"
    world_size = 1 + rollout_world_size

    def kwargs(ranks):
        n = len(ranks)
        return {"rank": ranks, "world_size": [world_size] * n, "master_metadata": [master] * n,
                "mode": [mode] * n, "channel": [master["channel"]] * n}
    return kwargs([0] + [-1] * (actor_wg_world_size - 1)), kwargs(list(range(1, world_size)))


class PeerGroup:
    """A dedicated process group (see the module doc) with the few collectives the weight sync uses
    (`rollout.weight_sync_dist` takes it wherever it takes a torch.distributed group)."""

    def __init__(self, addr: str, port: int, rank: int, world_size: int, device: torch.device,
                 timeout_s: float = 600.0, listen_socket: Optional[socket.socket] = None):
        self._rank, self._size, self.device = rank, world_size, device
        self.name = f"megatron_fp4-ce@{addr}:{port}"
        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0:
            fd = listen_socket.detach() if listen_socket is not None else None
            store = dist.TCPStore(addr, port, world_size, True, timeout, wait_for_workers=False, master_listen_fd=fd)
        else:
            store = dist.TCPStore(addr, port, world_size, False, timeout)
        self._store = store
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            torch.cuda.set_device(device)
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()

    def _allgather(self, tensor: torch.Tensor) -> list:
        out = [torch.empty_like(tensor) for _ in range(self._size)]
        self.pg.allgather([out], [tensor]).wait()
        return out

    def _encode(self, obj) -> torch.Tensor:
        return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)

    def broadcast_object(self, obj, src: int):
        payload = self._encode(obj) if self._rank == src else None
        length = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=self.device)
        self.broadcast(length, src)
        if payload is None:
            payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(payload, src)
        return pickle.loads(payload.cpu().numpy().tobytes()) if self._rank != src else obj

    def gather_object(self, obj, dst: int) -> Optional[list]:
        """Every rank's `obj` on `dst` (None elsewhere). An allgather: the objects are small verdicts
        and gloo's gather needs equal sizes anyway."""
        payload = self._encode(obj)
        lengths = [int(n.item()) for n in self._allgather(torch.tensor([payload.numel()], dtype=torch.int64,
                                                                          device=self.device))]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=self.device)
        padded[:payload.numel()] = payload
        parts = self._allgather(padded)
        if self._rank != dst:
            return None
        return [pickle.loads(p[:n].cpu().numpy().tobytes()) for p, n in zip(parts, lengths)]

    def barrier(self) -> None:
        self._allgather(torch.zeros(1, device=self.device))

    def close(self) -> None:
        # NCCL frees its communicators on shutdown; gloo only drops its sockets with the object.
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None and self.device.type == "cuda":
            shutdown()
        self.pg = self._store = None
