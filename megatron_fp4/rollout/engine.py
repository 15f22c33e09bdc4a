"""The rollout engine: batched KV-cache generation with the training model's own code and numerics.

    engine = RolloutEngine(model, mode=cfg.fp4.rollout_mode, pad_id=tok.pad_id)
    out = engine.generate([tok.encode("12+7=", add_eos=False)], SamplingParams(temperature=0))

Prompts are left-padded; the attention mask marks real tokens and positions are ``cumsum(mask) - 1``
so a prompt gets the same positions (and, with per-row FP4 activation scales, the same numerics)
alone or in any batch. Each request samples from its own seeded `torch.Generator`.

``dtype=torch.bfloat16`` runs the engine the way inference engines do: the engine's model becomes a
bf16 copy (activations, KV cache and logits in bf16) while every MoE router weight stays fp32 (the
router computes in fp32 either way, `model.moe.Router`); `load_weights` then accepts the trainer's
fp32 tensors and rounds them on copy. The default (None) keeps the model's own dtype.

Numerics: by default the engine decodes in the batch-invariant mode (``fp4/invariant.py``,
``numerics.invariance`` in the config): a token's log-prob and experts then do not depend on
the batch, its padding or the KV cache, and equal bit for bit what ``rollout.scoring`` computes
for the same tokens in a full forward. ``invariance="standard"`` runs the standard kernels.

Weights change only through `load_weights`, which swaps a fully staged set under the write side of
a reader/writer lock; `generate` holds the read side, so a request sees one version, whole. Waits
for the lock are bounded (`lock_timeout_s`): a request that never returns fails the swap with
`LockTimeout` instead of stalling every update and every request queued behind it.

Versions per token: `GenerationOutput.token_versions[i][t]` is the weight version whose forward
produced token t of request i. By default a version change waits for the requests in flight, so
the versions are constant per request. With ``inflight_updates=True`` (PipelineRL's in-flight
weight updates, ``rl.inflight_updates``) a request lets a waiting swap in between two decode steps
and goes on with the new weights: the KV cache of the tokens so far is kept, computed with the old
weights (as PipelineRL does), so a token after the swap is the new version's forward over the old
version's keys and values — its log-prob is the behaviour policy's, not any one version's full forward.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from megatron_fp4.config.choices import INVARIANCE_LEVELS
from megatron_fp4.fp4 import WeightStore, apply_numerics, numerics_of, rollout_numerics
from megatron_fp4.model import KVCache, Router
from megatron_fp4.model.capacity import refuse_for_rollout
from megatron_fp4.rollout.logprobs import log_softmax_rows, pick
from megatron_fp4.rollout.rwlock import LockTimeout, RWLock  # noqa: F401 - LockTimeout: the engine's error
from megatron_fp4.rollout.sampling import SamplingParams, sample_token, sampling_log_probs


@dataclass
class GenerationOutput:
    """One entry per request, in request order. Per generated token t:

    log_probs[i][t]: log p(token) under the raw model distribution (temperature 1, no filtering),
        what the trainer recomputes. sampled_log_probs[i][t]: under the distribution sampled from
        (after temperature/top-k/top-p; 0 for greedy).
    routing[i]: [L, num_moe_layers, k] expert ids of the forward position that produced token t
        (the position before it), i.e. the routing behind log_probs[i][t]. None unless requested.
    distributions[i]: [L, V] raw log-softmax rows (for exact KL), None unless requested.
    """

    prompt_ids: list
    response_ids: list
    log_probs: list
    sampled_log_probs: list
    finish_reasons: list
    version: int
    routing: Optional[list] = None
    distributions: Optional[list] = None
    token_versions: Optional[list] = None  # [L] int64 per request: the version behind each token (None: `version`)

    def versions_of(self, i: int) -> torch.Tensor:
        """The weight version behind each generated token of request `i` ([L] int64)."""
        if self.token_versions is not None:
            return self.token_versions[i]
        return torch.full((len(self.response_ids[i]),), int(self.version), dtype=torch.long)

    def version_range(self) -> tuple[int, int]:
        """(oldest, newest) version behind any generated token (``(version, version)`` without tokens)."""
        spans = [self.versions_of(i) for i in range(len(self.response_ids)) if len(self.response_ids[i])]
        if not spans:
            return int(self.version), int(self.version)
        flat = torch.cat(spans)
        return int(flat.min()), int(flat.max())


def check_token_ids(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
    """Every prompt token must be an integer id of the model's vocabulary (else the embedding
    lookup fails deep inside the forward)."""
    for i, prompt in enumerate(prompts):
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) and not (isinstance(t, torch.Tensor) and t.ndim == 0
                                                                       and not t.dtype.is_floating_point):
                raise ValueError(f"prompt {i}: token {t!r} is not an integer token id")
            if not 0 <= int(t) < vocab_size:
                raise ValueError(f"prompt {i}: token id {int(t)} is outside the model's vocabulary "
                                 f"[0, {vocab_size}) (model.vocab_size); encode prompts with the model's tokenizer")


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int):
    """-> (tokens [B, P], mask [B, P]) with each sequence right-aligned."""
    width = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            tokens[i, width - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
            mask[i, width - len(s):] = 1
    return tokens, mask


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions of real tokens counted from each row's first real token (padding gets 0)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def pad_prompt_response(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int):
    """verl's layout: prompts left-padded to P, responses right-padded to R, concatenated.
    Returns dict(input_ids [B, P+R], attention_mask, response_mask [B, P+R], prompt_len=P)."""
    p_tok, p_mask = left_pad(prompts, pad_id)
    width = max(max(len(r) for r in responses), 1)
    r_tok = torch.full((len(responses), width), pad_id, dtype=torch.long)
    r_mask = torch.zeros_like(r_tok)
    for i, r in enumerate(responses):
        r_tok[i, :len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        r_mask[i, :len(r)] = 1
    attention_mask = torch.cat([p_mask, r_mask], dim=1)
    response_mask = torch.cat([torch.zeros_like(p_mask), r_mask], dim=1)
    return {"input_ids": torch.cat([p_tok, r_tok], dim=1), "attention_mask": attention_mask,
            "response_mask": response_mask, "prompt_len": p_tok.shape[1]}


def check_built_numerics(model, mode: Optional[str] = None, invariance: Optional[str] = None) -> None:
    """Raise ValueError when a caller asks `model` for an FP4 `mode` or numerics level `invariance`
    (None: whatever it has) other than the ones it was built with: both are fixed at build."""
    if mode is not None and model.fp4_mode is not None and mode != model.fp4_mode:
        raise ValueError(f"the model computes in FP4 mode {model.fp4_mode!r} (fixed when it was built), not {mode!r}: "
                         "score with a model built in that mode (model.set_fp4_mode at build; a RolloutEngine's "
                         "model is in the engine's mode)")
    level = numerics_of(model).invariance
    if invariance is not None and invariance != level:
        raise ValueError(f"the model computes at numerics.invariance={level!r} (fixed when it was built), not "
                         f"{invariance!r}: build the model with that level (numerics_from_config, or "
                         "fp4.apply_numerics(model, Numerics(invariance=...)) on a copy)")


def cast_for_inference(model, dtype: torch.dtype):
    """Cast `model` in place to `dtype` (e.g. bf16, an inference engine's copy), keeping every MoE
    router weight in fp32. Returns the model."""
    model.to(dtype)
    for m in model.modules():
        if isinstance(m, Router):
            m.float()
    return model


class RolloutEngine:
    """Generation with a `MoETransformer` in the rollout-side FP4 mode.

    The engine owns `model` (give it its own copy when the trainer keeps training: weights reach
    it through `load_weights`, normally driven by `weight_sync.WeightReceiver`). With `dtype`
    given, the model is cast in place by `cast_for_inference` (see the module docstring).
    `lock_timeout_s` bounds every wait for the weights lock (`RWLock`): a swap blocked that long by
    a request fails with `LockTimeout` and the engine keeps its weights. `invariance` (default
    "batch", the config's `numerics.invariance`) is the numerics level it decodes at (`fp4/invariant.py`).
    Mode and level are fixed here, when the engine builds its model: the model gets the FP4 `mode`
    and a rollout `Numerics` of its own at `invariance` (design rule 6; nothing switches them per call).
    `cache_quantized_weights` (default True) derives each weight's quantization / exact-GEMM split
    (and, at the `batch` level, oneDNN's packed copy of each fp32 weight it computes with — the
    row-streaming kernel's instead where its plan has one, `fp4/row_stream.py` — or
    where the weight stays on `mm` its contiguous transposed copy: `Numerics.weight_packs`, one
    more copy of those weights' bytes, ~2.4× / 1.3-1.6× faster decode GEMMs)
    once per weight version instead of at every decode step (`Numerics.cached_weights` with a
    store kept across `generate` calls and emptied by `load_weights`; the same bits): a write into
    the model that bypasses the version counter (``p.data.copy_``, e.g. a ZeRO optimizer on a
    shared model) is not seen, which is one more reason to give the engine its own copy.
    Decoding allocates its KV cache (static, prompt + max_new_tokens positions) and attention mask
    once per call and keeps the per-row state as tensors (`_StepState`); at the `batch` level the
    cache also keeps its keys and values by key index for the decode steps to read in place
    (`fp4.tiled.BlockedKV`: one more copy of the KV cache, the same bits). `inflight_updates`: a
    request lets a waiting weight swap in between decode steps (module doc).
    """

    def __init__(self, model, mode: Optional[str] = None, pad_id: int = 0, seed: int = 0, name: str = "rollout0",
                 dtype: Optional[torch.dtype] = None, lock_timeout_s: Optional[float] = 600.0,
                 invariance: str = "batch", cache_quantized_weights: bool = True, inflight_updates: bool = False):
        refuse_for_rollout(getattr(getattr(model, "cfg", None), "moe_capacity_factor", None))
        if lock_timeout_s is not None and not (0 < lock_timeout_s < float("inf")):
            raise ValueError(f"lock_timeout_s={lock_timeout_s!r} must be a positive number of seconds (or None to "
                             "wait forever): how long a weight swap or a request may wait for the engine's lock")
        self.dtype = dtype
        if invariance not in INVARIANCE_LEVELS:
            raise ValueError(f"RolloutEngine: invariance={invariance!r} is not one of {INVARIANCE_LEVELS}")
        self.invariance = invariance
        self.cache_quantized_weights = bool(cache_quantized_weights)
        self.inflight_updates = bool(inflight_updates)
        if dtype is not None:
            cast_for_inference(model, dtype)
        self.model = model.eval()
        self.mode = mode if mode is not None else getattr(model.fp4_cfg, "rollout_mode", None)
        self._weight_cache: dict = WeightStore()  # weight-derived GEMM terms, kept across generate calls (per version)
        if self.mode is not None and model.fp4_mode is not None:
            model.set_fp4_mode(self.mode)
        apply_numerics(model, rollout_numerics(numerics_of(model), invariance))
        self.pad_id = int(pad_id)
        self.name = name
        self.version = 0
        self.lock = RWLock(lock_timeout_s, owner=f"rollout {name!r}", setting="RolloutEngine(lock_timeout_s=...)")
        self._seed_stream = torch.Generator().manual_seed(seed)
        self._seed_lock = threading.Lock()
        self._moe_layer_ids = [i for i, layer in enumerate(model.layers) if layer.is_moe]

    # -- weights --------------------------------------------------------------------------------
    def weight_meta(self) -> dict:
        """name -> (shape, dtype) of every tensor `load_weights` accepts."""
        return {n: (tuple(t.shape), t.dtype) for n, t in self.model.state_dict().items()}

    def check_weights(self, meta: dict) -> None:
        """Raise ValueError naming every name/shape/dtype mismatch of `meta` (name -> (shape, dtype))."""
        expected = self.weight_meta()
        problems = [f"unknown tensor {n!r}" for n in meta if n not in expected]
        problems += [f"missing tensor {n!r}" for n in expected if n not in meta]
        for n, (shape, dtype) in meta.items():
            if n in expected and (tuple(shape), dtype) != expected[n] and not (
                    tuple(shape) == expected[n][0] and self._rounds_on_copy(dtype, expected[n][1])):
                problems.append(f"{n!r}: got shape {tuple(shape)} dtype {dtype}, expected "
                                f"shape {expected[n][0]} dtype {expected[n][1]}")
        if problems:
            raise ValueError(f"rollout {self.name!r} rejects the weights: " + "; ".join(problems[:8])
                             + ("; ..." if len(problems) > 8 else "")
                             + " (publish the state_dict of the same model config the rollout was built with)")

    def _rounds_on_copy(self, got: torch.dtype, expected: torch.dtype) -> bool:
        """An engine built with `dtype` takes any floating tensor for a floating one (cast on copy)."""
        return self.dtype is not None and got.is_floating_point and expected.is_floating_point

    def load_weights(self, named_tensors: dict, version: int) -> None:
        """Validate everything, then swap all tensors in under the write lock (one whole version)."""
        self.check_weights({n: (tuple(t.shape), t.dtype) for n, t in named_tensors.items()})
        state = self.model.state_dict()
        with self.lock.write(), torch.no_grad():
            for n, t in named_tensors.items():
                state[n].copy_(t)
            self._weight_cache.clear()  # the copies bumped every version; drop the stale terms now
            self.version = int(version)

    # -- generation -----------------------------------------------------------------------------
    def _next_seed(self) -> int:
        with self._seed_lock:
            return int(torch.randint(0, 2**62, (1,), generator=self._seed_stream))

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: Union[SamplingParams, Sequence[SamplingParams]] = SamplingParams(),
                 return_routing: bool = False, return_distributions: bool = False) -> GenerationOutput:
        """Generate for every prompt (lists of token ids) with one or per-request `SamplingParams`."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate() needs at least one prompt and every prompt needs >= 1 token "
                             "(encode prompts with a bos token)")
        check_token_ids(prompts, self.model.cfg.vocab_size)
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts) or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one, or one per prompt")
        max_new = max(p.max_new_tokens for p in params)
        limit = self.model.cfg.max_seq_len
        if max(len(p) for p in prompts) + max_new > limit:
            raise ValueError(f"prompt length + max_new_tokens exceeds model.max_seq_len={limit}; "
                             "shorten the prompt or lower max_new_tokens")
        gens = [torch.Generator().manual_seed(p.seed if p.seed is not None else self._next_seed()) for p in params]
        numerics = numerics_of(self.model)  # built with the model (__init__); the cache changes no bits
        cache = numerics.cached_weights(self._weight_cache) if self.cache_quantized_weights else contextlib.nullcontext()
        with self.lock.read(), torch.no_grad(), cache:
            version = self.version
            out = self._decode(prompts, params, gens, max_new, return_routing, return_distributions, version)
        return GenerationOutput(version=version, prompt_ids=[list(p) for p in prompts], **out)

    def _decode(self, prompts, params, gens, max_new, return_routing, return_distributions, version: int) -> dict:
        """Prefill, then one batched decode step per new token over a static KV cache and a
        preallocated attention mask. Per step the bookkeeping is batched (`_StepState`); only rows
        that sample (temperature > 0) visit Python, each with its own generator. `version`: the
        weights' version at the start; with `inflight_updates` a swap may come in before a step."""
        B = len(prompts)
        tokens, prompt_mask = left_pad(prompts, self.pad_id)
        P = tokens.shape[1]
        positions = positions_from_mask(prompt_mask)
        cache = KVCache.empty(len(self.model.layers), capacity=P + max_new)
        mask = torch.zeros((B, P + max_new), dtype=torch.long)
        mask[:, :P] = prompt_mask
        state = _StepState(params, max_new, self.pad_id)
        routes, dists = [], []
        out = self.model(tokens, positions, prompt_mask, cache, return_routing=return_routing)
        next_pos = positions[:, -1:] + 1
        for step in range(max_new):
            logits = out.logits[:, -1].float()
            raw = log_softmax_rows(logits, numerics_of(self.model))
            toks = state.choose(logits, gens)
            state.record(step, toks, raw, version)
            if return_routing:
                routes.append(self._last_routing(out.routing))
            if return_distributions:
                dists.append(raw)
            if state.all_finished():
                break
            # Finished rows keep feeding a token (masked out) so the batch stays rectangular; their
            # outputs are never read and, being separate rows, cannot affect the others.
            mask[:, P + step] = state.active
            if self.inflight_updates and self.lock.let_writers_in():
                version = self.version  # the next tokens: the new weights over the cache kept so far
            out = self.model(state.feed[:, None], next_pos, mask[:, :P + step + 1], cache,
                             return_routing=return_routing)
            next_pos = next_pos + 1
        return state.result(routes if return_routing else None, dists if return_distributions else None)

    def _last_routing(self, routing: list) -> torch.Tensor:
        """Per-layer [B, T, k] routing -> [B, num_moe_layers, k] of the last position."""
        return torch.stack([routing[i][:, -1] for i in self._moe_layer_ids], dim=1)


class _StepState:
    """The per-row decoding state of one `generate` call as tensors: chosen tokens, their log-probs
    and which rows still run. Greedy rows take the argmax of the whole batch at once (exact: the
    first maximum of the row, what `sample_token` returns for the point mass); sampling rows go
    through `sampling_log_probs` / `sample_token` one by one, each with its own generator, so
    their draws depend only on the row."""

    def __init__(self, params, max_new: int, pad_id: int):
        B = len(params)
        self.params, self.pad_id = params, pad_id
        self.sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        self.limit = torch.tensor([p.max_new_tokens for p in params])
        width = max([len(p.stop_token_ids) for p in params] + [1])
        self.stops = torch.full((B, width), -1, dtype=torch.long)
        for i, p in enumerate(params):
            self.stops[i, :len(p.stop_token_ids)] = torch.tensor(p.stop_token_ids, dtype=torch.long)
        self.ids = torch.full((B, max_new), pad_id, dtype=torch.long)
        self.log_probs = torch.zeros((B, max_new), dtype=torch.float32)
        self.sampled_log_probs = torch.zeros((B, max_new), dtype=torch.float32)
        self.versions = torch.zeros((B, max_new), dtype=torch.long)
        self.lengths = torch.zeros(B, dtype=torch.long)
        self.active = torch.ones(B, dtype=torch.long)
        self.stopped = torch.zeros(B, dtype=torch.bool)
        self.feed = torch.full((B,), pad_id, dtype=torch.long)

    def choose(self, logits: torch.Tensor, gens) -> torch.Tensor:
        toks = logits.argmax(-1)
        if not self.sampled_rows:  # all greedy: their sampled log-probs stay 0 (no per-step work)
            return toks
        self._slp = torch.zeros(logits.shape[0], dtype=torch.float32)
        running = self.active.tolist()
        for i in self.sampled_rows:
            if running[i]:
                slp = sampling_log_probs(logits[i], self.params[i])
                tok = sample_token(slp, self.params[i], gens[i])
                toks[i], self._slp[i] = tok, slp[tok]
        return toks

    def record(self, step: int, toks: torch.Tensor, raw: torch.Tensor, version: int) -> None:
        run = self.active.bool()
        idle = ~run
        # Column `step` still holds its initial values (pad id, zeros): a row that no longer runs keeps them.
        self.versions[:, step] = version
        self.ids[:, step] = toks.masked_fill(idle, self.pad_id)
        self.log_probs[:, step] = pick(raw, toks).masked_fill_(idle, 0.0)
        if self.sampled_rows:  # (greedy rows: 0, as initialized)
            self.sampled_log_probs[:, step] = self._slp.masked_fill_(idle, 0.0)
        self.lengths += run
        stop = (toks[:, None] == self.stops).any(1) & run
        self.stopped |= stop
        self.feed = self.ids[:, step]  # the token fed next: the chosen one, the pad id for a row that stopped before
        self.active = (run & ~stop & (self.lengths < self.limit)).long()

    def all_finished(self) -> bool:
        return not bool(self.active.any())

    def result(self, routes: Optional[list], dists: Optional[list]) -> dict:
        lengths = self.lengths.tolist()
        res = {"response_ids": [self.ids[i, :n].tolist() for i, n in enumerate(lengths)],
               "log_probs": [self.log_probs[i, :n].clone() for i, n in enumerate(lengths)],
               "sampled_log_probs": [self.sampled_log_probs[i, :n].clone() for i, n in enumerate(lengths)],
               "finish_reasons": ["stop" if s else "length" for s in self.stopped.tolist()],
               "token_versions": [self.versions[i, :n].clone() for i, n in enumerate(lengths)]}
        if routes is not None:
            stacked = torch.stack(routes, dim=1)  # [B, steps, L_moe, k]
            res["routing"] = [stacked[i, :n] for i, n in enumerate(lengths)]
        if dists is not None:
            stacked = torch.stack(dists, dim=1)  # [B, steps, V]
            res["distributions"] = [stacked[i, :n] for i, n in enumerate(lengths)]
        return res
