"""Rollout engine: KV-cache decoding == full forward, batch invariance, seeded sampling, stops.

The engine and `score` run the batch-invariant numerics by default (``fp4/invariant.py``): exact
FP4 GEMM sums, per-row reduction orders fixed by construction, attention read by position. A
token's log-prob, its distribution and its experts are then the same bits whether it is decoded
with a KV cache in a batch, decoded alone, or re-scored in a full forward, in every FP4 mode:
those tests compare bitwise (no tolerance, no fraction of tokens allowed to differ).

Standard kernels (a direct model call outside the mode) order reductions by shape: BLAS blocks
another number of rows, SDPA runs over a cache instead of a causal mask. That test runs a float64
model (the ``dtype: fp64`` verification mode): every difference is a reordering of float64 sums,
≲ 1e-12 relative after a few dozen ops (tests/numerics.py), so ``FP64_REL`` = 1e-10 bounds it
with margin; FP4 operands are still quantized from fp32, and an fp64 difference that small changes
an FP4 code with probability ~1e-15 per element (numerics.py). A real bug (wrong positions, a
padding leak, a stale cache) moves the logits by >= 1e-3 relative.
"""
import time

import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.model import build_model
from megatron_fp4.rollout import RolloutEngine, SamplingParams, compute_log_probs, pad_prompt_response, score
from megatron_fp4.rollout.logprobs import log_probs_from_logits
from megatron_fp4.rollout.sampling import sampling_log_probs
from megatron_fp4.training.data import ArithmeticTokenizer
from tests.numerics import FP64_REL, log_softmax_bound, rel

TOK = ArithmeticTokenizer()
PROMPTS = ["12+7=", "3*4=", "100-99=", "7="]


def assert_same_bits(a, b):
    """Bitwise equality of two fp32 tensors (the batch-invariant claim; module doc)."""
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    same = a.contiguous().view(torch.int32) == b.contiguous().view(torch.int32)
    assert same.all(), f"{int((~same).sum())} of {same.numel()} values differ, max |diff| {(a - b).abs().max():.3e}"


def make(scope="experts", init_std=0.02):
    cfg = Config()
    cfg.model.vocab_size = TOK.vocab_size
    cfg.model.init_std = init_std
    cfg.fp4.scope = scope
    return build_model(cfg, seed=7)


def enc(texts):
    return [TOK.encode(t, add_eos=False) for t in texts]


@pytest.mark.parametrize("mode,scope", [("bf16", "experts"), ("fp4", "experts"), ("fp4_resq", "experts"),
                                        ("fp4_resq", "experts+attention")])
def test_incremental_decoding_matches_full_forward(mode, scope):
    model = make(scope)
    engine = RolloutEngine(model, mode=mode)
    out = engine.generate(enc(PROMPTS), SamplingParams(max_new_tokens=10, temperature=1.0, seed=1),
                          return_routing=True, return_distributions=True)
    full = score(model, out.prompt_ids, out.response_ids, mode=mode, return_routing=True, return_distributions=True)
    cat = lambda xs: torch.cat(list(xs))  # noqa: E731
    assert_same_bits(cat(out.log_probs), cat(full["log_probs"]))
    assert_same_bits(cat(out.distributions), cat(full["distributions"]))
    assert torch.equal(cat(out.routing).sort(-1).values, cat(full["routing"]).sort(-1).values)


def test_logits_of_cached_step_match_full_forward():
    """The raw logits (not only log-probs) of a cached decode step equal the full forward's, with
    the standard kernels: float64 model, within FP64_REL per step (module doc)."""
    from megatron_fp4.model import KVCache
    model = make(scope="experts+attention").double().eval()
    model.set_fp4_mode("fp4_resq")
    seq = torch.tensor([enc(["12+34=56"])[0]])
    with torch.no_grad():
        full = model(seq).logits
        cache = KVCache.empty(len(model.layers))
        model(seq[:, :4], kv_cache=cache)
        steps = [model(seq[:, t:t + 1], kv_cache=cache).logits for t in range(4, seq.shape[1])]
    assert full.dtype == torch.float64
    for t, step in enumerate(steps):
        assert rel(step[:, 0], full[:, 4 + t]) <= FP64_REL, (t, rel(step[:, 0], full[:, 4 + t]))


