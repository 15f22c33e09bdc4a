"""A process group of its own between a publisher and its rollouts, joined only with a shared token.

`PeerGroup`: rank 0 serves the group's rendezvous store on the socket it reserved (`reserve_port`:
bound to exactly the address it advertises), and a ProcessGroupGloo (CPU) or ProcessGroupNCCL
(CUDA) is built on it. It is never registered with torch.distributed, needs no default group and
cannot collide with one. Ranks are group ranks. `rollout.weight_sync.distributed` takes it wherever it
takes a torch.distributed group. Users: verl's checkpoint engine (`verl.topology`)
and the GRPO rollout process (`rl.rollouts.client`).

Exposure (see SECURITY.md): the store is not torch's TCPStore (which any TCP client can list, read
and write, and from which gloo takes every rank's address) but `rollout.weight_sync.peer_store`: every
connection first proves it holds the shared token (`MEGATRON_FP4_SYNC_TOKEN` from the launcher's
environment, or one the publisher generated and handed over) and rank 0 proves it back, an
HMAC-SHA256 over fresh nonces compared with `hmac.compare_digest`; before that a connection can
send at most a 1 KiB claim and reads nothing but a greeting. Only authenticated ranks read or
write the rendezvous, so gloo/NCCL connect exactly the token holders. Their connections are then
confirmed over the new group itself: every rank sends an HMAC of the group's nonce and checks the
others' before `PeerGroup()` returns, so a connection taken over at the transport (a process racing
to gloo's listening port) fails the join instead of joining it. gloo's connections bind `addr`
(rank 0) or `bind_addr` / this host's address (`host_address`, the other ranks). Messages are JSON,
never pickle.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import socket
import threading
from typing import Optional

import torch
import torch.distributed as dist

from megatron_fp4.rollout.weight_sync.peer_store import MISMATCH, TOKEN_ENV, RemoteStore, StoreServer, mac, same

from megatron_fp4.rollout.weight_sync.peer_store import MIN_TOKEN_CHARS as _MIN_TOKEN_CHARS


def host_address() -> str:
    """This host's address as other nodes reach it: Ray's node IP inside Ray, else loopback."""
    try:
        import ray
        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except ImportError:  # pragma: no cover - verl depends on ray
        pass
    return "127.0.0.1"


def _wildcard_error(field: str, addr) -> ValueError:
    return ValueError(f"{field}={addr!r} is a wildcard address: a listener there binds every interface (SECURITY.md: "
                      "listeners bind the address they advertise) and peers cannot connect to it; give the address "
                      "peers reach this host at (127.0.0.1 on one host, this node's own IP across nodes)")


def _is_unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0]).is_unspecified
    except ValueError:  # a host name: reserve_port checks what it resolves to
        return False


def check_advertised_address(addr, field: str = "addr") -> str:
    """`addr` when it can be advertised to peers, else a ValueError naming `field`: not empty and not a
    wildcard (the IPv4 or IPv6 unspecified address), which would bind every interface. The one check
    for every listener's address (`reserve_port`, verl's master_addr, the vLLM server's host)."""
    if not isinstance(addr, str) or not addr.strip() or _is_unspecified(addr):
        raise _wildcard_error(field, addr)
    return addr


def reserve_port(addr: str, port: int = 0, field: str = "addr") -> socket.socket:
    """A socket listening on exactly `addr` (the address rank 0 advertises; `port` 0: a free one), handed
    to rank 0's rendezvous store (no window for another process to take the port between `prepare()` and
    `init_process_group`). A wildcard `addr`, or a name resolving to one, is a ValueError naming `field`."""
    check_advertised_address(addr, field)
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    if _is_unspecified(sockaddr[0]):  # e.g. "0", a name for the wildcard
        raise _wildcard_error(field, addr)
    return socket.create_server((addr, port), family=family)


def sync_token_from_env() -> Optional[str]:
    """The launcher's shared token (`MEGATRON_FP4_SYNC_TOKEN`), None when unset."""
    token = os.environ.get(TOKEN_ENV)
    if token is not None and len(token) < _MIN_TOKEN_CHARS:
        raise ValueError(f"{TOKEN_ENV} has {len(token)} characters; set at least {_MIN_TOKEN_CHARS} random ones "
                         "(e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`) in every actor and "
                         "rollout worker's environment, or unset it everywhere to have the publisher generate one")
    return token


