"""The vLLM rollout generates a whole batch per `llm.generate` call (`rl.rollouts.vllm_server.VLLMEngine`)
and, for R3, splits each batched forward's router picks by request (`integrations.vllm.worker`:
`start_routes` records vLLM's per-step request layout, `split_routes` cuts by it).

- `split_routes` on hand-made recordings (no vLLM): a prefill in chunks, requests joining and finishing
  at different steps, padding rows, a recomputed request; bad layouts are refused.
- in vLLM (runs where vllm imports: the vLLM venv, tools/vllm_env.sh): a batch of prompts of several
  lengths, greedy and seeded temperature-1 requests of different lengths, with a token budget per
  step that chunks the long prompts. Batched and one-request-per-call generation give the same
  tokens, log-probs (float.hex) and routes; the routes are the trainer's own for the same tokens,
  and so are the log-probs (the plugin's `batch` numerics level: 0 bits apart).
"""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.integrations.vllm import vllm_available
from megatron_fp4.integrations.vllm.worker import split_routes

VLLM = vllm_available()
needs_vllm = pytest.mark.skipif(not VLLM, reason=f"{VLLM.reason}; run in the vLLM environment: tools/vllm_env.sh")
LAYERS = ("model.layers.1.mlp.experts", "model.layers.10.mlp.experts", "model.layers.2.mlp.experts")


def _picks(request: int, position: int, layer: int) -> list:
    """A recognisable top-2 for (request, position, layer)."""
    return [request * 1000 + position * 10 + layer, layer]


def _record(steps, pad: int = 0, chunked_calls: bool = False) -> dict:
    """A `take_routes` recording of `steps`, each a list of (slot, first position, rows) in row order:
    per forward its layout and per layer its picks (`pad` rows of junk after the scheduled ones, or
    two MoE calls per forward with `chunked_calls`)."""
    forwards, layers = [], {name: [] for name in LAYERS}
    for step in steps:
        qsl, positions = [0], []
        for _, p0, n in step:
            qsl.append(qsl[-1] + n)
            positions += list(range(p0, p0 + n))
        forwards.append({"slots": [s for s, _, _ in step], "query_start_loc": qsl,
                         "positions": torch.tensor(positions, dtype=torch.long),
                         "marks": {name: len(calls) for name, calls in layers.items()}})
        for name in LAYERS:
            li = sorted(LAYERS, key=lambda n: int(n.split(".")[2])).index(name)
            rows = [_picks(s, p, li) for s, p0, n in step for p in range(p0, p0 + n)] + [[-7, -7]] * pad
            t = torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)
            layers[name] += [t[:1], t[1:]] if chunked_calls and len(t) > 1 else [t]
    return {"forwards": forwards, "layers": layers}


def _expected(slot: int, P: int, N: int) -> torch.Tensor:
    return torch.tensor([[_picks(slot, p, li) for li in range(len(LAYERS))] for p in range(P - 1, P + N - 1)])


# request 0: prompt 5, 3 tokens (positions 0..6); request 1: prompt 9 in chunks of 4+5, 1 token;
# request 2: prompt 2, joins at step 1, 4 tokens, preempted after step 2 and recomputed (0..3) at step 3
STEPS = [[(0, 0, 5), (1, 0, 4)],
         [(0, 5, 1), (1, 4, 5), (2, 0, 2)],
         [(0, 6, 1), (2, 2, 1)],
         [(2, 0, 4)],
         [(2, 4, 1)]]
LENGTHS = [(5, 3), (9, 1), (2, 4)]


@pytest.mark.parametrize("pad,chunked_calls", [(0, False), (3, False), (0, True)])
def test_split_routes_cuts_each_forward_by_request(pad, chunked_calls):
    got = split_routes(_record(STEPS, pad, chunked_calls), LENGTHS, max_len=64)
    assert len(got) == 3
    for slot, (P, N) in enumerate(LENGTHS):
        assert got[slot].dtype == torch.long and torch.equal(got[slot], _expected(slot, P, N)), slot


