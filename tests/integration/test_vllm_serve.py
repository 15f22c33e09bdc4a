"""Live weight updates into a separate `vllm serve` process through vLLM's weight-transfer API with
the plugin's `megatron_fp4` backend (integrations/vllm/transfer.py, trainer side serve.py).

Two servers on a tiny plugin checkpoint pair (A: seed 0, B: seed 1; MoEResQ experts+attention) on
127.0.0.1 at free ports: A takes B's weights by `WeightPublisher` + `VLLMServerTransport` (start /
update / finish over HTTP, the bytes over the token-authenticated PeerGroup) and then answers the
completions API (greedy tokens + log-probs) exactly as the fresh server B; an update with a NaN, a
wrong shape, an unknown name or the wrong token is refused and A still answers B's bits.

Runs where a vLLM python is found: env MEGATRON_FP4_VLLM_PYTHON (the vLLM venv's python, how the
main environment runs it) or this interpreter when vllm imports (tools/vllm_env.sh). Skips with the
reason otherwise.
"""
from __future__ import annotations

import sys

import pytest
import torch

from megatron_fp4.integrations.hf import load_hf_checkpoint
from megatron_fp4.integrations.vllm import vllm_available
from megatron_fp4.integrations.vllm.remote import ENV_PYTHON, vllm_python
from megatron_fp4.integrations.vllm.serve import ServerError, VLLMServerTransport, start_vllm_server, wait_ready
from megatron_fp4.rollout.weight_sync.peer_group import new_sync_token
from megatron_fp4.rollout.weight_sync.publisher import WeightPublisher, WeightSyncError
from tests.integration.test_vllm_plugin import tiny_cfg, write_hf

VLLM = vllm_available()
PYTHON = vllm_python() or (sys.executable if VLLM else None)
needs_vllm = pytest.mark.skipif(PYTHON is None, reason=f"{VLLM.reason} and {ENV_PYTHON} is unset; run in the vLLM "
                                f"environment (tools/vllm_env.sh) or set {ENV_PYTHON} to its python")
SMALL = ["--max-model-len", "128", "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(32 << 20)]
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [11]]
TOKENS = 8


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_serve")
    cfg = tiny_cfg("experts+attention")
    dirs = [write_hf(root / name, cfg, seed=seed) for name, seed in (("a", 0), ("b", 1))]
    token = new_sync_token()
    started = [start_vllm_server(d, PYTHON, token, extra=SMALL, log=root / f"{d.parent.name}.log", wait=False)
               for d in dirs]
    try:
        for s in started:
            wait_ready(s, timeout_s=600)
        yield started, dirs, token
    finally:
        for s in started:
            s.stop()


def generate(server):
    return server.client.completions(PROMPTS, TOKENS, server.model, ignore_eos=True)


