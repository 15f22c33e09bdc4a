"""An outsider (no MEGATRON_FP4_SYNC_TOKEN) attacks the join of a weight-sync `PeerGroup` on 127.0.0.1.

* rendezvous hijack: the attacker talks to rank 0's store as a plain torch TCPStore client, runs a
  gloo process group of its own as rank 1 (or 0) on it, and keeps re-writing every gloo address
  key (`0/1`, `0/0`, and the same under any prefix it can list) with its own address while the
  token holders join. Before the fix gloo took those unauthenticated keys: rank 0 connected to the
  attacker, sent it its bytes and accepted its data.
* store flooding: the attacker writes 60 x 4 MB values before the join (+248 MB held on rank 0).

Threads of this process, no spawning: the groups join through real sockets on 127.0.0.1."""
import datetime
import socket
import struct
import threading
import time

import pytest
import torch
import torch.distributed as dist

from megatron_fp4.rollout.weight_sync.peer_group import PeerGroup, reserve_port

pytestmark = pytest.mark.faults
ADDR = "127.0.0.1"
TOKEN = "c" * 64
SECRET0, SECRET1, FORGED = 1234.0, 5678.0, -666.0


class _Recorder(dist.Store):
    """The attacker's store for its own gloo group: forwards to its TCPStore client and remembers
    the address its gloo group published."""

    def __init__(self, client):
        super().__init__()
        self.client, self.published = client, {}

    def set(self, key, value):
        self.published[key] = value
        self.client.set(key, value)

    def get(self, key):
        return self.client.get(key)

    def wait(self, keys, timeout=None):
        self.client.wait(keys)

    def check(self, keys):
        return self.client.check(keys)

    def add(self, key, amount):
        return self.client.add(key, amount)


def _client(port):
    return dist.TCPStore(ADDR, port, 2, False, datetime.timedelta(seconds=2))


class _Attacker:
    def __init__(self, port, rank):
        self.port, self.rank = port, rank
        self.stop = threading.Event()
        self.tried = threading.Event()  # it connected and published, or could not get that far
        self.received, self.errors = [], []

    def start(self):
        self.threads = [threading.Thread(target=self._gloo, daemon=True)]
        self.threads[0].start()
        return self

    def finish(self):
        """Stop, and wait for the attacker's threads (none may be inside torch when the test ends)."""
        self.stop.set()
        for th in self.threads:
            th.join(60)

    def _gloo(self):
        while not self.stop.is_set():
            try:
                store = _Recorder(_client(self.port))
                self.threads.append(threading.Thread(target=self._rewrite, args=(store,), daemon=True))
                self.threads[-1].start()
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = datetime.timedelta(seconds=15)
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=ADDR)]
                pg = dist.ProcessGroupGloo(store, self.rank, 2, opts)
                out = [torch.zeros(1), torch.zeros(1)]  # what the victim's all_gather hands it
                pg.allgather([out], [torch.tensor([FORGED])]).wait()
                self.received.extend(float(t) for t in out)
                return
            except Exception as err:  # noqa: BLE001 - recorded: the attack failed this time
                self.errors.append(f"{type(err).__name__}: {err}")
                self.tried.set()

    def _rewrite(self, store):
        """Keep every gloo address key pointing at the attacker's group."""
        try:
            client = _client(self.port)
            mine = f"0/{self.rank}"
            while not self.stop.is_set():
                value = store.published.get(mine)
                if value is None:
                    time.sleep(0.001)
                    continue
                self.tried.set()
                keys = {mine} | {k for k in client.list_keys() if k.endswith("/" + mine)}
                for key in keys:
                    client.set(key, value)
        except Exception as err:  # noqa: BLE001
            self.errors.append(f"{type(err).__name__}: {err}")
            self.tried.set()


def _join_and_exchange(rank, port, listen, out):
    group = None
    try:
        group = PeerGroup(ADDR, port, rank, 2, torch.device("cpu"), timeout_s=20, listen_socket=listen,
                          token=TOKEN)
        got = group.all_gather(torch.tensor([SECRET0 if rank == 0 else SECRET1]))
        out[rank] = [float(t) for t in got]
    except Exception as err:  # noqa: BLE001 - inspected by the test
        out[rank] = err
    finally:
        if group is not None:
            group.close()


@pytest.mark.parametrize("attacker_rank", [1, 0])
def test_an_outsider_cannot_take_a_side_of_the_group(attacker_rank):
    listen = reserve_port(ADDR)
    port = listen.getsockname()[1]
    out = {}
    rank0 = threading.Thread(target=_join_and_exchange, args=(0, port, listen, out), daemon=True)
    rank0.start()
    attacker = _Attacker(port, attacker_rank).start()
    assert attacker.tried.wait(30)  # it published its address (old code) or was turned away
    rank1 = threading.Thread(target=_join_and_exchange, args=(1, port, None, out), daemon=True)
    rank1.start()
    rank0.join(60)
    rank1.join(60)
    attacker.finish()
    assert out.get(0) == [SECRET0, SECRET1], (out, attacker.received)  # rank 0 got the real rollout's data
    assert out.get(1) == [SECRET0, SECRET1], (out, attacker.received)
    assert attacker.received == [], attacker.received  # and the attacker none of rank 0's


def test_an_outsider_cannot_fill_the_store_before_the_join():
    listen = reserve_port(ADDR)
    port = listen.getsockname()[1]
    out = {}
    rank0 = threading.Thread(target=_join_and_exchange, args=(0, port, listen, out), daemon=True)
    rank0.start()
    value = b"x" * (4 << 20)
    stored = 0
    try:
        client = _client(port)
        for i in range(60):
            client.set(f"junk/{i}", value)
            stored += len(client.get(f"junk/{i}"))
    except Exception:  # noqa: BLE001 - turned away: nothing of it is held
        pass
    # the same bytes framed the way a peer talks to the fixed store, before proving the token
    with socket.create_connection((ADDR, port), timeout=10) as raw:
        try:
            raw.recv(4096)  # the server's greeting, if any
            raw.sendall(struct.pack(">I", len(value)) + value)
            closed = raw.recv(1) == b""
        except OSError:  # reset: refused while sending
            closed = True
    rank1 = threading.Thread(target=_join_and_exchange, args=(1, port, None, out), daemon=True)
    rank1.start()
    rank0.join(60)
    rank1.join(60)
    assert stored == 0, f"an outsider stored {stored} bytes in rank 0's store before the join"
    assert closed, "the server kept reading an unauthenticated 4 MB frame"
    assert out.get(0) == out.get(1) == [SECRET0, SECRET1], out  # the join still works


def test_a_connection_taken_over_after_the_rendezvous_fails_the_join(monkeypatch):
    """Someone racing to gloo's listening port could take rank 1's place on rank 0's connection
    after an honest rendezvous: simulated by what rank 0 receives over the group being the
    attacker's. The group's first exchange (each rank's HMAC of the group nonce) refuses it."""
    real = PeerGroup.all_gather

    def hijacked(self, tensor):
        out = real(self, tensor)
        if self.rank() == 0:
            out[1] = torch.full_like(out[1], 7)  # not what rank 1 sent
        return out
    monkeypatch.setattr(PeerGroup, "all_gather", hijacked)
    listen = reserve_port(ADDR)
    port, out = listen.getsockname()[1], {}
    threads = [threading.Thread(target=_join_and_exchange, args=(r, port, listen if r == 0 else None, out), daemon=True)
               for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert isinstance(out[0], PermissionError), out
    assert "group rank(s) [1] do not come from a holder" in str(out[0]) and "MEGATRON_FP4_SYNC_TOKEN" in str(out[0])