def test_split_routes_refuses_layouts_that_do_not_add_up():
    with pytest.raises(ValueError, match="request 1 has no route at positions \\[4, 5, 6, 7, 8\\]"):
        split_routes(_record([STEPS[0], [(0, 5, 1), (2, 0, 2)], *STEPS[2:]]), LENGTHS, 64)  # a chunk never ran
    with pytest.raises(ValueError, match="slot 3, not one of this batch's 3"):
        split_routes(_record([[(3, 0, 4)], *STEPS]), LENGTHS, 64)
    with pytest.raises(ValueError, match="not consecutive below 8"):
        split_routes(_record(STEPS), [(5, 3), (2, 1), (2, 2)], 8)
    with pytest.raises(ValueError, match="prompt \\+ response - 1 <= 8"):
        split_routes(_record(STEPS), [(5, 3), (9, 1), (2, 4)], 8)
    bad = _record(STEPS)
    bad["forwards"][1]["positions"][1] += 1  # request 1's chunk not consecutive
    with pytest.raises(ValueError, match="forward 1, request 1: positions"):
        split_routes(bad, LENGTHS, 64)
    short = _record(STEPS)
    short["layers"][LAYERS[0]][2] = short["layers"][LAYERS[0]][2][:1]
    with pytest.raises(ValueError, match="holds \\(1, 2\\) picks in forward 2, which scheduled 2 tokens"):
        split_routes(short, LENGTHS, 64)
    lost = _record(STEPS)
    del lost["layers"][LAYERS[1]][-1]
    with pytest.raises(ValueError, match="recorded no picks for forward 4"):
        split_routes(lost, LENGTHS, 64)
    odd = _record(STEPS)
    odd["forwards"][0]["query_start_loc"] = [0, 6, 4]
    with pytest.raises(ValueError, match="forward 0's layout is inconsistent"):
        split_routes(odd, LENGTHS, 64)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A `VLLMEngine` over a tiny MoE (the plugin at the `batch` level) as the rollout server builds it
    (whole prefills), 8 requests and 64 tokens a step: the batch's prompts prefill over several
    steps, beside the decodes of those that started earlier."""
    from megatron_fp4.integrations.vllm import export_for_vllm
    from megatron_fp4.integrations.vllm.worker import build_llm
    from megatron_fp4.model import build_model
    from megatron_fp4.rl.rollouts.vllm_server import VLLMEngine
    from tests.integration.test_vllm_plugin import tiny_cfg

    cfg = tiny_cfg("experts+attention")
    hf = export_for_vllm(build_model(cfg, seed=0), cfg, tmp_path_factory.mktemp("batched") / "hf", dtype=None)
    with pytest.MonkeyPatch.context() as mp:  # the engine core in this process (the server's setting)
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        llm, _ = build_llm(str(hf), {"dtype": "float32", "max_num_seqs": 8, "max_model_len": 64,
                                     "max_num_batched_tokens": 64})
    yield VLLMEngine(llm, "batched", pad_id=0), cfg, hf
    del llm


def _requests():
    from megatron_fp4.rollout.engine import SamplingParams

    g = torch.Generator().manual_seed(0)
    lengths = [3, 40, 11, 1, 29, 7, 33]
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in lengths]
    params = [SamplingParams(max_new_tokens=m, temperature=t, seed=s)
              for m, t, s in ((6, 0.0, None), (9, 1.0, 11), (3, 1.0, 12), (12, 0.0, None), (1, 0.0, None),
                              (7, 1.0, 13), (5, 1.0, 14))]
    return prompts, params


def _hex(t) -> list:
    return [float(x).hex() for x in t.tolist()]


@needs_vllm
@pytest.mark.slow
def test_batched_generation_equals_one_request_per_call_and_the_trainer(engine, monkeypatch):
    from megatron_fp4.integrations.vllm import worker

    eng, cfg, hf = engine
    prompts, params = _requests()
    taken, take = [], worker.take_routes
    monkeypatch.setattr(worker, "take_routes", lambda w: taken.append(take(w)) or taken[-1])
    batched = eng.generate(prompts, params, return_routing=True)
    # the batch ran together: forwards of several requests, prefills beside decodes, rows in an order
    # other than the batch's (vLLM's input batch moves a request into a finished one's row)
    layouts = [(fw["slots"], fw["query_start_loc"]) for fw in taken[0]["forwards"]]
    assert max(len(slots) for slots, _ in layouts) >= 5 and any(s != sorted(s) for s, _ in layouts), layouts
    assert any(len(slots) > 1 and max(b - a for a, b in zip(q, q[1:])) > 1 and min(b - a for a, b in zip(q, q[1:]))
               == 1 for slots, q in layouts), layouts
    plain = eng.generate(prompts, params)  # no routes asked: just the batch
    single = [eng.generate([q], [p], return_routing=True) for q, p in zip(prompts, params)]
    assert plain.routing is None
    assert [len(r) for r in batched.response_ids] == [p.max_new_tokens for p in params]  # no stop tokens
    for i, one in enumerate(single):
        for gen in (batched, plain):
            assert gen.response_ids[i] == one.response_ids[0], i
            assert _hex(gen.log_probs[i]) == _hex(one.log_probs[0]), i
            assert gen.finish_reasons[i] == one.finish_reasons[0]
        assert torch.equal(batched.routing[i], one.routing[0]), i
        assert batched.routing[i].shape == (len(batched.response_ids[i]), 3, cfg.model.top_k)
    assert_trainer_scores(hf, cfg, prompts, batched)  # the trainer's own routes and log-probs, same tokens


def assert_trainer_scores(hf, cfg, prompts, gen) -> None:
    """The trainer's model loaded from the checkpoint ``hf`` at the config's rollout mode and level
    scores ``gen``'s tokens with ``gen``'s routes and log-prob bits, request by request."""
    from megatron_fp4.fp4 import Numerics, apply_numerics
    from megatron_fp4.integrations.hf import build_model_from_hf
    from megatron_fp4.rollout.scoring import score

    model = build_model_from_hf(hf, cfg.fp4).eval()
    model.set_fp4_mode(cfg.fp4.rollout_mode)
    apply_numerics(model, Numerics(invariance=cfg.numerics.invariance))
    scored = score(model, prompts, gen.response_ids, return_routing=True)
    for i in range(len(prompts)):
        assert torch.equal(gen.routing[i].sort(-1).values, scored["routing"][i].long().sort(-1).values), i
        assert _hex(gen.log_probs[i]) == _hex(scored["log_probs"][i].float()), i


@needs_vllm
@pytest.mark.slow
def test_gate_routes_are_refused_where_the_plugin_records_routes(engine):
    """`gate_top_k` (stock vLLM's gates' top-k, benchmarks/bench_vllm_bf16.py) on an engine the plugin
    serves would record every MoE layer twice: refused, naming the fix, and the engine still serves."""
    from vllm import SamplingParams

    from megatron_fp4.integrations.vllm.worker import generate_batch

    eng, cfg, _ = engine
    params = [SamplingParams(max_tokens=2, temperature=0.0, detokenize=False, logprobs=0)]
    with pytest.raises(ValueError, match="gate_top_k is for stock vLLM.*leave gate_top_k 0"):
        generate_batch(eng.llm, [[5, 6, 7]], params, True, gate_top_k=cfg.model.top_k)
    _, routes = generate_batch(eng.llm, [[5, 6, 7]], params, True)
    assert routes[0].shape == (2, 3, cfg.model.top_k)


def _wide_cfg(scope: str, layers: int = 2):
    """The plugin's test model at hidden 512 (8 heads of 64, 4 experts of 512): every projection and
    expert weight at least ``row_calls.ONEDNN_MIN_ELEMENTS``; FP4 off for scope ``none``."""
    import copy

    from tests.integration.test_vllm_plugin import tiny_cfg

    cfg = copy.deepcopy(tiny_cfg(scope))
    m = cfg.model
    m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.dense_layers = 512, layers, 8, 8, []
    m.num_experts, m.moe_ffn_hidden_size, m.init_std = 4, 512, 0.03
    if scope == "none":
        cfg.fp4.train_mode = cfg.fp4.rollout_mode = "bf16"
    return cfg


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("scope", ["none", "experts+attention"])
def test_plugin_at_onednn_widths_equals_the_trainer_bitwise(tmp_path, scope):
    """Hidden 512 (the projections and expert weights ≥ ``row_calls.ONEDNN_MIN_ELEMENTS``): where this
    machine's oneDNN passed the probe, the plugin's `batch` GEMMs read oneDNN's packed copies (of the
    weights, FP4 off; of the cached ``Q(W)``, MoEResQ), kept in its weight store, and the trainer's
    scoring the dense weights: the same log-prob bits and routes for a batch of 4 requests."""
    from megatron_fp4.fp4 import row_calls
    from megatron_fp4.integrations.vllm import export_for_vllm
    from megatron_fp4.integrations.vllm.worker import _configs as worker_configs
    from megatron_fp4.integrations.vllm.worker import build_llm
    from megatron_fp4.model import build_model
    from megatron_fp4.rl.rollouts.vllm_server import VLLMEngine
    from megatron_fp4.rollout.engine import SamplingParams

    cfg = _wide_cfg(scope)
    hf = export_for_vllm(build_model(cfg, seed=0), cfg, tmp_path / "hf", dtype=None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        llm, _ = build_llm(str(hf), {"dtype": "float32", "max_num_seqs": 4, "max_model_len": 48})
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (5, 17, 2, 9)]
    params = [SamplingParams(max_new_tokens=6, temperature=t, seed=s) for t, s in ((0.0, None), (1.0, 3), (1.0, 4),
                                                                                     (0.0, None))]
    gen = VLLMEngine(llm, "wide", pad_id=0).generate(prompts, params, return_routing=True)
    # oneDNN's packed copies, or the row-streaming kernel's where the plans keep it (`RowPlan.stream`)
    packed = llm.apply_model(lambda model: sum(key[-1] in ("oneDNN pack", "row-stream pack")
                                               for c in worker_configs(model).values() for key in c.qw_store))[0]
    assert (packed > 0) == row_calls._onednn_usable(), packed
    del llm
    if row_calls._onednn_usable():
        assert row_calls.row_plan(512, 1024, torch.float32, torch.device("cpu")).kernel == "onednn"
    assert_trainer_scores(hf, cfg, prompts, gen)


@needs_vllm
@pytest.mark.slow
def test_a_live_update_at_onednn_widths_serves_a_fresh_engines_bits(tmp_path):
    """FP4 off at hidden 512: the plugin's store holds packed copies of the weights themselves; an
    engine started on A, run, then updated in place to B (`live.update_weights`) serves B's bits,
    as an engine started on B does (the copies made from A are not read again)."""
    from megatron_fp4.integrations.hf import load_hf_checkpoint
    from megatron_fp4.integrations.vllm import export_for_vllm
    from megatron_fp4.integrations.vllm.live import update_weights
    from megatron_fp4.integrations.vllm.worker import build_llm
    from megatron_fp4.model import build_model
    from megatron_fp4.rl.rollouts.vllm_server import VLLMEngine
    from megatron_fp4.rollout.engine import SamplingParams

    cfg = _wide_cfg("none", layers=1)
    a, b = (export_for_vllm(build_model(cfg, seed=s), cfg, tmp_path / f"hf{s}", dtype=None) for s in (0, 1))
    prompts = [[3, 9, 27, 81], [5, 25], [7, 49, 100, 13, 2]]
    params = [SamplingParams(max_new_tokens=5, temperature=1.0, seed=s) for s in range(3)]
    outs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        for name, start, update in (("fresh", b, None), ("updated", a, b)):
            llm, _ = build_llm(str(start), {"dtype": "float32", "max_num_seqs": 3, "max_model_len": 32})
            eng = VLLMEngine(llm, name, pad_id=0)
            if update is not None:
                outs["before"] = eng.generate(prompts, params)
                update_weights(llm, load_hf_checkpoint(update)[1])
            outs[name] = eng.generate(prompts, params)
            del eng, llm
    for i in range(len(prompts)):
        assert outs["updated"].response_ids[i] == outs["fresh"].response_ids[i], i
        assert _hex(outs["updated"].log_probs[i]) == _hex(outs["fresh"].log_probs[i]), i
    assert any(_hex(outs["before"].log_probs[i]) != _hex(outs["fresh"].log_probs[i]) for i in range(len(prompts)))