@needs_vllm
@pytest.mark.slow
def test_an_update_through_vllms_api_serves_what_a_fresh_server_on_the_new_weights_does(servers):
    (a, b), (_, dir_b), token = servers
    before = generate(a)
    fresh = generate(b)
    assert before != fresh  # the two weight sets answer differently: the comparison below can fail
    weights_b = load_hf_checkpoint(dir_b)[1]
    transport = VLLMServerTransport(a.url, token=token, timeout_s=120)
    try:
        handle = WeightPublisher(lambda: weights_b.items(), [transport], bucket_bytes=1 << 20).publish(1)
        handle.wait_loaded(300)
        assert handle.num_buckets > 1  # several buckets over the group
        assert a.client.weight_version() == "1"
        after = generate(a)
        assert after == fresh  # tokens and log-probs (JSON floats: exact), bitwise

        # refused before anything is touched: A keeps answering B's bits and its version
        key = "model.layers.1.mlp.experts.3.up_proj.weight"
        nan = {**weights_b, key: weights_b[key].clone().index_fill_(1, torch.tensor([5]), float("nan"))}
        short = {**weights_b, key: weights_b[key][:-1]}
        unknown = {**weights_b, "model.layers.1.mlp.experts.99.up_proj.weight": weights_b[key]}
        for bad, match in ((nan, f"{key}' holds NaN"), (short, f"{key}' has shape"),
                           (unknown, "experts.99.up_proj.weight' is not a tensor of the served")):
            publisher = WeightPublisher(lambda bad=bad: bad.items(), [transport], bucket_bytes=1 << 20)
            with pytest.raises(WeightSyncError, match=match):
                publisher.publish(2).wait_loaded(300)
            assert a.client.weight_version() == "1"
            assert generate(a) == fresh
    finally:
        transport.close()
    # the server failing /update_weights before the exchange (here: vLLM's "start_weight_update must be
    # called before update_weights", the trainer skipping the start) fails the publish after the grace
    # instead of when the group times out, and marks the transport out of step
    transport = VLLMServerTransport(a.url, token=token, timeout_s=30)
    request = transport.client.request
    transport.client.request = lambda route, *a, **k: None if route == "start_weight_update" else request(route, *a, **k)
    publisher = WeightPublisher(lambda: weights_b.items(), [transport], bucket_bytes=1 << 20)
    handle = publisher.publish(3)
    with pytest.raises(WeightSyncError, match="out of step"):
        handle.wait_loaded(25)  # FAIL_GRACE_S 10 < 25 < the group's 30 s timeout
    with pytest.raises(WeightSyncError, match="out of step"):
        transport.send(4, {}, [])
    transport.close()
    assert a.client.weight_version() == "1" and generate(a) == fresh
    # a trainer without the server's token is refused at the join; the server keeps serving
    with pytest.raises(ServerError, match="did not join"):
        VLLMServerTransport(a.url, token=new_sync_token(), timeout_s=60)
    assert generate(a) == fresh


def test_check_sync_with_vllm_serve_is_one_line_and_exit_2(capsys):
    from tests.integration.test_vllm_rollout import _grpo

    with pytest.raises(SystemExit) as e:
        _grpo().parse_args(["--rollout", "vllm-serve", "--check-sync"])
    assert e.value.code == 2 and "use --rollout vllm" in capsys.readouterr().err


@pytest.mark.skipif(not VLLM, reason=f"{VLLM.reason}: the server side's init info is vLLM's dataclass")
def test_the_servers_init_info_is_checked():
    from megatron_fp4.integrations.vllm.transfer import FP4InitInfo, FP4UpdateInfo

    FP4InitInfo(addr="127.0.0.1", port=5000)
    for bad, match in (({"port": 0}, "port"), ({"port": "5000"}, "port"), ({"timeout_s": float("inf")}, "timeout_s"),
                       ({"timeout_s": 1e300}, r"timeout_s=1e\+300 must be .* \(0, 604800\]"),
                       ({"timeout_s": True}, "timeout_s"),
                       ({"addr": ""}, "addr"), ({"bind_addr": 7}, "bind_addr")):
        with pytest.raises(ValueError, match=match):
            FP4InitInfo(**{"addr": "127.0.0.1", "port": 5000, **bad})
    with pytest.raises(ValueError, match="version"):
        FP4UpdateInfo(version="1")


