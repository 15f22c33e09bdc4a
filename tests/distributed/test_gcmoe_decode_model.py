"""The rollout engine's KV-cache generation on an ep2 model with the GC-MoE decode dispatcher equals
the single-process engine on the whole batch.

Each rank generates for its own prompts (greedy, no stop token, so every rank runs the same number
of model forwards: the prefill, with more tokens per rank than ``decode_tokens`` so it goes through
rounds, then one decode step of 2 tokens per rank per new token). The engine runs in its default
batch-invariant mode, where every op gives a row the same bits whatever the batch
(fp4/invariant.py): the EP model's rows must then equal the single process's rows **bitwise**
(token ids and log-probs), with experts only and with FP4 (MoEResQ) experts, also with the
capturable static path for the decode steps.
"""
from __future__ import annotations

import torch

from megatron_fp4.config import Config
from megatron_fp4.model import build_model
from megatron_fp4.model.dispatch import Dispatcher
from megatron_fp4.parallel.moe.expert_parallel import apply_expert_parallel
from megatron_fp4.parallel.mesh import ParallelMesh
from megatron_fp4.rollout import RolloutEngine, SamplingParams
from megatron_fp4.training.data import ArithmeticTokenizer
from tests.distributed.launch import run_distributed

TOK = ArithmeticTokenizer()
PROMPTS = ["12+7=", "3*4=", "100-99=", "7=", "45+45=", "2*2*2="]  # 3 per rank at ep2
NEW_TOKENS = 6


def _model(mode):
    cfg = Config()
    cfg.model.vocab_size = TOK.vocab_size
    cfg.model.num_layers = 2
    cfg.model.init_std = 0.2  # sharp routing: tokens spread over both ranks' experts
    return build_model(cfg, seed=7), mode


def _generate(model, mode, prompts):
    engine = RolloutEngine(model, mode=mode)
    out = engine.generate([TOK.encode(p, add_eos=False) for p in prompts],
                          SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0), return_routing=True)
    return out.response_ids, [lp.clone() for lp in out.log_probs], [r.clone() for r in out.routing]


class _Static(Dispatcher):
    """Decode steps (tokens per rank <= decode_tokens) on the static path, prefill on rounds."""

    def __init__(self, dispatcher):
        self.d, self.calls = dispatcher, {"static": 0, "rounds": 0}

    def dispatch(self, x, topk_idx, topk_w):
        return self.d.dispatch(x, topk_idx, topk_w)

    def combine(self, expert_out, handle):
        return self.d.combine(expert_out, handle)

    def run(self, x, topk_idx, topk_w, experts):
        static = x.shape[0] <= self.d.buffers.max_tokens
        self.d.static = static
        self.calls["static" if static else "rounds"] += 1
        return self.d(x, topk_idx, topk_w, experts)


CASES = [("bf16", False), ("fp4_resq", True)]  # (engine mode, decode steps on the static path)


def _worker(rank, world):
    mesh = ParallelMesh.build(pp=1, dp=world, ep=world)
    per_rank = len(PROMPTS) // world
    out = []
    for mode, static in CASES:
        model, mode = _model(mode)
        apply_expert_parallel(model, mesh, "gcmoe_decode", decode_tokens=4)
        wrappers = []
        if static:
            for moe in model.moe_layers():
                moe.set_dispatcher(_Static(moe.dispatcher))
                wrappers.append(moe.dispatcher)
        ids, lps, routes = _generate(model, mode, PROMPTS[rank * per_rank:(rank + 1) * per_rank])
        out.append({"ids": ids, "lps": lps, "routes": routes, "calls": [w.calls for w in wrappers]})
    return out


def test_ep2_decode_dispatcher_generation_equals_single_process():
    results = run_distributed(_worker, 2)
    per_rank = len(PROMPTS) // 2
    for case, (mode, static) in enumerate(CASES):
        model, mode = _model(mode)
        ref_ids, ref_lps, ref_routes = _generate(model, mode, PROMPTS)
        experts_used = set()
        for rank, r in enumerate(res[case] for res in results):
            sl = slice(rank * per_rank, (rank + 1) * per_rank)
            assert r["ids"] == ref_ids[sl], f"{mode} rank {rank}: {r['ids']} != {ref_ids[sl]}"
            for got, want in zip(r["lps"], ref_lps[sl]):
                assert torch.equal(got, want), (mode, (got - want).abs().max())
            for got, want in zip(r["routes"], ref_routes[sl]):
                assert torch.equal(got, want), mode
                experts_used |= set(got.flatten().tolist())
            if static:  # 2 layers × (1 prefill in rounds + NEW_TOKENS - 1 decode steps, static)
                assert r["calls"] == [{"static": NEW_TOKENS - 1, "rounds": 1}] * 2, r["calls"]
        assert experts_used & set(range(4)) and experts_used & set(range(4, 8)), "routing never crossed ranks"
