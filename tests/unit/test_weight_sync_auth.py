"""The "dist" weight-sync group's exposure: its listeners bind exactly the advertised address, and
a peer without the shared token (MEGATRON_FP4_SYNC_TOKEN) is refused on join, on both sides.

Groups are built in threads of this process (the token check runs on the store's connections
before any process group exists), so no processes are spawned. `PeerGroup` needs only torch; the
verl checkpoint engine's tests import verl themselves."""
import os
import socket
import struct
import threading

import pytest
import torch

from megatron_fp4.rollout.weight_sync.peer_group import TOKEN_ENV, PeerGroup, reserve_port
from megatron_fp4.rollout.weight_sync.peer_store import HELLO_LIMIT, PROTOCOL, recv_msg, send_msg

ADDR = "127.0.0.1"
TOKEN = "a" * 64


def _listening_addresses() -> set:
    """(ip, port) of every TCP socket this process listens on (Linux /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ip_hex, port_hex = fields[1].split(":")
                raw = bytes.fromhex(ip_hex)
                family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # little-endian words
                out.add((socket.inet_ntop(family, words), int(port_hex, 16)))
    return out


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux /proc/net/tcp")


def _build(ranks_tokens, port):
    """PeerGroups of len(ranks_tokens) ranks in threads; -> {rank: group or exception}."""
    out = {}

    def one(rank, token):
        try:
            out[rank] = PeerGroup(ADDR, port, rank, len(ranks_tokens), torch.device("cpu"), timeout_s=30,
                                  listen_socket=reserve_port(ADDR, port) if rank == 0 else None, token=token)
        except Exception as err:  # noqa: BLE001 - inspected by the test
            out[rank] = err
    threads = [threading.Thread(target=one, args=(r, t), daemon=True) for r, t in enumerate(ranks_tokens)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((ADDR, 0))
        return s.getsockname()[1]


def _engine():
    from megatron_fp4.verl import MegatronFP4CheckpointEngine
    return MegatronFP4CheckpointEngine


def test_prepare_listens_on_the_advertised_address_only():
    MegatronFP4CheckpointEngine = _engine()
    ce = MegatronFP4CheckpointEngine(master_addr=ADDR)
    meta = ce.prepare()
    try:
        assert ce._listen.getsockname()[:2] == (meta["addr"], meta["port"])  # not 0.0.0.0
    finally:
        ce.finalize()


@needs_proc
def test_every_listener_of_the_group_binds_the_advertised_address():
    before = _listening_addresses()
    group = _build([TOKEN], _free_port())[0]
    assert isinstance(group, PeerGroup), group
    opened = _listening_addresses() - before  # the store's and gloo's listeners
    assert opened and {ip for ip, _ in opened} == {ADDR}, opened
    group.close()


def test_wrong_token_is_refused_on_both_sides():
    out = _build([TOKEN, "b" * 64], _free_port())
    for rank in (0, 1):
        assert isinstance(out[rank], PermissionError), out[rank]
        assert TOKEN_ENV in str(out[rank])
    assert "refused rank(s) [1]" in str(out[0]) and "refused this rank" in str(out[1])


def test_same_token_joins_and_the_group_works():
    port = _free_port()
    out = _build([TOKEN, TOKEN], port)
    assert all(isinstance(g, PeerGroup) for g in out.values()), out
    got = {}

    def bcast(rank):
        t = torch.tensor([7.0]) if rank == 0 else torch.zeros(1)
        out[rank].broadcast(t, 0)
        got[rank] = float(t)
    threads = [threading.Thread(target=bcast, args=(r,), daemon=True) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert got == {0: 7.0, 1: 7.0}
    with pytest.raises(ConnectionRefusedError):  # every rank joined: rank 0's store takes no new connection
        socket.create_connection((ADDR, port), timeout=10)
    for group in out.values():
        group.close()


def test_token_from_the_environment(monkeypatch):
    MegatronFP4CheckpointEngine = _engine()
    ce = MegatronFP4CheckpointEngine(master_addr=ADDR)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    meta = ce.prepare()  # no token in the environment: the publisher generates one for its rollouts
    assert len(meta["token"]) >= 32 and meta["token"] != ce.prepare()["token"]
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert "token" not in ce.prepare()  # the launcher's token is not sent around
    monkeypatch.delenv(TOKEN_ENV)  # a rollout without it, while the publisher uses one: a clear error
    with pytest.raises(ValueError, match=f"{TOKEN_ENV} is not set in this worker's environment"):
        ce.init_process_group(rank=1, world_size=2, master_metadata={"addr": ADDR, "port": 1}, mode="dist")
    monkeypatch.setenv(TOKEN_ENV, "short")
    with pytest.raises(ValueError, match=f"{TOKEN_ENV} has 5 characters"):
        ce.prepare()
    ce.finalize()


def _claim_then_join(port, claim: bytes):
    """A raw connection sends `claim` (framed) as its answer to rank 0's greeting; then the real
    rank 1 joins. -> (what the raw connection got back, {rank: group or exception})."""
    listen = reserve_port(ADDR, port)
    out, got = {}, []

    def rank0():
        try:
            out[0] = PeerGroup(ADDR, port, 0, 2, torch.device("cpu"), timeout_s=30, listen_socket=listen, token=TOKEN)
        except Exception as err:  # noqa: BLE001 - inspected by the test
            out[0] = err
    th = threading.Thread(target=rank0, daemon=True)
    th.start()
    with socket.create_connection((ADDR, port), timeout=30) as raw:
        hello = recv_msg(raw, HELLO_LIMIT)
        assert hello["protocol"] == PROTOCOL and set(hello) == {"protocol", "nonce", "group"}
        raw.sendall(struct.pack(">I", len(claim)) + claim)
        try:
            while True:
                chunk = raw.recv(4096)
                if not chunk:
                    break
                got.append(chunk)
        except OSError:
            pass
        if not got:  # the raw connection was dropped without an answer: the real rollout can still join
            one = {}
            t1 = threading.Thread(target=lambda: one.update(g=_try_join(port)), daemon=True)
            t1.start()
            t1.join(60)
            out[1] = one.get("g")
    th.join(60)
    return b"".join(got), out


def _try_join(port):
    try:
        return PeerGroup(ADDR, port, 1, 2, torch.device("cpu"), timeout_s=30, token=TOKEN)
    except Exception as err:  # noqa: BLE001
        return err


@pytest.mark.parametrize("claim", [b"\x80\x04\x95 not json", b'{"nonce": 1, "proof": []}', b"[1, 2]",
                                   b'{"rank": "1", "nonce": "n", "proof": "p"}', b"x" * (HELLO_LIMIT + 1),
                                   b'{"rank": 1, "nonce": "n|x", "proof": "p"}'])
def test_a_malformed_claim_is_dropped_and_the_real_rollout_still_joins(claim):
    got, out = _claim_then_join(_free_port(), claim)
    assert got == b"", got  # nothing but the greeting, not even a refusal
    assert isinstance(out[0], PeerGroup) and isinstance(out[1], PeerGroup), out
    out[0].close()
    out[1].close()


NONCE = b'"' + b"0" * 32 + b'"'


@pytest.mark.parametrize("claim", [b'{"rank": 1, "nonce": ' + NONCE + b', "proof": "\\u00e9\\u00e9"}',
                                   b'{"rank": 1, "nonce": ' + NONCE + b', "proof": "' + b"0" * 64 + b'"}',
                                   b'{"rank": 0, "nonce": ' + NONCE + b', "proof": "p"}',
                                   b'{"rank": 7, "nonce": ' + NONCE + b', "proof": "p"}'])
def test_a_claim_without_the_token_is_refused_cleanly(claim):
    got, out = _claim_then_join(_free_port(), claim)
    (n,) = struct.unpack(">I", got[:4])
    assert got[4:4 + n] == b'{"ok": false, "proof": ""}'  # the refusal, and no proof of rank 0's to learn from
    assert isinstance(out[0], PermissionError) and TOKEN_ENV in str(out[0]) and "refused rank(s)" in str(out[0])


def test_an_authenticated_peer_writes_within_bounds_only():
    """Even a token holder cannot make rank 0's store hold more than MAX_VALUE_BYTES per value or
    MAX_TOTAL_BYTES in all: the connection is closed and the value is not stored."""
    import datetime

    import torch.distributed as dist

    from megatron_fp4.rollout.weight_sync.peer_store import MAX_TOTAL_BYTES, MAX_VALUE_BYTES, RemoteStore, StoreServer
    backend = dist.HashStore()
    backend.set_timeout(datetime.timedelta(seconds=10))
    listen = reserve_port(ADDR)
    server = StoreServer(listen, backend, TOKEN, 3, "g").start()
    port = listen.getsockname()[1]
    one, _ = RemoteStore.connect(ADDR, port, 1, TOKEN, 10, "t")
    one.set("fits", b"x" * MAX_VALUE_BYTES)
    assert backend.get("fits") == b"x" * MAX_VALUE_BYTES and one.get("fits") == b"x" * MAX_VALUE_BYTES
    with pytest.raises(RuntimeError, match="rank 0 closed"):
        one.set("too-big", b"x" * (MAX_VALUE_BYTES + 1))
    assert not backend.check(["too-big"])
    two, _ = RemoteStore.connect(ADDR, port, 2, TOKEN, 10, "t")
    with pytest.raises(RuntimeError, match="rank 0 closed"):
        for i in range(MAX_TOTAL_BYTES // MAX_VALUE_BYTES + 1):
            two.set(f"k{i}", b"y" * MAX_VALUE_BYTES)
    assert backend.num_keys() <= MAX_TOTAL_BYTES // MAX_VALUE_BYTES
    server.close()
