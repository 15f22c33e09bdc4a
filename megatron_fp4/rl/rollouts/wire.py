"""Rollout requests and results between processes: JSON headers and plain tensors, never pickle.

A `GenerationOutput` travels as one `parallel.wire` message: a JSON header (version, token ids,
finish reasons, routing shape, whether versions per token follow) and flat tensors (log-probs as
float32, what the engine produces, routing as int64 and the weight version behind each token as
int64: checked to be >= the header's version and non-decreasing along each response), so the
receiver parses data and checks its form; nothing it receives can execute. The same codec carries a generation from the rollout process to trainer rank 0 (a
`PeerGroup`) and from rank 0 to every trainer rank (the trainer's world group).

A receiver that knows the request (`expected_generation`: the prompts, each one's max_new_tokens,
the routing shape the model gives, the vocabulary) checks every size in the header against it
before allocating: the prompts echoed, at most max_new_tokens ids in the vocabulary per
response, routing exactly [num_moe_layers, top_k] when asked for and absent otherwise.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_fp4.parallel.wire import ProtocolError, broadcast_message
from megatron_fp4.rollout.engine import GenerationOutput
from megatron_fp4.rollout.sampling import SamplingParams

MAX_TOKENS = 1 << 28  # generated tokens in one result; more is not a rollout batch
MAX_PAYLOAD_BYTES = 1 << 32  # its log-probs and routing together
HEADER_KEYS = {"version", "prompt_ids", "response_ids", "finish_reasons", "routing"}  # + optional token_versions
SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "stop_token_ids", "seed")


def params_to_json(params: SamplingParams) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in
            ((f, getattr(params, f)) for f in SAMPLING_FIELDS if hasattr(params, f))}


def params_from_json(obj) -> SamplingParams:
    if not isinstance(obj, dict) or not set(obj) <= set(SAMPLING_FIELDS):
        raise ProtocolError(f"sampling parameters must be a dict of {SAMPLING_FIELDS}, got {str(obj)[:200]}")
    if "stop_token_ids" in obj:
        obj = {**obj, "stop_token_ids": tuple(int(t) for t in obj["stop_token_ids"])}
    return SamplingParams(**obj)


def _int_lists(obj, what: str) -> list:
    if not isinstance(obj, list) or not all(isinstance(r, list) and all(type(t) is int for t in r) for r in obj):
        raise ProtocolError(f"{what} must be a list of lists of token ids")
    return obj


def expected_generation(prompts, params, return_routing: bool, model_cfg) -> dict:
    """What a generation answering this request may contain (`broadcast_generation(expect=...)`);
    `model_cfg`: the `ModelConfig` of the model that generates."""
    num_moe = sum(1 for i in range(model_cfg.num_layers) if i not in model_cfg.dense_layers)
    return {"prompt_ids": [list(map(int, p)) for p in prompts],
            "max_new_tokens": [int(p.max_new_tokens) for p in params],
            "routing": [num_moe, int(model_cfg.top_k)] if return_routing else None,
            "vocab_size": int(model_cfg.vocab_size)}


def _check_against_request(prompts, responses, reasons, routing, expect: dict) -> None:
    if prompts != expect["prompt_ids"]:
        raise ProtocolError(f"a generation for {len(prompts)} prompt(s) that are not the {len(expect['prompt_ids'])} "
                            "requested")
    for i, (response, limit) in enumerate(zip(responses, expect["max_new_tokens"])):
        if len(response) > limit:
            raise ProtocolError(f"response {i} has {len(response)} tokens; the request allowed {limit}")
        if any(not 0 <= t < expect["vocab_size"] for t in response):
            raise ProtocolError(f"response {i} holds a token id outside the vocabulary [0, {expect['vocab_size']})")
    if not all(isinstance(r, str) and len(r) <= 64 for r in reasons):
        raise ProtocolError("finish_reasons must be short strings")
    if routing != expect["routing"]:
        raise ProtocolError(f"routing {routing} where the request asked for {expect['routing']} "
                            "([num_moe_layers, top_k] of the model, or null)")


def _header(gen: GenerationOutput) -> dict:
    routing = None if gen.routing is None else list(gen.routing[0].shape[1:]) if gen.routing else [0, 0]
    return {"version": int(gen.version), "prompt_ids": [list(map(int, p)) for p in gen.prompt_ids],
            "response_ids": [list(map(int, r)) for r in gen.response_ids],
            "finish_reasons": list(gen.finish_reasons), "routing": routing,
            "token_versions": gen.token_versions is not None}


def _check_header(h) -> tuple:
    if not isinstance(h, dict) or set(h) - {"token_versions"} != HEADER_KEYS or type(h["version"]) is not int \
            or type(h.get("token_versions", False)) is not bool:
        raise ProtocolError("a generation header must be {version, prompt_ids, response_ids, finish_reasons, routing} "
                            "and optionally token_versions (a bool)")
    prompts, responses = _int_lists(h["prompt_ids"], "prompt_ids"), _int_lists(h["response_ids"], "response_ids")
    reasons, routing = h["finish_reasons"], h["routing"]
    if len(prompts) != len(responses) or not isinstance(reasons, list) or len(reasons) != len(responses):
        raise ProtocolError("prompt_ids, response_ids and finish_reasons must have one entry per request")
    if routing is not None and not (isinstance(routing, list) and len(routing) == 2
                                    and all(type(n) is int and 0 <= n < 1 << 16 for n in routing)):
        raise ProtocolError("routing must be null or [num_moe_layers, top_k]")
    n = sum(len(r) for r in responses)
    if n > MAX_TOKENS:
        raise ProtocolError(f"a generation of {n} tokens (allowed: {MAX_TOKENS})")
    return prompts, responses, reasons, routing, n


def _specs(n: int, routing: Optional[list], token_versions: bool) -> list:
    """The tensors of a generation of `n` tokens: log-probs and sampled log-probs (float32), routing,
    versions per token (int64)."""
    return [((n,), torch.float32)] * 2 + ([] if routing is None else [((n, *routing), torch.int64)]) \
        + ([((n,), torch.int64)] if token_versions else [])


def _check_versions(per_request: list, version: int) -> None:
    for i, v in enumerate(per_request):
        if len(v) and (int(v[0]) < version or bool((v[1:] < v[:-1]).any())):
            raise ProtocolError(f"response {i}: token versions must start at >= the generation's version {version} "
                                "and never decrease (a weight swap only moves forward)")


def broadcast_generation(gen: Optional[GenerationOutput], src: int, group, device=None,
                         expect: Optional[dict] = None) -> GenerationOutput:
    """`gen` from `src` of `group` (a torch.distributed group, None: the default one, or a
    `PeerGroup`); every other rank passes None and gets the same generation back, checked against
    `expect` (`expected_generation` of the request) before anything is allocated."""
    device = device or torch.device("cpu")
    checked = {}

    def tensors_for(header) -> list:
        checked["header"] = prompts, responses, reasons, routing, n = _check_header(header)
        if expect is not None:
            _check_against_request(prompts, responses, reasons, routing, expect)
        return _specs(n, routing, header.get("token_versions", False))

    header, tensors = generation_message(gen) if gen is not None else (None, None)
    header, tensors = broadcast_message(header, tensors, src, group, device,
                                        expect=tensors_for, max_payload_bytes=MAX_PAYLOAD_BYTES)
    return _generation(header, tensors, checked["header"])


def generation_message(gen: GenerationOutput) -> tuple[dict, list]:
    """(JSON header, flat tensors) of a generation: what travels, or is saved (`rl.resume`)."""
    n = sum(len(r) for r in gen.response_ids)
    tensors = [torch.cat([torch.as_tensor(x, dtype=torch.float32).reshape(-1) for x in getattr(gen, key)])
               if n else torch.empty(0, dtype=torch.float32) for key in ("log_probs", "sampled_log_probs")]
    if gen.routing is not None:
        shape = _header(gen)["routing"]
        tensors.append(torch.cat(gen.routing).to(torch.int64) if n else torch.empty(0, *shape, dtype=torch.int64))
    if gen.token_versions is not None:
        tensors.append(torch.cat([torch.as_tensor(v, dtype=torch.int64).reshape(-1) for v in gen.token_versions])
                       if n else torch.empty(0, dtype=torch.int64))
    return _header(gen), tensors


def generation_from_message(header, tensors: list, expect: Optional[dict] = None) -> GenerationOutput:
    """The inverse of `generation_message`, with every check `broadcast_generation` makes."""
    checked = _check_header(header)
    if expect is not None:
        _check_against_request(*checked[:4], expect)
    specs = _specs(checked[4], checked[3], header.get("token_versions", False))
    if len(tensors) != len(specs) or any((tuple(t.shape), t.dtype) != (tuple(shape), dtype)
                                         for t, (shape, dtype) in zip(tensors, specs)):
        raise ProtocolError(f"a generation's tensors {[(tuple(t.shape), t.dtype) for t in tensors]} are not the "
                            f"{specs} its header describes")
    return _generation(header, tensors, checked)


def _generation(header: dict, tensors: list, checked: tuple) -> GenerationOutput:
    prompts, responses, reasons, routing, _ = checked
    lengths = [len(r) for r in responses]
    flat = [list(t.cpu().split(lengths)) for t in tensors]
    versions = flat[-1] if header.get("token_versions", False) else None
    if versions is not None:
        _check_versions(versions, header["version"])
    return GenerationOutput(prompt_ids=prompts, response_ids=responses, log_probs=flat[0], sampled_log_probs=flat[1],
                            finish_reasons=reasons, version=header["version"],
                            routing=flat[2] if routing is not None else None, token_versions=versions)