@pytest.mark.parametrize("mode,scope", [("bf16", "experts"), ("fp4_resq", "experts"), ("fp4", "experts+attention")])
def test_batch_composition_and_padding_do_not_change_results(mode, scope):
    engine = RolloutEngine(make(scope), mode=mode)
    params = [SamplingParams(max_new_tokens=8, temperature=1.0, top_k=8, seed=100 + i) for i in range(len(PROMPTS))]
    batch = engine.generate(enc(PROMPTS), params, return_routing=True)
    for i, p in enumerate(PROMPTS):
        alone = engine.generate(enc([p]), [params[i]], return_routing=True)
        assert alone.response_ids[0] == batch.response_ids[i]
        assert_same_bits(alone.log_probs[0], batch.log_probs[i])
        assert_same_bits(alone.sampled_log_probs[0], batch.sampled_log_probs[i])
        assert torch.equal(alone.routing[0], batch.routing[i])


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    engine = RolloutEngine(make(init_std=0.02), mode="fp4_resq")
    p = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5)
    a, b = engine.generate(enc(PROMPTS), p), engine.generate(enc(PROMPTS), p)
    assert a.response_ids == b.response_ids
    c = engine.generate(enc(PROMPTS), SamplingParams(max_new_tokens=12, temperature=1.0, seed=6))
    assert a.response_ids != c.response_ids  # near-uniform model: 4x12 draws cannot all coincide


def test_stop_tokens_and_max_new_tokens():
    engine = RolloutEngine(make(init_std=0.02), mode="bf16")
    free = engine.generate(enc(PROMPTS), SamplingParams(max_new_tokens=6, temperature=0))
    assert all(len(r) == 6 and f == "length" for r, f in zip(free.response_ids, free.finish_reasons))
    stop = free.response_ids[0][2]  # greedy: the same tokens again, so this one must stop row 0 at index <= 2
    out = engine.generate(enc(PROMPTS), SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=(stop,)))
    first = free.response_ids[0].index(stop)
    assert out.response_ids[0] == free.response_ids[0][:first + 1] and out.finish_reasons[0] == "stop"
    for r_free, r, f in zip(free.response_ids, out.response_ids, out.finish_reasons):
        assert r == (r_free[:r_free.index(stop) + 1] if stop in r_free else r_free)
        assert f == ("stop" if stop in r_free else "length")


def test_greedy_and_sampling_log_probs():
    engine = RolloutEngine(make(), mode="bf16")
    g = engine.generate(enc(PROMPTS), SamplingParams(max_new_tokens=5, temperature=0), return_distributions=True)
    for i in range(len(PROMPTS)):
        assert torch.all(g.sampled_log_probs[i] == 0)
        assert torch.equal(torch.tensor(g.response_ids[i]), g.distributions[i].argmax(-1))
    # top-k / top-p / temperature processor against a hand-computed float64 reference
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    lp = sampling_log_probs(logits, SamplingParams(temperature=0.5, top_k=3, top_p=0.9))
    scaled = logits.double() / 0.5
    keep = torch.tensor([True, True, False, False, False])  # top3 = {0,1,2}; p(0)=.865 < .9, p(0)+p(1) >= .9
    ref = torch.where(keep, scaled, torch.tensor(float("-inf"), dtype=torch.float64)).log_softmax(-1)
    # fp32: logits / T rounds each kept entry by <= u·|x| (moves the output by <= 2u·max|x|), then
    # one log-softmax over the 2 kept entries (tests/numerics.py); removed entries are -inf exactly
    u, m = torch.finfo(torch.float32).eps / 2, float(scaled[keep].abs().max())
    tol = 2 * u * m + log_softmax_bound(m, int(keep.sum()))
    assert torch.equal(lp[~keep], ref[~keep].float())
    assert (lp[keep].double() - ref[keep]).abs().max() <= tol, (lp, ref, tol)


