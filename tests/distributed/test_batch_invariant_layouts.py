"""Batch-invariant parity across layouts: the rollout engine's log-probs (single process, KV-cache
decode, one left-padded batch) == the trainer side's full-forward scores with the model split over
ep2 (all-to-all and GC-MoE dispatch) or pp2 (the pipeline chunks' own forward pieces), bitwise, with
identical expert choices.

Why bitwise holds by construction (see tests/unit/test_batch_invariant.py and fp4/invariant.py):
at the ``batch`` level (fixed-shape GEMM tiles and key blocks) and the ``exact`` level (exact FP4
GEMMs, fixed per-row trees) every row's reduction order is fixed, so it does
not matter that under ep an expert's GEMM runs on the tokens of both ranks in arrival order, or that
under pp the layers run in two processes with the hidden state sent between them. Each rank scores
another subset of the rows (other batch, other padding) than the engine generated together.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed.launch import run_distributed
from tests.numerics import single_thread
from tests.unit.test_batch_invariant import bits, prompts, tiny_model

SEED = 3
MODES = (("batch", "bf16"), ("batch", "fp4_resq"), ("exact", "fp4_resq"))  # (numerics level, FP4 mode)


def _rollouts(case):
    from megatron_fp4.rollout import RolloutEngine, SamplingParams

    level, mode = case
    model = tiny_model(SEED, "experts+attention")
    out = RolloutEngine(model, mode=mode, invariance=level).generate(prompts(SEED, 6), SamplingParams(max_new_tokens=5, temperature=1.0,
                                                                                   seed=SEED), return_routing=True)
    return out.prompt_ids, out.response_ids, out.log_probs, out.routing


def _score_rows(model, rows, prompt_ids, response_ids, case):
    """Score `rows` in one batch (this rank's subset) -> {row: (log_probs, routing)}."""
    from megatron_fp4.rollout import score

    level, mode = case
    sc = score(model, [prompt_ids[i] for i in rows], [response_ids[i] for i in rows], mode=mode, return_routing=True,
               invariance=level)
    return {i: (sc["log_probs"][j], sc["routing"][j]) for j, i in enumerate(rows)}


def _worker(rank, world, rollouts):
    from megatron_fp4.parallel.moe.expert_parallel import apply_expert_parallel
    from megatron_fp4.parallel.mesh import ParallelMesh

    torch.set_num_threads(1)
    out = {}
    mesh = ParallelMesh.build(pp=1, dp=world, ep=world)
    for case in MODES:
        prompt_ids, response_ids, _, _ = rollouts[case]
        rows = list(range(rank, len(prompt_ids), world))[::-1]  # another subset, order and padding
        for dispatcher in ("alltoall", "gcmoe"):
            model = tiny_model(SEED, "experts+attention", level=case[0], mode=case[1])  # built at the case's numerics
            apply_expert_parallel(model, mesh, dispatcher, chunk_tokens=4, ring_slots=2)
            out[(case, dispatcher)] = _score_rows(model, rows, prompt_ids, response_ids, case)
    return out


def _pp_worker(rank, world, rollouts):
    """pp2: rank 0 runs embed + its layers, sends the hidden state; rank 1 runs the rest + head."""
    from megatron_fp4.parallel.pipeline import build_chunks
    from megatron_fp4.rollout.engine import pad_prompt_response, positions_from_mask
    from megatron_fp4.rollout.scoring import log_probs_from_logits
    from megatron_fp4.training.data import ArithmeticTokenizer

    torch.set_num_threads(1)
    out = {}
    for case in MODES:
        (level, mode), (prompt_ids, response_ids, _, _) = case, rollouts[case]
        model = tiny_model(SEED, "experts+attention", level=level, mode=mode)
        [(_, chunk)] = build_chunks(model, pp=2, pp_rank=rank)
        batch = pad_prompt_response(prompt_ids, response_ids, ArithmeticTokenizer().pad_id)
        tokens, mask = batch["input_ids"], batch["attention_mask"]
        positions = positions_from_mask(mask)
        with torch.no_grad():
            if rank == 0:
                h = model.run_layers(model.embed(tokens), positions, mask, chunk.layer_range)
                dist.send(h.contiguous(), dst=1)
            else:
                h = torch.empty(*tokens.shape, model.cfg.hidden_size)
                dist.recv(h, src=0)
                h = model.run_layers(h, positions, mask, chunk.layer_range)
                log_probs, _ = log_probs_from_logits(model.head(h), tokens, batch["response_mask"], model.numerics)
                P = batch["prompt_len"]
                out[case] = [log_probs[i, P:P + len(r)] for i, r in enumerate(response_ids)]
    return out


@pytest.fixture(scope="module")
def rollouts():
    # One intra-op thread, as the scoring ranks run: the batch level fixes the GEMM shapes, not the
    # BLAS's threading (MKL_CBWR=COMPATIBLE on an AMD EPYC gave a 16-row tile other bits at 2 threads
    # than at 1; docs/numerics.md). The exact level's limb GEMMs do not depend on it.
    with single_thread():
        return {mode: _rollouts(mode) for mode in MODES}


def _both(rank, world, rollouts):
    """The ep2 scoring, then the pp2 scoring: one spawn of 2 processes for the module's two tests."""
    return {"ep2": _worker(rank, world, rollouts), "pp2": _pp_worker(rank, world, rollouts)}


@pytest.fixture(scope="module")
def scored(rollouts):
    return run_distributed(_both, 2, (rollouts,), timeout_s=900)


def test_ep2_alltoall_and_gcmoe_scores_equal_rollout_bitwise(rollouts, scored):
    seen = set()
    for res in (r["ep2"] for r in scored):
        for (mode, dispatcher), rows in res.items():
            _, _, log_probs, routing = rollouts[mode]
            for i, (lp, rt) in rows.items():
                assert torch.equal(bits(lp), bits(log_probs[i])), (mode, dispatcher, i, lp, log_probs[i])
                assert torch.equal(rt.sort(-1).values, routing[i].sort(-1).values), (mode, dispatcher, i)
                seen.add((mode, dispatcher, i))
    assert len(seen) == len(MODES) * 2 * len(rollouts[MODES[0]][0])


def test_pp2_scores_equal_rollout_bitwise(rollouts, scored):
    last = scored[1]["pp2"]
    for mode in MODES:
        for i, lp in enumerate(last[mode]):
            assert torch.equal(bits(lp), bits(rollouts[mode][2][i])), (mode, i, lp, rollouts[mode][2][i])
