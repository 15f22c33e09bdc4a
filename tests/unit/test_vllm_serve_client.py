"""The trainer side of `vllm serve` weight updates and generation (integrations/vllm/serve.py) and
the update's dtype check (live.check_manifest), without vLLM: a fake HTTP server answers the routes.

- a reply that is not vLLM's (an HTML page, a JSON list, an object without `choices`, a choice of
  another form) is a `ServerError` naming the route and what came back, not a raw
  JSONDecodeError / TypeError / KeyError;
- a server answering 404 to `/init_weight_transfer_engine` (started without VLLM_SERVER_DEV_MODE)
  fails the transport with that reply and the likely fix, instead of the group's join timeout;
- an update of a dtype the check cannot sum (float8) is refused by name up front, not by torch's
  NotImplementedError from the finiteness sum."""
import http.server
import json
import threading

import pytest
import torch

from megatron_fp4.integrations.vllm import serve
from megatron_fp4.integrations.vllm.live import UPDATE_DTYPES, check_manifest, check_update
from megatron_fp4.integrations.vllm.serve import ServerError, VLLMServerClient, VLLMServerTransport

CHOICE = {"index": 0, "finish_reason": "length", "logprobs": {"tokens": ["token_id:5", "token_id:7"],
                                                             "token_logprobs": [-0.5, -1.25]}}


@pytest.fixture
def fake_server():
    """(url, routes): `routes[path] = (status, body bytes)` is what the server answers there."""
    routes = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status, body = routes.get(self.path.split("?")[0], (404, b'{"detail": "Not Found"}'))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        do_GET = do_POST = _answer  # noqa: N815 (http.server's names)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", routes
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("body, message", [
    (b"<html><body>502 Bad Gateway</body></html>", r"the reply is not JSON \('<html><body>502 Bad Gateway"),
    (b"[1, 2]", r"expected a JSON object with 'choices', got '\[1, 2\]'"),
    (b'{"object": "error", "message": "model not found"}', r"expected a JSON object with 'choices', got .*model not"),
    (b'{"choices": {"0": 1}}', "'choices' is not a list of objects with an integer 'index'"),
    (b'{"choices": [{"index": 0, "text": "hi"}]}', r"a choice of an unexpected form \(KeyError: 'logprobs'\)"),
    (json.dumps({"choices": [{**CHOICE, "logprobs": {"tokens": ["hi"], "token_logprobs": [-1.0]}}]}).encode(),
     "token 'hi' is not 'token_id:N'"),
    (json.dumps({"choices": [{**CHOICE, "logprobs": {"tokens": ["token_id:1"], "token_logprobs": []}}]}).encode(),
     "token_logprobs is not 1 numbers")])
def test_completions_replies_of_another_form_name_the_route(fake_server, body, message):
    url, routes = fake_server
    routes["/v1/completions"] = (200, body)
    client = VLLMServerClient(url, timeout_s=30)
    with pytest.raises(ServerError, match=f"POST {url}/v1/completions: .*{message}"):
        client.completions([[1, 2]], 2, "m")


def test_a_completions_reply_of_vllms_form_parses(fake_server):
    url, routes = fake_server
    second = {**CHOICE, "index": 1, "finish_reason": "stop"}
    routes["/v1/completions"] = (200, json.dumps({"choices": [second, CHOICE]}).encode())
    client = VLLMServerClient(url, timeout_s=30)
    assert client.completions([[1], [2]], 2, "m") == [([5, 7], [-0.5, -1.25])] * 2
    assert [c[2] for c in client.choices({})] == ["length", "stop"]  # in prompt order


@pytest.mark.parametrize("body, message", [(b"[]", r"expected a JSON object with 'weight_version', got '\[\]'"),
                                           (b'{"version": "3"}', "expected a JSON object with 'weight_version'"),
                                           (b'{"weight_version": 3}', "weight_version '3' is not a string or null")])
def test_weight_info_of_another_form_names_the_route(fake_server, body, message):
    url, routes = fake_server
    routes["/weight_info"] = (200, body)
    with pytest.raises(ServerError, match=f"GET {url}/weight_info: {message}"):
        VLLMServerClient(url, timeout_s=30).weight_version()
    routes["/weight_info"] = (200, b'{"weight_version": "3"}')
    assert VLLMServerClient(url, timeout_s=30).weight_version() == "3"


def test_a_server_without_the_weight_routes_fails_the_transport_with_its_reply(fake_server):
    """The init route answers 404 at once: the error is that reply and the fix, not the join's
    timeout (a TimeoutError from the group after timeout_s before)."""
    url, _ = fake_server  # every route: 404 {"detail": "Not Found"}, as vLLM without VLLM_SERVER_DEV_MODE
    with pytest.raises(ServerError) as info:
        VLLMServerTransport(url, token="t" * 64, timeout_s=20)
    message = str(info.value)
    assert f"{url}: the server refused to join the weight transfer: POST {url}/init_weight_transfer_engine: " \
           "HTTP 404" in message and "Not Found" in message and "VLLM_SERVER_DEV_MODE=1" in message, message
    assert "did not join within" not in message


def test_updates_of_dtypes_the_check_cannot_sum_are_refused_by_name():
    served = {"w": (4,)}
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int64, torch.complex64, torch.bool):
        with pytest.raises(ValueError, match=f"update_weights: 'w' is {dtype}; an update holds floating-point"):
            check_manifest(served, {"w": ((4,), dtype)})
        with pytest.raises(ValueError, match=f"'w' is {dtype}"):
            check_update(served, {"w": torch.zeros(4).to(dtype)})
    for dtype in UPDATE_DTYPES:  # each is summed by the finiteness check
        check_update(served, {"w": torch.ones(4, dtype=dtype)})
        with pytest.raises(ValueError, match="'w' holds NaN/Inf"):
            check_update(served, {"w": torch.full((4,), float("nan"), dtype=dtype)})