def test_temperature_log_probs_against_float64():
    """verl's temperature: log p_T(token) = log_softmax(z / T) at the token, from the model's fp32
    log-softmax rows (log_softmax(log_softmax(z) / T)), against the float64 formula on z itself."""
    g = torch.Generator().manual_seed(0)
    logits, tokens = torch.randn(2, 7, 11, generator=g) * 4, torch.randint(0, 11, (2, 7), generator=g)
    keep = torch.ones(2, 7, dtype=torch.long)
    keep[0, 5:] = 0
    T, u = 0.7, torch.finfo(torch.float32).eps / 2
    lp, rows = log_probs_from_logits(logits, tokens, keep, temperature=T)
    exact = torch.log_softmax(logits.double()[:, :-1] / T, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    ref = torch.cat([exact.new_zeros(2, 1), exact], dim=1) * keep
    # first log-softmax (fp32, on z), / T rounding, second log-softmax (2-Lipschitz in its input, tests/numerics.py)
    m, m2 = float(logits.abs().max()), float(rows.abs().max())
    tol = 2 * (log_softmax_bound(m, 11) / T + u * m2) + log_softmax_bound(m2, 11)
    assert torch.equal(lp[keep == 0], torch.zeros(int((keep == 0).sum())))
    assert (lp.double() - ref).abs().max() <= tol, ((lp.double() - ref).abs().max(), tol)
    assert (log_probs_from_logits(logits, tokens, keep)[0].double() - ref).abs().max() > 100 * tol  # T matters
    assert torch.equal(log_probs_from_logits(logits, tokens, keep, temperature=1.0)[0],
                       log_probs_from_logits(logits, tokens, keep)[0])


def test_compute_log_probs_respects_masks():
    model = make().eval()  # eval: no router auxiliary losses, only the log-probs' own gradient
    batch = pad_prompt_response(enc(["1+1=", "22*3="]), [[5, 6], [7]], TOK.pad_id)
    out = compute_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"])
    assert torch.all(out.log_probs[batch["response_mask"] == 0] == 0)
    assert torch.all(out.log_probs[batch["response_mask"] == 1] < 0)
    out.log_probs.sum().backward()  # differentiable for the trainer
    # The gradient reaches exactly the embeddings of the tokens a kept prediction reads: the real
    # inputs before the last response token of their row; never the padding's, nor a row's last token.
    read = set()
    for ids, am, rm in zip(batch["input_ids"], batch["attention_mask"], batch["response_mask"]):
        last = int(rm.nonzero().max())
        read |= {int(t) for t, a in zip(ids[:last], am[:last]) if a}
    touched = (model.embed_tokens.weight.grad != 0).any(-1).nonzero().flatten().tolist()
    assert TOK.pad_id not in read and touched == sorted(read), (touched, sorted(read))


def test_bad_requests_raise_clear_errors():
    engine = RolloutEngine(make(), mode="bf16")
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.generate(enc(PROMPTS), SamplingParams(max_new_tokens=1000))
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate(enc(PROMPTS), [SamplingParams()] * 2)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def _in_thread(fn):
    """Run fn in a daemon thread; -> (thread, box) where box gets ("ok", result) or ("err", exception)."""
    import threading
    box = []

    def run():
        try:
            box.append(("ok", fn()))
        except Exception as err:  # noqa: BLE001 - inspected by the test
            box.append(("err", err))
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


def _hold_read_forever(lock):
    """A reader that never releases (until the returned event is set)."""
    import threading
    held, release = threading.Event(), threading.Event()

    def reader():
        with lock.read():
            held.set()
            release.wait()
    threading.Thread(target=reader, daemon=True).start()
    assert held.wait(30)
    return release


def test_rwlock_a_reader_that_never_releases_fails_the_writer_and_blocks_nobody():
    from megatron_fp4.rollout.engine import LockTimeout, RWLock
    lock = RWLock(timeout_s=0.5, owner="rollout 'r0'", setting="RolloutEngine(lock_timeout_s=...)")
    release = _hold_read_forever(lock)
    holders = []  # entered context managers stay referenced (a collected one would release)
    writer, wbox = _in_thread(lambda: holders.append(lock.write()) or holders[-1].__enter__())
    while not lock._writers_waiting and writer.is_alive():  # a writer is now queued: new readers wait
        time.sleep(0.001)
    reader, rbox = _in_thread(lambda: holders.append(lock.read()) or holders[-1].__enter__())
    writer.join(30)
    reader.join(30)  # served once the writer gave up (before: blocked forever behind it)
    assert wbox and wbox[0][0] == "err" and isinstance(wbox[0][1], LockTimeout), wbox
    msg = str(wbox[0][1])
    assert "rollout 'r0'" in msg and "generate() request(s) held the read lock" in msg
    assert "RolloutEngine(lock_timeout_s=...)" in msg and "keeps its current weights" in msg
    assert rbox and rbox[0][0] == "ok", rbox
    release.set()


def test_rwlock_a_reader_waiting_behind_a_stuck_writer_times_out():
    from megatron_fp4.rollout.engine import LockTimeout, RWLock
    lock = RWLock(timeout_s=0.3, owner="rollout 'r0'", setting="RolloutEngine(lock_timeout_s=...)")
    swap = lock.write()  # a swap that never finishes (kept referenced: no GC release)
    swap.__enter__()
    reader, box = _in_thread(lambda: lock.read().__enter__())
    reader.join(30)
    swap.__exit__(None, None, None)
    assert box and box[0][0] == "err" and isinstance(box[0][1], LockTimeout), box
    assert "read lock" in str(box[0][1]) and "lock_timeout_s" in str(box[0][1])


def test_engine_lock_timeout_is_validated_and_bounds_load_weights():
    from megatron_fp4.rollout.engine import LockTimeout
    for bad in (0, -1, float("inf")):
        with pytest.raises(ValueError, match="lock_timeout_s"):
            RolloutEngine(make(), lock_timeout_s=bad)
    engine = RolloutEngine(make(), mode="bf16", name="r-stuck", lock_timeout_s=0.3)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    release = _hold_read_forever(engine.lock)
    new = {k: v + 1 for k, v in before.items()}
    with pytest.raises(LockTimeout, match="'r-stuck'.*1 generate"):
        engine.load_weights(new, 1)
    assert engine.version == 0 and all(torch.equal(engine.model.state_dict()[k], v) for k, v in before.items())
    out = engine.generate(enc(["7="]), SamplingParams(max_new_tokens=1, temperature=0))  # still serving
    assert out.version == 0
    release.set()
    engine.load_weights(new, 1)
    assert engine.version == 1