def new_sync_token() -> str:
    return secrets.token_hex(32)


class PeerGroup:
    """A dedicated process group (see the module doc) with the few collectives the weight sync uses
    (`rollout.weight_sync.distributed` takes it wherever it takes a torch.distributed group).

    `addr`/`port`: what rank 0 advertises; rank 0 serves the store on `listen_socket` (bound to
    `addr` by `reserve_port`; made here when not given). `token`: the shared secret checked on join.
    `bind_addr`: the address this rank's gloo connections bind (rank 0: `addr`; others: this host's).
    `abandon` (rank 0): set it to stop waiting for the other ranks at once (ConnectionAbortedError),
    e.g. when the request that asks them to join has failed.
    """

    def __init__(self, addr: str, port: int, rank: int, world_size: int, device: torch.device,
                 timeout_s: float = 600.0, listen_socket: Optional[socket.socket] = None, *, token: str,
                 bind_addr: Optional[str] = None, abandon: Optional[threading.Event] = None):
        if not isinstance(token, str) or not token:
            raise ValueError(f"PeerGroup needs the shared token ({TOKEN_ENV}, or the one the publisher "
                             "generated in prepare()); got none")
        if rank == 0:  # gloo's listener binds it (and the store's, when reserved here)
            check_advertised_address(addr, "addr")
        if bind_addr is not None:
            check_advertised_address(bind_addr, "bind_addr")
        self._rank, self._size, self.device = rank, world_size, device
        self.name = f"megatron_fp4-ce@{addr}:{port}"
        self._server = self._store = self.pg = None
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if rank == 0:
                group_nonce = secrets.token_hex(16)
                self._store = dist.HashStore()  # in this process: rank 0's rendezvous uses it directly
                self._store.set_timeout(timeout)
                self._server = StoreServer(listen_socket or reserve_port(addr, port), self._store, token,
                                           world_size, group_nonce).start()
                refused = self._server.wait_joined(timeout_s, abandon)
                if refused:
                    raise PermissionError(f"{self.name}: refused rank(s) {refused}: they do not hold this "
                                          f"publisher's {TOKEN_ENV}; nothing they sent was used. Fix: {MISMATCH}")
            else:
                self._store, group_nonce = RemoteStore.connect(addr, port, rank, token, timeout_s, self.name)
            self.pg = self._process_group(self._store, timeout, addr, bind_addr)
            self._confirm(token, group_nonce)
        except BaseException:
            self.close()
            raise

    def _process_group(self, store, timeout: datetime.timedelta, addr: str, bind_addr: Optional[str]):
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            torch.cuda.set_device(self.device)
            return dist.ProcessGroupNCCL(store, self._rank, self._size, opts)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(
            hostname=bind_addr or (addr if self._rank == 0 else host_address()))]
        return dist.ProcessGroupGloo(store, self._rank, self._size, opts)

    def _confirm(self, token: str, group_nonce: str) -> None:
        """Every rank proves the token over the group's own connections (see the module doc)."""
        def proof(rank):
            return mac(token, "connected", rank, group_nonce)
        mine = torch.frombuffer(bytearray(bytes.fromhex(proof(self._rank))), dtype=torch.uint8).to(self.device)
        got = [t.cpu().numpy().tobytes().hex() for t in self.all_gather(mine)]
        bad = [r for r, p in enumerate(got) if r != self._rank and not same(p, proof(r))]
        if bad:
            raise PermissionError(f"{self.name}: the connection(s) to group rank(s) {bad} do not come from a "
                                  f"holder of this group's {TOKEN_ENV} (taken over at the transport?); nothing "
                                  "was sent on the group before this check. Keep the sync on a trusted network")

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()

    def all_gather(self, tensor: torch.Tensor) -> list:
        out = [torch.empty_like(tensor) for _ in range(self._size)]
        self.pg.allgather([out], [tensor]).wait()
        return out

    def barrier(self) -> None:
        self.all_gather(torch.zeros(1, device=self.device))

    def close(self) -> None:
        # NCCL frees its communicators on shutdown; gloo only drops its sockets with the object.
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None and self.device.type == "cuda":
            shutdown()
        self.pg = None
        if self._server is not None:
            self._server.close()
        elif self._store is not None:
            self._store.close()
        self._server = self._store = None
