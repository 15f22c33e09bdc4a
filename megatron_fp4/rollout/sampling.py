"""Sampling parameters and the logits processor of the rollout engine.

Everything here works on one request's logits row at a time so that a request's tokens depend only
on its own logits and its own seeded `torch.Generator`, never on which other requests share the
batch.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch


# Below this a temperature scales finite logits past float32's range (|logit| / 1e-5 overflows only
# beyond 3.4e33); vLLM treats temperatures under the same 1e-5 as greedy.
MIN_TEMPERATURE = 1e-5


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep the k most likely tokens (0 = off). top_p: nucleus mass to keep (1.0 = off).
    stop_token_ids: generation of a request ends after it emits one of these (it is kept).
    seed: seeds the request's own generator; None draws one from the engine's seed stream.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple = ()
    seed: Optional[int] = None

    def __post_init__(self):
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if not _is_real(self.temperature) or not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature
                                                   < float("inf")):
            raise ValueError(f"SamplingParams.temperature={self.temperature!r} must be 0 (greedy) or a finite number "
                             f">= {MIN_TEMPERATURE} (smaller ones overflow the scaled logits to inf)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k!r} must be an integer >= 0 (0 disables top-k)")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p!r} must be in (0, 1] (1.0 disables top-p)")
        if self.seed is not None and (not _is_int(self.seed) or not -(1 << 63) <= self.seed < 1 << 64):
            raise ValueError(f"SamplingParams.seed={self.seed!r} must be None or an integer in [-2**63, 2**64) "
                             "(what torch.Generator.manual_seed takes)")
        try:
            stop = tuple(operator.index(t) for t in self.stop_token_ids)  # ints, numpy ints, 0-d int tensors
        except TypeError:
            raise ValueError(f"SamplingParams.stop_token_ids={self.stop_token_ids!r} must be integer token "
                             "ids") from None
        object.__setattr__(self, "stop_token_ids", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sampling_log_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution actually sampled from (fp32, same shape as logits
    [..., V]): temperature, then top-k, then top-p (vLLM's order). Removed tokens get -inf.
    Greedy is the point mass on the argmax (log-prob 0 there, -inf elsewhere)."""
    logits = logits.float()
    if params.greedy:
        out = torch.full_like(logits, float("-inf"))
        return out.scatter(-1, logits.argmax(-1, keepdim=True), 0.0)
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(-1) - probs  # probability mass of strictly more likely tokens
        remove_sorted = mass_before >= params.top_p  # the first token always stays (mass_before = 0)
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        scaled = scaled.masked_fill(remove, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def sample_token(sample_log_probs: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Draw one token id from a [V] log-prob row with the request's generator."""
    if params.greedy:
        return int(sample_log_probs.argmax())
    return int(torch.multinomial(sample_log_probs.exp(), 1, generator=generator))
