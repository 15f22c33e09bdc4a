"""The rollout engine's batched decode loop (static KV cache, preallocated mask, batched greedy
choice and bookkeeping) against a plain reference loop: a growing (concatenated) KV cache, a
mask re-concatenated every step, and every row sampled on its own by `sampling_log_probs` /
`sample_token` — the engine as it was written before.

In the batch-invariant mode (the engine's default) the two must agree bit for bit by construction:
attention copies the cached keys (`repeat_interleave`) and reads them by position, so a static
buffer's views and a concatenated tensor give the same values, and every other op sees the same
inputs. Standard kernels (`invariance="standard"`) decode with SDPA mapping query heads to kv
heads itself (`enable_gqa`) instead of repeating the cache, a kernel choice that may round
differently. Those cases run a float64 model: the two paths' logits then differ by a reordering of
float64 sums (<= FP64_REL relative, tests/numerics.py), both cast them to fp32 (<= u relative each)
and take the same fp32 log-softmax, so the log-probs differ by at most
2·(FP64_REL + 2u)·max|logit| + 2·log_softmax_bound (`lp_tol`); the tokens drawn from them are the
same unless an fp32 cast lands on a near-tie (probability ~1e-8 per step: not seen, asserted).
"""
import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.model import KVCache, build_model
from megatron_fp4.rollout import RolloutEngine, SamplingParams
from megatron_fp4.rollout.engine import left_pad, positions_from_mask
from megatron_fp4.rollout.sampling import sample_token, sampling_log_probs
from tests.numerics import FP64_REL, log_softmax_bound, single_thread
PROMPTS = [[1, 5, 7, 9], [2, 3], [4, 4, 4, 8, 30], [9]]
PARAMS = [SamplingParams(temperature=0.0, max_new_tokens=9),
          SamplingParams(temperature=1.0, max_new_tokens=7, seed=3, stop_token_ids=tuple(range(0, 64, 4))),
          SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=9, seed=4),
          SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=tuple(range(1, 64, 5)))]


def reference_decode(model, prompts, params):
    """Row by row, growing cache; returns per-row (ids, log_probs, sampled_log_probs, reason, dists,
    max_abs: the largest |logit / temperature| the row's log-softmaxes saw)."""
    B, max_new = len(prompts), max(p.max_new_tokens for p in params)
    gens = [torch.Generator().manual_seed(p.seed if p.seed is not None else 0) for p in params]
    tokens, mask = left_pad(prompts, 0)
    positions = positions_from_mask(mask)
    cache = KVCache.empty(len(model.layers))
    rows = [dict(ids=[], lp=[], slp=[], reason=None, dists=[], max_abs=0.0) for _ in range(B)]
    out = model(tokens, positions, mask, cache)
    next_pos = positions[:, -1] + 1
    for _ in range(max_new):
        logits = out.logits[:, -1].float()
        from megatron_fp4.fp4 import invariant
        raw = invariant.log_softmax(logits, model.numerics)
        feed = torch.zeros((B, 1), dtype=torch.long)
        for i, r in enumerate(rows):
            if r["reason"] is not None:
                continue
            slp = sampling_log_probs(logits[i], params[i])
            tok = sample_token(slp, params[i], gens[i])
            feed[i, 0] = tok
            r["ids"].append(tok)
            r["lp"].append(float(raw[i, tok]))
            r["slp"].append(float(slp[tok]))
            r["dists"].append(raw[i])
            r["max_abs"] = max(r["max_abs"], float(logits[i].abs().max()) / (params[i].temperature or 1.0))
            if tok in params[i].stop_token_ids:
                r["reason"] = "stop"
            elif len(r["ids"]) >= params[i].max_new_tokens:
                r["reason"] = "length"
        if all(r["reason"] is not None for r in rows):
            break
        active = torch.tensor([[r["reason"] is None] for r in rows], dtype=torch.long)
        mask = torch.cat([mask, active], dim=1)
        out = model(feed, next_pos[:, None], mask, cache)
        next_pos = next_pos + 1
    return rows


@pytest.mark.parametrize("mode,scope,bi", [("bf16", "experts", True), ("fp4_resq", "experts", True),
                                           ("fp4_resq", "experts+attention", True), ("bf16", "experts", False),
                                           ("fp4", "experts+attention", False)])
def test_engine_decode_equals_reference_loop(mode, scope, bi):
    cfg = Config()
    cfg.model.vocab_size, cfg.model.num_layers, cfg.model.init_std, cfg.fp4.scope = 64, 2, 0.1, scope
    model = build_model(cfg, seed=1) if bi else build_model(cfg, seed=1).double()
    engine = RolloutEngine(model, mode=mode, invariance="exact" if bi else "standard")
    with single_thread():
        out = engine.generate(PROMPTS, PARAMS, return_distributions=True)
        with torch.no_grad():  # the engine built its model in `mode` at its level: the reference runs that model
            ref = reference_decode(model.eval(), PROMPTS, PARAMS)
    assert out.finish_reasons == [r["reason"] for r in ref]
    assert "stop" in out.finish_reasons and "length" in out.finish_reasons  # both endings exercised
    for i, r in enumerate(ref):
        got = [out.log_probs[i], out.sampled_log_probs[i], out.distributions[i]]
        want = [torch.tensor(r["lp"]), torch.tensor(r["slp"]), torch.stack(r["dists"])]
        assert out.response_ids[i] == r["ids"]
        for a, b in zip(got, want):
            if bi:
                assert torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))
            else:
                tol = lp_tol(r["max_abs"], cfg.model.vocab_size)
                assert (a.double() - b.double()).abs().max() <= tol, ((a.double() - b.double()).abs().max(), tol)


def lp_tol(max_abs: float, num: int) -> float:
    """The module doc's bound for the standard kernels, for logits (over temperature) up to `max_abs`."""
    u = torch.finfo(torch.float32).eps / 2
    return 2 * (FP64_REL + 2 * u) * max_abs + 2 * log_softmax_bound(max_abs, num)


def test_static_cache_rejects_overflow_with_a_clear_error():
    cache = KVCache.empty(1, capacity=3)
    k = torch.zeros(1, 2, 2, 4)
    cache.layers[0].append(k, k)
    assert cache.length == 2
    with pytest.raises(ValueError, match="capacity 3"):
        cache.layers[0].append(k, k)
