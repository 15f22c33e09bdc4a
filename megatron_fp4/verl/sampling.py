"""verl's per-request sampling dict (what its agent loop sends a rollout server, vLLM's names) ->
our `SamplingParams`.

verl sends {temperature, top_p, top_k, repetition_penalty, logprobs} and optionally max_tokens
(or SGLang's max_new_tokens). vLLM conventions: top_k -1 (or 0) = off, temperature 0 = greedy. Log-probs
are always returned (the trainer's IS correction needs them), so `logprobs` only has to be valid.
Anything this engine cannot honour is a ValueError naming the key, never silently ignored.
"""
from __future__ import annotations

from typing import Optional

from megatron_fp4.rollout.sampling import SamplingParams

_KNOWN = {"temperature", "top_p", "top_k", "repetition_penalty", "logprobs", "max_tokens", "max_new_tokens",
          "seed", "stop_token_ids"}


def sampling_from_verl(params: dict, response_length: int, stop_token_ids: tuple = (),
                       seed: Optional[int] = None) -> SamplingParams:
    unknown = sorted(set(params) - _KNOWN)
    if unknown:
        raise ValueError(f"sampling params {unknown} are not supported by the megatron_fp4 rollout; it takes "
                         f"{sorted(_KNOWN)}")
    if float(params.get("repetition_penalty", 1.0)) != 1.0:
        raise ValueError(f"repetition_penalty={params['repetition_penalty']}: the megatron_fp4 rollout samples "
                         "from the model's distribution (what the trainer scores); use 1.0")
    max_tokens = params.get("max_tokens", params.get("max_new_tokens"))
    # verl caps a request at the configured response_length (its batches are [B, response_length])
    length = int(response_length if max_tokens is None else min(int(max_tokens), response_length))
    top_k = int(params.get("top_k", -1) if params.get("top_k") is not None else -1)
    stop = params.get("stop_token_ids")
    request_seed = params.get("seed", seed)
    return SamplingParams(max_new_tokens=length, temperature=float(params.get("temperature", 1.0)),
                          top_k=max(0, top_k), top_p=float(params.get("top_p", 1.0)),
                          stop_token_ids=tuple(stop) if stop is not None else tuple(stop_token_ids),
                          seed=None if request_seed is None else int(request_seed))
