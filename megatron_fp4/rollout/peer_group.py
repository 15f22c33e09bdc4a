"""A process group of its own between a publisher and its rollouts, joined only with a shared token.

`PeerGroup`: a TCPStore served by rank 0 on the socket it reserved (`reserve_port`: bound to exactly
the address it advertises), and a ProcessGroupGloo (CPU) or ProcessGroupNCCL (CUDA) built on it. It
is never registered with torch.distributed, needs no default group and cannot collide with one.
Ranks are group ranks. `rollout.weight_sync_dist` takes it wherever it takes a torch.distributed
group. Users: verl's checkpoint engine (`integrations.verl.topology`) and the GRPO rollout process
(`rl.rollout_client`).

Exposure (see SECURITY.md): rank 0's store listens on exactly the address it advertises, and gloo's
connections bind that address (rank 0) or `bind_addr` / this host's address (`host_address`, the
other ranks). Before the process group is built, every rank proves to rank 0, and rank 0 to every
rank, that it holds the shared token (`MEGATRON_FP4_SYNC_TOKEN` from the launcher's environment, or
one the publisher generated and handed over): an HMAC-SHA256 over fresh nonces exchanged through
the store, compared with `hmac.compare_digest`. A peer without the token is refused before any of
its bytes are used; the messages that follow are JSON, never pickle.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import secrets
import socket
from typing import Optional

import torch
import torch.distributed as dist

TOKEN_ENV = "MEGATRON_FP4_SYNC_TOKEN"
_MIN_TOKEN_CHARS = 16


def host_address() -> str:
    """This host's address as other nodes reach it: Ray's node IP inside Ray, else loopback."""
    try:
        import ray
        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except ImportError:  # pragma: no cover - verl depends on ray
        pass
    return "127.0.0.1"


def reserve_port(addr: str, port: int = 0) -> socket.socket:
    """A socket listening on exactly `addr` (the address rank 0 advertises; `port` 0: a free one), handed
    to rank 0's TCPStore (no window for another process to take the port between `prepare()` and
    `init_process_group`)."""
    family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
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


def _mac(token: str, role: str, rank: int, nonce: str, peer_nonce: str) -> str:
    return hmac.new(token.encode(), f"megatron_fp4-sync|{role}|{rank}|{nonce}|{peer_nonce}".encode(),
                    hashlib.sha256).hexdigest()


def _same(got, expected: str) -> bool:
    """Constant-time comparison of a peer's proof (any string: compared as bytes)."""
    return isinstance(got, str) and hmac.compare_digest(got.encode("utf-8", "replace"), expected.encode())


def _read_json(store, key: str) -> Optional[dict]:
    """A dict of strings/bools from the store (written by a peer: anything else is None)."""
    try:
        obj = json.loads(store.get(key).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    ok = isinstance(obj, dict) and all(isinstance(v, (str, bool)) for v in obj.values())
    return obj if ok else None


_MISMATCH = (f"set the same {TOKEN_ENV} (at least {_MIN_TOKEN_CHARS} random characters) in every actor and "
             "rollout worker's environment, or unset it everywhere to have the publisher generate one per group")


def authenticate(store, rank: int, world_size: int, token: str, name: str) -> None:
    """Mutual token check through `store` before any process group exists (see the module doc).
    Raises PermissionError naming `MEGATRON_FP4_SYNC_TOKEN` on every rank if any rank fails it."""
    if rank == 0:
        nonce = secrets.token_hex(16)
        store.set("auth/nonce", nonce)
        refused = []
        for r in range(1, world_size):
            claim = _read_json(store, f"auth/claim/{r}")
            peer_nonce = claim.get("nonce") if claim else None
            ok = isinstance(peer_nonce, str) and _same(claim.get("proof"), _mac(token, "rollout", r, nonce, peer_nonce))
            proof = _mac(token, "publisher", r, nonce, peer_nonce) if ok else ""
            store.set(f"auth/reply/{r}", json.dumps({"ok": ok, "proof": proof}))
            if not ok:
                refused.append(r)
        store.set("auth/result", json.dumps({"refused": " ".join(map(str, refused))}))
        if refused:
            raise PermissionError(f"{name}: refused rank(s) {refused}: they do not hold this publisher's "
                                  f"{TOKEN_ENV}; nothing they sent was used. Fix: {_MISMATCH}")
        return
    nonce = store.get("auth/nonce").decode("ascii", errors="replace")
    mine = secrets.token_hex(16)
    store.set(f"auth/claim/{rank}", json.dumps({"nonce": mine, "proof": _mac(token, "rollout", rank, nonce, mine)}))
    reply = _read_json(store, f"auth/reply/{rank}") or {}
    if reply.get("ok") is not True:
        raise PermissionError(f"{name}: the publisher (rank 0) refused this rank: its {TOKEN_ENV} differs. "
                              f"Fix: {_MISMATCH}")
    if not _same(reply.get("proof"), _mac(token, "publisher", rank, nonce, mine)):
        raise PermissionError(f"{name}: the peer serving rank 0 does not hold this worker's {TOKEN_ENV}; refusing "
                              f"to receive weights from it. Fix: {_MISMATCH}")
    result = _read_json(store, "auth/result") or {}
    if result.get("refused", "?"):
        raise PermissionError(f"{name}: the publisher refused rank(s) {result.get('refused')} (a different "
                              f"{TOKEN_ENV}); the group is not built. Fix: {_MISMATCH}")


class PeerGroup:
    """A dedicated process group (see the module doc) with the few collectives the weight sync uses
    (`rollout.weight_sync_dist` takes it wherever it takes a torch.distributed group).

    `addr`/`port`: what rank 0 advertises; rank 0 serves the store on `listen_socket` (bound to
    `addr` by `reserve_port`; made here when not given). `token`: the shared secret checked on join.
    `bind_addr`: the address this rank's gloo connections bind (rank 0: `addr`; others: this host's).
    """

    def __init__(self, addr: str, port: int, rank: int, world_size: int, device: torch.device,
                 timeout_s: float = 600.0, listen_socket: Optional[socket.socket] = None, *, token: str,
                 bind_addr: Optional[str] = None):
        if not isinstance(token, str) or not token:
            raise ValueError(f"PeerGroup needs the shared token ({TOKEN_ENV}, or the one the publisher "
                             "generated in prepare()); got none")
        self._rank, self._size, self.device = rank, world_size, device
        self.name = f"megatron_fp4-ce@{addr}:{port}"
        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0:
            if listen_socket is None:
                listen_socket = reserve_port(addr, port)
            store = dist.TCPStore(addr, port, world_size, True, timeout, wait_for_workers=False,
                                  master_listen_fd=listen_socket.detach())
        else:
            store = dist.TCPStore(addr, port, world_size, False, timeout)
        self._store = store
        authenticate(store, rank, world_size, token, self.name)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            torch.cuda.set_device(device)
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(
                hostname=bind_addr or (addr if rank == 0 else host_address()))]
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, opts)

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
        self.pg = self._store = None
