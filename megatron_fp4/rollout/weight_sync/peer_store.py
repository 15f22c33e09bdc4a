"""The rendezvous store of a `PeerGroup`, reachable only by peers that proved they hold the token.

Rank 0 keeps the store's data in an in-process `torch.distributed.HashStore` (its own gloo/NCCL
rendezvous uses it directly) and serves it on the socket it advertises (`StoreServer`). Every
connection starts with a mutual HMAC-SHA256 handshake over fresh nonces; until it succeeds the
server reads at most `HELLO_LIMIT` bytes from it, within `HANDSHAKE_S`, answers nothing but its
greeting and writes nothing into the store. Authenticated peers reach the store through
`RemoteStore` (a `torch.distributed.Store` that gloo and NCCL take like a TCPStore), each key and
value and the total they write bounded (`MAX_KEY_CHARS`, `MAX_VALUE_BYTES`, `MAX_TOTAL_BYTES`).
Once every rank has joined, the server stops accepting connections.

Why not torch's TCPStore: any TCP client can read (`list_keys`, `get`) and write it, and gloo takes
each rank's address from it, so a process without the token could hijack the group's connections
(and fill rank 0's memory) however the keys are named. The wire format is length-prefixed JSON
(values base64), never pickle.
"""
from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import json
import math
import secrets
import socket
import struct
import threading
import time
from typing import Optional

import torch.distributed as dist

HELLO_LIMIT = 1024  # bytes of a greeting, a claim or a reply: what an unauthenticated peer may send
HANDSHAKE_S = 30.0  # an unauthenticated connection that has not proved the token by then is dropped
MAX_PENDING = 16  # unauthenticated connections served at once; more are closed at once
MAX_KEY_CHARS = 1024
MAX_VALUE_BYTES = 1 << 20  # gloo's addresses and NCCL's unique ids are well under 1 KiB
MAX_TOTAL_BYTES = 16 << 20  # everything the peers of one group may write into rank 0's store
_MAX_OP_BYTES = 2 * MAX_VALUE_BYTES  # a base64 value plus its JSON envelope
PROTOCOL = "megatron_fp4-sync/2"
TOKEN_ENV = "MEGATRON_FP4_SYNC_TOKEN"
MIN_TOKEN_CHARS = 16
MISMATCH = (f"set the same {TOKEN_ENV} (at least {MIN_TOKEN_CHARS} random characters) in every actor and "
            "rollout worker's environment, or unset it everywhere to have the publisher generate one per group")


def mac(token: str, *parts) -> str:
    return hmac.new(token.encode(), "|".join(["megatron_fp4-sync", *map(str, parts)]).encode(),
                    hashlib.sha256).hexdigest()


def same(got, expected: str) -> bool:
    """Constant-time comparison of a peer's proof (any string: compared as bytes)."""
    return isinstance(got, str) and hmac.compare_digest(got.encode("utf-8", "replace"), expected.encode())


class Refused(Exception):
    """A connection that did not speak the protocol (dropped; the join goes on)."""


