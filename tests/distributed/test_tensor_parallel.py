"""Tensor parallel (+ sequence parallel) on 2 gloo ranks against the single-process model, fp64.

Each rank builds the single-process model (same seed), cuts it with `parallelize_tp` and runs one
training forward/backward on the same batch: the loss (vocab-parallel cross entropy + the MoE
auxiliary losses) and every gradient (a cut weight against the same slice of the reference's
gradient) must agree within FP64_REL of their scale (tests/numerics.py): the ranks' partial sums
add the same products in another order, ~1e-16 relative in float64 on any CPU. FP4 MoEResQ
experts stay whole on each rank and see the single process's tokens in its order.
"""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.model.transformer import build_model, lm_loss
from tests.distributed.launch import run_distributed
from tests.numerics import FP64_REL

pytestmark = pytest.mark.distributed

CASES = {
    # dense layer + shared expert, no FP4: every cut (q/k/v/o, dense MLP, vocab) and the aux losses
    "dense": dict(scope="none", dense_layers=[0], num_kv_heads=2, sp=False),
    "dense_sp": dict(scope="none", dense_layers=[0], num_kv_heads=2, sp=True),
    # FP4 MoEResQ experts, one kv head for two ranks (replicated, its gradient summed)
    "fp4_experts": dict(scope="experts", dense_layers=[], num_kv_heads=1, sp=False),
    "fp4_experts_sp": dict(scope="experts", dense_layers=[], num_kv_heads=1, sp=True),
}


def make_cfg(case: dict) -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.dense_layers, m.num_kv_heads, m.num_shared_experts = 2, case["dense_layers"], case["num_kv_heads"], 1
    m.router_aux_loss_coef, m.router_z_loss_coef = 0.01, 0.001
    cfg.fp4.scope, cfg.fp4.train_mode, cfg.fp4.format = case["scope"], "fp4_resq", case.get("format", "nvfp4")
    return cfg.validate()


def batch(cfg, padded: bool):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=g)
    labels = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=g)
    labels[0, :3] = -100
    mask = None
    if padded:
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, :4] = 0
    return tokens, labels, mask


def reference(case: dict, padded: bool):
    cfg = make_cfg(case)
    model = build_model(cfg, seed=5).double().train()
    tokens, labels, mask = batch(cfg, padded)
    logits = model(tokens, attention_mask=mask).logits
    loss = lm_loss(logits, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, logits.detach()


def tp_rank(rank, world, case, padded):
    import torch.distributed as dist

    from megatron_fp4.parallel.tensor_parallel import parallelize_tp
    cfg = make_cfg(case)
    model = build_model(cfg, seed=5).double().train()
    return run_tp(cfg, model, parallelize_tp(model, dist.group.WORLD, sequence_parallel=case["sp"]), padded)


def run_tp(cfg, model, plan, padded: bool, shard_of=lambda name, p: getattr(p, "tp_shard", None)):
    """One forward/backward of the cut `model` on the test batch: (loss, {name: (grad, shard)}, gathered
    logits, local vocabulary size); ``shard_of`` says which slice of the reference's a grad is."""
    tokens, labels, mask = batch(cfg, padded)
    logits = model(tokens, attention_mask=mask).logits
    loss = plan.loss(logits, labels)
    loss.backward()
    plan.finish_grads()
    full = plan.gather_logits(logits.detach())
    grads = {n: (p.grad.clone(), shard_of(n, p)) for n, p in model.named_parameters()}
    return loss.detach(), grads, full, logits.shape[-1]


KEYS = [(name, padded) for name in CASES for padded in (False, True)]


def _all_cases(rank, world):
    """Every case, then the refused layouts (key "refusals")."""
    out = {key: tp_rank(rank, world, CASES[key[0]], key[1]) for key in KEYS}
    out["refusals"] = _refusals(rank, world)
    return out


@pytest.fixture(scope="module")
def tp_results():
    """Every case on one pair of processes (one spawn for the whole file: comparisons and refusals)."""
    return run_distributed(_all_cases, 2, timeout_s=600)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_tp2_equals_single_process(name, padded, tp_results):
    check_equal(CASES[name], padded, [by_key[(name, padded)] for by_key in tp_results])


def check_equal(case: dict, padded: bool, results: list, ref=None) -> None:
    """Every rank's loss, gathered logits and gradients (cut ones against the same slice of the
    reference's) within FP64_REL of the single process's (``ref``: its (loss, grads, logits),
    default `reference`)."""
    ref_loss, ref_grads, ref_logits = reference(case, padded) if ref is None else ref
    cfg = make_cfg(case)
    for rank, (loss, grads, full, vocab_local) in enumerate(results):
        assert vocab_local == cfg.model.vocab_size // 2
        assert abs(float(loss) - float(ref_loss)) <= FP64_REL * abs(float(ref_loss)), (rank, loss, ref_loss)
        real = slice(None) if not padded else (slice(None), slice(4, None))  # padding rows are never read
        assert float((full[real] - ref_logits[real]).abs().max()) <= FP64_REL * float(ref_logits.abs().max())
        assert set(grads) == set(ref_grads)
        for n, (g, shard) in grads.items():
            want = ref_grads[n] if shard is None else ref_grads[n].index_select(shard[0], shard[1])
            scale = float(ref_grads[n].abs().max()) or 1.0
            assert g.shape == want.shape, n
            assert float((g - want).abs().max()) <= FP64_REL * scale, (rank, n, float((g - want).abs().max()), scale)
    # the cut weights are disjoint halves: rank 0's and rank 1's q_proj rows differ
    q0 = results[0][1]["layers.0.self_attn.q_proj.weight"][1][1]
    q1 = results[1][1]["layers.0.self_attn.q_proj.weight"][1][1]
    assert not set(q0.tolist()) & set(q1.tolist())


def test_bad_tp_layouts_are_refused(tp_results):
    from megatron_fp4.parallel import tensor_parallel as tpm
    results = [r["refusals"] for r in tp_results]
    for messages in results:
        assert any("num_heads=3 is not a multiple of parallel.tp=2" in m for m in messages), messages
        assert any("FP4 attention (fp4.scope=experts+attention) needs model.num_kv_heads=1 >= tp" in m
                   for m in messages), messages
        assert any("layers.0.mlp.gate_proj: FP4 under tensor parallel 2 (column-parallel) leaves 24 output "
                   "features per rank, not a multiple of the nvfp4 block (16)" in m for m in messages), messages
        assert len(messages) == 3, messages
    assert tpm  # imported without a process group


def _refusals(rank, world):
    import torch.distributed as dist

    from megatron_fp4.parallel.tensor_parallel import parallelize_tp
    out = []
    for change in ({"model.hidden_size": 48, "model.num_heads": 3, "model.num_kv_heads": 1},
                   {"fp4.scope": "experts+attention", "model.num_kv_heads": 1},
                   {"fp4.scope": "experts", "model.dense_layers": [0], "model.dense_ffn_hidden_size": 48}):
        cfg = Config()
        cfg.model.num_layers = 2
        for key, value in change.items():
            section, field = key.split(".")
            setattr(getattr(cfg, section), field, value)
        try:
            parallelize_tp(build_model(cfg.validate(), seed=1), dist.group.WORLD)
        except ValueError as err:
            out.append(str(err))
    return out
