"""Versions per token and in-flight weight updates (`RolloutEngine(inflight_updates=True)`,
``rl.inflight_updates``): a swap that arrives while a request decodes waits for the request by
default (every token of version 0), and with in-flight updates enters between two decode steps,
the tokens after it carrying the new version. Reference for the tokens after the swap: the model
run by hand — one full forward of version 0 over the prompt and the tokens before the swap (the
KV cache the engine keeps), then version 1 decoding over that cache; the same bits (the engine
decodes batch-invariantly, so a full forward and a KV-cache decode agree exactly)."""
import threading
import time

import pytest
import torch

from megatron_fp4.config import ConfigError, Config, default_config_path, load_config
from megatron_fp4.fp4 import apply_numerics, numerics_of, rollout_numerics
from megatron_fp4.model import KVCache, build_model
from megatron_fp4.rollout.engine import RolloutEngine
from megatron_fp4.rollout.logprobs import log_softmax_rows
from megatron_fp4.rollout.sampling import SamplingParams

PROMPT, NEW, SWAP_AFTER = [1, 5, 7, 2], 6, 3  # the swap comes in during the 3rd forward: tokens 3.. are version 1


def tiny_model():
    cfg = Config()
    cfg.model.num_layers, cfg.model.vocab_size = 2, 32
    torch.manual_seed(0)
    return build_model(cfg)


def version_one(model) -> dict:
    g = torch.Generator().manual_seed(1)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype) if t.is_floating_point() else t
            for n, t in model.state_dict().items()}


def generate_with_a_swap(inflight: bool):
    """Greedy generation of NEW tokens; during the SWAP_AFTER-th forward a thread starts loading
    version 1 and the forward returns once the swap waits for the lock. -> (output, engine)."""
    model = tiny_model()
    new = version_one(model)
    engine = RolloutEngine(model, pad_id=0, inflight_updates=inflight)
    calls, loader = [0], []

    def hook(*_):
        calls[0] += 1
        if calls[0] == SWAP_AFTER:
            loader.append(threading.Thread(target=engine.load_weights, args=(new, 1)))
            loader[0].start()
            while not engine.lock._writers_waiting:  # the swap is queued behind this request
                time.sleep(0.001)
    handle = model.register_forward_hook(hook)
    out = engine.generate([PROMPT], SamplingParams(max_new_tokens=NEW, temperature=0))
    handle.remove()
    loader[0].join(timeout=60)
    assert engine.version == 1
    return out, engine, new


def test_without_inflight_updates_the_swap_waits_for_the_request():
    out, _, _ = generate_with_a_swap(inflight=False)
    plain = RolloutEngine(tiny_model(), pad_id=0).generate([PROMPT], SamplingParams(max_new_tokens=NEW, temperature=0))
    assert out.version == 0 and out.token_versions[0].tolist() == [0] * NEW
    assert out.response_ids == plain.response_ids and torch.equal(out.log_probs[0], plain.log_probs[0])


def test_inflight_update_enters_between_decode_steps_and_keeps_the_cache():
    out, engine, new = generate_with_a_swap(inflight=True)
    assert out.version == 0 and out.version_range() == (0, 1)
    assert out.token_versions[0].tolist() == [0] * SWAP_AFTER + [1] * (NEW - SWAP_AFTER)
    # Reference, by hand: version 0's full forward over the prompt and the tokens fed before the swap.
    ref = tiny_model()  # built as the engine builds its copy: its FP4 mode and rollout numerics, once
    apply_numerics(ref, rollout_numerics(numerics_of(ref), engine.invariance))
    if engine.mode is not None:
        ref.set_fp4_mode(engine.mode)
    ids = out.response_ids[0]
    numerics = numerics_of(ref)
    lps = []
    with torch.no_grad():
        cache = KVCache.empty(len(ref.layers), capacity=len(PROMPT) + NEW)
        seq = PROMPT + ids[:SWAP_AFTER - 1]
        logits = ref(torch.tensor([seq]), torch.arange(len(seq))[None], torch.ones(1, len(seq), dtype=torch.long),
                     cache).logits[0]
        for t in range(SWAP_AFTER):  # tokens 0..SWAP_AFTER-1 from the full forward's rows
            row = logits[len(PROMPT) - 1 + t].float()
            assert int(row.argmax()) == ids[t]
            lps.append(log_softmax_rows(row[None], numerics)[0, ids[t]])
        ref.load_state_dict(new)
        for t in range(SWAP_AFTER, NEW):  # version 1 over the cache of version 0's keys and values
            pos = len(PROMPT) + t - 1
            row = ref(torch.tensor([[ids[t - 1]]]), torch.tensor([[pos]]), torch.ones(1, pos + 1, dtype=torch.long),
                      cache).logits[0, -1].float()
            assert int(row.argmax()) == ids[t]
            lps.append(log_softmax_rows(row[None], numerics)[0, ids[t]])
    assert torch.equal(torch.stack(lps), out.log_probs[0])  # exact: batch-invariant decoding
    # And not what version 1 alone would have generated from the start (the cache matters).
    alone = RolloutEngine(tiny_model(), pad_id=0)
    alone.load_weights(new, 1)
    assert alone.generate([PROMPT], SamplingParams(max_new_tokens=NEW, temperature=0)).log_probs[0][SWAP_AFTER:] \
        .ne(out.log_probs[0][SWAP_AFTER:]).any()


def test_config_refuses_inflight_updates_where_they_change_nothing():
    path = str(default_config_path())
    for overrides in (["rl.inflight_updates=true"], ["rl.inflight_updates=true", "rl.max_staleness=1"]):
        with pytest.raises(ConfigError, match="rl.inflight_updates=true needs"):
            load_config(path, overrides)
    cfg = load_config(path, ["rl.inflight_updates=true", "rl.max_staleness=1", "rl.staleness_policy=drop"])
    assert cfg.rl.inflight_updates
