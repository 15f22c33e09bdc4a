"""SECURITY.md: listeners bind the address they advertise. A wildcard or empty address given as the
advertised one (`reserve_port`, verl's checkpoint engine's master_addr, the vLLM-serve transport's
addr and server host, the GRPO example's --rollout-addr) is refused with a message naming the field
and the fix, before anything listens — it used to bind every interface."""
import socket
import sys
from pathlib import Path

import pytest

import torch

from megatron_fp4.rollout.weight_sync.peer_group import PeerGroup, check_advertised_address, reserve_port

ROOT = Path(__file__).resolve().parents[2]
WILDCARDS = ["0.0.0.0", "::", "[::]", "0:0:0:0:0:0:0:0", "", "  ", None]


@pytest.mark.parametrize("addr", WILDCARDS + ["0"])  # "0" is a name that resolves to the IPv4 wildcard
def test_reserve_port_refuses_wildcards(addr):
    with pytest.raises(ValueError, match=r"addr=.* is a wildcard address: a listener there binds every interface.*"
                                         r"give the address peers reach this host at"):
        reserve_port(addr)


def test_reserve_port_binds_exactly_the_advertised_address():
    sock = reserve_port("127.0.0.1")
    try:
        assert sock.getsockname()[0] == "127.0.0.1" and sock.family == socket.AF_INET
    finally:
        sock.close()
    assert check_advertised_address("localhost") == "localhost"


@pytest.mark.parametrize("addr", ["0.0.0.0", "::"])
def test_peer_group_refuses_a_wildcard_for_what_gloo_binds(addr):
    """Rank 0's gloo listener binds `addr` even with a socket reserved elsewhere; any rank's binds
    `bind_addr`: neither may be a wildcard (refused before any socket or thread)."""
    sock = reserve_port("127.0.0.1")
    try:
        with pytest.raises(ValueError, match=f"addr={addr!r} is a wildcard address"):
            PeerGroup(addr, sock.getsockname()[1], 0, 2, torch.device("cpu"), 5, sock, token="t" * 64)
    finally:
        sock.close()
    with pytest.raises(ValueError, match=f"bind_addr={addr!r} is a wildcard address"):
        PeerGroup("127.0.0.1", 1, 1, 2, torch.device("cpu"), 5, token="t" * 64, bind_addr=addr)


@pytest.mark.parametrize("addr", ["0.0.0.0", "::", ""])
def test_verl_master_addr_is_refused_at_construction(addr):
    pytest.importorskip("verl")
    from megatron_fp4.verl import MegatronFP4CheckpointEngine
    with pytest.raises(ValueError, match=f"master_addr={addr!r} is a wildcard address"):
        MegatronFP4CheckpointEngine(master_addr=addr)


@pytest.mark.parametrize("addr", ["0.0.0.0", "::"])
def test_vllm_serve_transport_and_server_refuse_wildcards(addr, tmp_path):
    from megatron_fp4.integrations.vllm.serve import VLLMServerTransport, start_vllm_server
    with pytest.raises(ValueError, match=f"addr={addr!r} is a wildcard address"):  # before any HTTP request
        VLLMServerTransport("http://127.0.0.1:9", addr=addr, token="t" * 64, timeout_s=1)
    with pytest.raises(ValueError, match=f"host={addr!r} is a wildcard address"):  # before anything starts
        start_vllm_server(tmp_path / "model", python=str(tmp_path / "no-python"), token="t" * 64, host=addr)


def test_grpo_example_refuses_a_wildcard_rollout_addr(capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        ex = __import__("grpo_moeresq")
    finally:
        sys.path.remove(str(ROOT / "examples"))
    with pytest.raises(SystemExit) as exit_info:
        ex.parse_args(["--rollout-addr", "0.0.0.0"])
    assert exit_info.value.code == 2
    assert "--rollout-addr='0.0.0.0' is a wildcard address" in capsys.readouterr().err.strip().splitlines()[-1]