def test_the_transport_needs_the_servers_token(monkeypatch):
    monkeypatch.delenv("MEGATRON_FP4_SYNC_TOKEN", raising=False)
    with pytest.raises(ValueError, match="MEGATRON_FP4_SYNC_TOKEN"):
        VLLMServerTransport("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="pause_mode"):
        VLLMServerTransport("http://127.0.0.1:1", token="x" * 32, pause_mode="later")


@needs_vllm
@pytest.mark.slow
def test_grpo_two_steps_with_a_vllm_serve_rollout(tmp_path):
    """`examples/grpo_moeresq.py --rollout vllm-serve`: the first publish replaces the template's fresh
    init (step 0's vLLM log-probs match the trainer's old log-probs: the trainer's SFT weights are
    served), step 1 generates on version 1 (vLLM's /weight_info) and still matches."""
    from tests.integration.test_vllm_plugin import MIN_WITHIN, TOL
    from tests.integration.test_vllm_rollout import MODEL, _grpo

    grpo = _grpo()
    python = [] if PYTHON == sys.executable else ["--vllm-python", PYTHON]
    args = grpo.parse_args(["--rollout", "vllm-serve", *python, "--task", "arithmetic", "--steps", "2",
                            "--sft-steps", "2", "--eval-size", "8", "--num-prompts", "4", "--group-size", "4",
                            "--rl-aux-coef", "0.01", "--logdir", str(tmp_path), *[a for o in MODEL for a in ("--set", o)]])
    history = grpo.run(args)
    assert [h["rollout_version"] for h in history] == [0, 1] and history[-1]["final_rollout_version"] == 2
    d = history[0]["lp_diffs"]
    print(f"step 0: |dlogp| max {d.max():.3g} median {d.median():.3g}; step 1: mean "
          f"{history[1]['consistency/mean_abs_diff']:.3g} max {history[1]['consistency/max_abs_diff']:.3g}")
    assert d.median() <= TOL and (d <= TOL).double().mean() >= MIN_WITHIN, d.tolist()
    assert history[1]["consistency/mean_abs_diff"] <= 1e-3, history[1]  # FP4 code flips only (test_vllm_plugin)


def test_client_reads_a_whole_completions_reply_and_bounds_control_replies(monkeypatch):
    """A completions reply over the control routes' 1 MiB bound is read whole (it used to be cut at
    1 MiB and then fail to parse); a control route's reply over its bound is one clear error."""
    import http.server
    import json
    import threading

    from megatron_fp4.integrations.vllm import serve

    big = json.dumps({"choices": [{"text": "x" * (serve.MAX_REPLY_BYTES + 10)}]}).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802  (http.server's name)
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Length", str(len(big)))
            self.end_headers()
            self.wfile.write(big)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = serve.VLLMServerClient(f"http://127.0.0.1:{httpd.server_address[1]}", timeout_s=30)
        assert len(client.request("v1/completions", {})["choices"][0]["text"]) == serve.MAX_REPLY_BYTES + 10
        with pytest.raises(ServerError, match="reply longer than"):
            client.request("update_weights", {})
        monkeypatch.setattr(serve, "MAX_COMPLETION_BYTES", 1 << 10)
        with pytest.raises(ServerError, match="reply longer than 1024 bytes"):
            client.request("v1/completions", {})
    finally:
        httpd.shutdown()
        httpd.server_close()


@needs_vllm
@pytest.mark.slow
def test_overlapped_grpo_under_torchrun_with_a_vllm_serve_rollout(tmp_path):
    """``--max-staleness 1`` with ``--rollout vllm-serve`` on a 2-process gloo trainer (dp=2): rank 0
    asks the server for the next batch on the rollout's thread while both ranks train, the batch is
    broadcast to both on the main thread (`VLLMServeRollout.fetch`/`share`). Batch m is sampled by
    version max(0, m - 1) (``wait``: exactly; vLLM's /weight_info reports it), every step updates."""
    import json
    import os
    import subprocess

    from pathlib import Path

    from tests.distributed.launch import free_port
    from tests.integration.test_vllm_rollout import MODEL

    root = Path(__file__).resolve().parents[2]

    out = tmp_path / "serve.json"
    flags = ["--rollout", "vllm-serve", "--vllm-python", PYTHON, "--set", "dtype=fp32",
             *[a for o in MODEL for a in ("--set", o)]]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), str(root / "tests" / "integration" / "async_grpo_job.py"), str(out),
                           *flags], cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = json.loads(out.read_text())
    assert [s["version"] for s in steps] == [0, 0, 1]
    assert all(float.fromhex(s["loss"]) == float.fromhex(s["loss"]) for s in steps)  # finite, not NaN