def send_msg(sock: socket.socket, obj) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 16))
        if not chunk:
            raise Refused("the connection closed mid-message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_msg(sock: socket.socket, limit: int) -> dict:
    """One length-prefixed JSON object of at most `limit` bytes (the length is checked before any
    of it is read)."""
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if not 0 < n <= limit:
        raise Refused(f"a {n}-byte message (allowed: 1..{limit})")
    try:
        obj = json.loads(_recv_exact(sock, n).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise Refused("a message that is not JSON") from None
    if not isinstance(obj, dict):
        raise Refused("a message that is not a JSON object")
    return obj


def _is_nonce(value) -> bool:
    return isinstance(value, str) and 16 <= len(value) <= 64 and all(c in "0123456789abcdef" for c in value)


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode("ascii")


class StoreServer:
    """Rank 0's side: authenticates ranks 1..world_size-1 on `listen` and serves them `backend`."""

    def __init__(self, listen: socket.socket, backend, token: str, world_size: int, group_nonce: str):
        self.listen, self.backend, self.token = listen, backend, token
        self.world_size, self.group_nonce = world_size, group_nonce
        self.joined: dict = {}  # rank -> authenticated socket
        self.refused: list = []  # ranks claimed by peers that spoke the protocol without the token
        self.dropped = 0  # connections that did not speak it
        self._written = 0
        self._pending = 0
        self._cond = threading.Condition()
        self._closed = False

    def start(self) -> "StoreServer":
        threading.Thread(target=self._accept, name="peer-store-accept", daemon=True).start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listen.accept()
            except OSError:  # closed: every rank joined, or the group is closing
                return
            with self._cond:
                full = self._pending >= MAX_PENDING or self._closed
                if not full:
                    self._pending += 1
            if full:
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="peer-store-conn", daemon=True).start()

    def _handshake(self, conn: socket.socket) -> Optional[int]:
        """The rank `conn` proved to hold the token as, None if it was refused."""
        nonce = secrets.token_hex(16)
        send_msg(conn, {"protocol": PROTOCOL, "nonce": nonce, "group": self.group_nonce})
        claim = recv_msg(conn, HELLO_LIMIT)
        rank, peer_nonce, proof = claim.get("rank"), claim.get("nonce"), claim.get("proof")
        if set(claim) != {"rank", "nonce", "proof"} or type(rank) is not int or not _is_nonce(peer_nonce):
            raise Refused("a claim that is not {rank, nonce, proof}")
        with self._cond:
            ok = (0 < rank < self.world_size and rank not in self.joined and not self._closed
                  and same(proof, mac(self.token, "rollout", rank, nonce, peer_nonce, self.group_nonce)))
            if ok:
                self.joined[rank] = conn
            else:
                self.refused.append(rank)
            self._cond.notify_all()
        send_msg(conn, {"ok": ok, "proof": mac(self.token, "publisher", rank, nonce, peer_nonce, self.group_nonce)
                        if ok else ""})
        return rank if ok else None

    def _serve(self, conn: socket.socket) -> None:
        rank = None
        limit = min(HANDSHAKE_S, self.backend.timeout.total_seconds())
        deadline = threading.Timer(limit, _shutdown, args=(conn,))  # the whole handshake, not each recv
        try:
            conn.settimeout(limit)
            deadline.start()
            try:
                rank = self._handshake(conn)
            finally:
                deadline.cancel()
                with self._cond:
                    self._pending -= 1
            if rank is None:
                return
            conn.settimeout(None)  # waits are bounded by the backend's timeout
            while True:
                request = recv_msg(conn, _MAX_OP_BYTES)
                try:
                    reply = {"value": self._op(request)}
                except (Refused, KeyError, TypeError, ValueError):
                    raise
                except Exception as err:  # noqa: BLE001 - a store timeout etc.: the peer raises it
                    reply = {"error": f"{type(err).__name__}: {err}"}
                send_msg(conn, reply)
        except (Refused, OSError, KeyError, TypeError, ValueError, struct.error):
            if rank is None:
                with self._cond:
                    self.dropped += 1
        finally:
            conn.close()

    def _key(self, key) -> str:
        if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
            raise Refused(f"a store key must be a string of at most {MAX_KEY_CHARS} characters")
        return key

    def _charge(self, nbytes: int) -> None:
        with self._cond:
            self._written += nbytes
            if self._written > MAX_TOTAL_BYTES:
                raise Refused(f"the peers wrote more than {MAX_TOTAL_BYTES} bytes into the store")

    def _value(self, text) -> bytes:
        value = base64.b64decode(text, validate=True)
        if len(value) > MAX_VALUE_BYTES:
            raise Refused(f"a {len(value)}-byte store value (allowed: {MAX_VALUE_BYTES})")
        self._charge(len(value))
        return value

    def _op(self, r: dict):
        op, b = r["op"], self.backend
        if op in ("set", "add", "compare_set"):  # what stays in rank 0's memory: keys count too
            self._charge(len(self._key(r["key"])) + 8)
        if op == "set":
            return b.set(self._key(r["key"]), self._value(r["value"]))
        if op == "get":
            return _b64(b.get(self._key(r["key"])))
        if op == "wait":
            return b.wait([self._key(k) for k in r["keys"]])
        if op == "check":
            return b.check([self._key(k) for k in r["keys"]])
        if op == "add":
            return b.add(self._key(r["key"]), int(r["amount"]))
        if op == "compare_set":
            return _b64(b.compare_set(self._key(r["key"]), self._value(r["expected"]), self._value(r["desired"])))
        if op == "delete_key":
            return b.delete_key(self._key(r["key"]))
        if op == "num_keys":
            return b.num_keys()
        raise Refused(f"unknown store op {op!r}")

    def wait_joined(self, timeout_s: float, abandon: Optional[threading.Event] = None) -> list:
        """Until every rank joined (-> []) or one was refused (-> the refused ranks); stops accepting
        new connections. Raises TimeoutError naming the ranks that never joined, or ConnectionAbortedError
        as soon as `abandon` is set (the caller learnt that they never will, e.g. the peer's join request
        failed)."""
        deadline = time.monotonic() + timeout_s
        settled = lambda: self.refused or len(self.joined) == self.world_size - 1  # noqa: E731
        with self._cond:
            while not settled() and time.monotonic() < deadline and not (abandon is not None and abandon.is_set()):
                # in slices when there is an `abandon` to look at: it is set from another object's thread
                self._cond.wait(max(0.0, min(deadline - time.monotonic(), 0.05 if abandon is not None else math.inf)))
            done = bool(settled())
            missing = sorted(set(range(1, self.world_size)) - set(self.joined))
            refused = sorted(set(self.refused))
        self._close_listen()
        if not done and abandon is not None and abandon.is_set():
            raise ConnectionAbortedError(f"the join of rank(s) {missing} was abandoned before the timeout")
        if not done:
            raise TimeoutError(f"rank(s) {missing} did not join within {timeout_s}s ({self.dropped} connection(s) "
                               "that did not speak the protocol were dropped)")
        return refused

    def _close_listen(self) -> None:
        """Stop listening now (a bare close() would leave a blocked accept() listening on Linux)."""
        _shutdown(self.listen)
        self.listen.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            conns = list(self.joined.values())
        self._close_listen()
        for conn in conns:
            _shutdown(conn)
            conn.close()


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class RemoteStore(dist.Store):
    """A peer's view of rank 0's store, over one authenticated connection (`connect`)."""

    def __init__(self, sock: socket.socket, timeout_s: float):
        super().__init__()
        self.sock, self._lock = sock, threading.Lock()
        sock.settimeout(timeout_s + HANDSHAKE_S)  # rank 0's waits time out first and say so

    @classmethod
    def connect(cls, addr: str, port: int, rank: int, token: str, timeout_s: float, name: str):
        """-> (store, group nonce) once both sides proved they hold `token`. Raises PermissionError
        if rank 0 refused this rank or does not hold the token itself."""
        deadline = time.monotonic() + timeout_s
        while True:  # rank 0 may not serve yet
            try:
                sock = socket.create_connection((addr, port), timeout=min(HANDSHAKE_S, timeout_s))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        try:
            hello = recv_msg(sock, HELLO_LIMIT)
            nonce, group = hello.get("nonce"), hello.get("group")
            if hello.get("protocol") != PROTOCOL or not isinstance(nonce, str) or not isinstance(group, str):
                raise Refused(f"rank 0 does not speak {PROTOCOL}")
            mine = secrets.token_hex(16)
            send_msg(sock, {"rank": rank, "nonce": mine, "proof": mac(token, "rollout", rank, nonce, mine, group)})
            reply = recv_msg(sock, HELLO_LIMIT)
        except (Refused, OSError, struct.error) as err:
            sock.close()
            raise ConnectionError(f"{name}: the handshake with rank 0 failed ({err})") from None
        if reply.get("ok") is not True:
            sock.close()
            raise PermissionError(f"{name}: the publisher (rank 0) refused this rank: its {TOKEN_ENV} differs. "
                                  f"Fix: {MISMATCH}")
        if not same(reply.get("proof"), mac(token, "publisher", rank, nonce, mine, group)):
            sock.close()
            raise PermissionError(f"{name}: the peer serving rank 0 does not hold this worker's {TOKEN_ENV}; "
                                  f"refusing to receive weights from it. Fix: {MISMATCH}")
        return cls(sock, timeout_s), group

    def _call(self, **request):
        with self._lock:
            try:
                send_msg(self.sock, request)
                reply = recv_msg(self.sock, _MAX_OP_BYTES)
            except (Refused, OSError, struct.error) as err:
                raise RuntimeError(f"rank 0 closed the weight-sync group's store connection ({err}): the join "
                                   "failed there, see its error") from None
        if "error" in reply:
            raise RuntimeError(f"rank 0's store: {reply['error']}")
        return reply.get("value")

    def set(self, key, value):
        self._call(op="set", key=key, value=_b64(value.encode() if isinstance(value, str) else bytes(value)))

    def get(self, key):
        return base64.b64decode(self._call(op="get", key=key))

    def wait(self, keys, timeout: Optional[datetime.timedelta] = None):
        self._call(op="wait", keys=list(keys))

    def check(self, keys):
        return bool(self._call(op="check", keys=list(keys)))

    def add(self, key, amount):
        return int(self._call(op="add", key=key, amount=int(amount)))

    def compare_set(self, key, expected, desired):
        enc = (lambda v: _b64(v.encode() if isinstance(v, str) else bytes(v)))
        return base64.b64decode(self._call(op="compare_set", key=key, expected=enc(expected), desired=enc(desired)))

    def delete_key(self, key):
        return bool(self._call(op="delete_key", key=key))

    def num_keys(self):
        return int(self._call(op="num_keys"))

    def close(self) -> None:
        self.sock.close()
