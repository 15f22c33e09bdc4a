"""The trainer with tensor parallel (+ sequence parallel) trains like the single process (gloo, fp64).

Each layout runs 3 AdamW steps of the tiny model (FP4 MoEResQ scope ``experts``: the linears tensor
parallelism cuts stay high precision, the MoE layers run whole on every tp rank) and must match the
single-process `Trainer` on the same data: every step's loss, and every parameter after the steps —
a cut weight against the same slice of the reference (its ``tp_shard``; a rank's experts under ep
their global slice), a weight every tp rank holds whole against the whole reference. Tolerance ``FP64_REL`` = 1e-10 relative
(tests/numerics.py): the ranks add the same products in another order (partial sums over tp, the
vocab-parallel softmax's max and sum), ~1e-16 relative per op in float64 on any CPU, amplified by
Adam's division by √v + ε over 3 steps far less than 1e-10 at these gradient scales.

Weights every tp rank holds whole (norms, routers, experts) must stay the same bits on the ranks of
a tp group after the steps: their gradients are the same bits (all-reduced over tp, or computed from
the same all-reduced activations) and so is the update.
"""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.config import ConfigError
from megatron_fp4.model import lm_loss
from megatron_fp4.parallel.dims import ParallelDims
from megatron_fp4.training.step_loss import StepLoss, lm_loss_fn
from tests.distributed.conftest import layout_results
from tests.distributed.test_parallel_training import STEPS, tiny_cfg
from tests.numerics import FP64_REL, rel, single_thread

pytestmark = pytest.mark.distributed

LAYOUTS_2 = {
    "tp2_sp": dict(tp=2),
    "tp2_no_sp": dict(tp=2, sequence_parallel=False),
    "tp2_sp_kv1_zero2": dict(tp=2, zero_stage=2, kv_heads=1),  # one kv head replicated on both ranks
    "tp2_other_loss": dict(tp=2, loss="gathered"),  # a StepLoss that is not the LM loss: full logits gathered
}
LAYOUTS_4 = {
    "tp2_dp2": dict(tp=2),
    "tp2_pp2": dict(tp=2, pp=2),
    "tp2_dp2_ep2": dict(tp=2, ep=2),  # an ep group of tp peers: the same tokens dispatched twice
    # zero-bubble: the tp collectives' backward runs in the input-grad pass, weight grads deferred
    "tp2_pp2_zero_bubble": dict(tp=2, pp=2, virtual_stages=2, schedule="interleaved_zero_bubble", layers=4),
}
LAYOUTS_8 = {"tp2_pp2_ep2": dict(tp=2, pp=2, ep=2)}  # docs/parallel.md's command (dp = 2)


class GatheredLM(StepLoss):
    """The LM loss as any other `StepLoss` (not `LMLoss`): under tp it sees the gathered full logits."""

    def loss(self, logits, micro_batch):
        return lm_loss(logits, micro_batch["labels"]), {}


def layout_cfg(spec: dict):
    spec = dict(spec)
    spec.pop("loss", None)
    kv_heads, layers = spec.pop("kv_heads", None), spec.pop("layers", 2)
    scope, fmt = spec.pop("scope", "experts"), spec.pop("format", "nvfp4")
    model = {k: spec.pop(k) for k in ("recompute", "recompute_modules") if k in spec}  # model.* fields
    cfg = tiny_cfg(fp4=True, **spec)
    cfg.fp4.scope, cfg.fp4.format = scope, fmt
    m = cfg.model
    for key, value in model.items():
        setattr(m, key, value)
    m.num_layers, m.num_shared_experts = layers, 1
    if kv_heads is not None:
        m.num_kv_heads = kv_heads
    return cfg


def _train(rank, world_size, layouts):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    out = {}
    for name, spec in layouts.items():
        cfg = layout_cfg(spec)
        p = cfg.parallel
        mesh = ParallelMesh.build(p.pp, world_size // (p.pp * p.tp), p.ep, tp=p.tp, etp=p.etp)
        trainer = Trainer(cfg, mesh)
        loss_fn = GatheredLM() if spec.get("loss") == "gathered" else lm_loss_fn
        steps = [trainer.train_step_with_loss(trainer.next_micro_batches(), loss_fn) for _ in range(STEPS)]
        losses, norms = [r["loss"] for r in steps], [r["grad_norm"] for r in steps]
        offsets = {f"{n}.": m.expert_offset for n, m in trainer.model.named_modules() if hasattr(m, "expert_offset")}
        params = {}
        for n, q in trainer.model.named_parameters():
            shard = getattr(q, "tp_shard", None)
            shard = None if shard is None else [shard]
            first = offsets.get(n[:n.rindex(".") + 1]) if getattr(q, "is_expert", False) else None
            if first is not None:  # expert parallel: this rank's experts [first, first + E_local)
                shard = [(0, torch.arange(first, first + q.shape[0]))]
                if getattr(q, "etp_shard", None) is not None:  # expert tensor parallel: its ffn slice
                    shard.append(q.etp_shard)
            params[n] = (q.detach().clone(), shard)
        out[name] = dict(losses=losses, grad_norms=norms, params=params, tp_rank=mesh.coord("tp"), tp_group=mesh.ranks["tp"])
        trainer.optimizer.remove_hooks()
    return out


def single_process(spec: dict, steps: int = STEPS):
    """The single-process run of a layout's spec: (cfg, trainer after `steps` steps, step results)."""
    from megatron_fp4.training.trainer import Trainer

    cfg = layout_cfg(spec)
    p = cfg.parallel
    p.pp, p.tp, p.ep, p.etp, p.virtual_stages, p.schedule = 1, 1, 1, 1, 1, "1f1b"
    with single_thread():
        trainer = Trainer(cfg)
        results = [trainer.train_step() for _ in range(steps)]
    return cfg, trainer, results


def _reference(spec: dict):
    _, trainer, steps = single_process(spec)
    return [r["loss"] for r in steps], [r["grad_norm"] for r in steps], \
        {n: q.detach() for n, q in trainer.model.named_parameters()}


def check_layout(name, spec, results):
    ref_losses, ref_norms, ref_params = _reference(spec)
    seen = set()
    for rank, res in enumerate(results):
        r = res[name]
        for got, want in zip(r["losses"], ref_losses):
            assert abs(got - want) <= FP64_REL * abs(want), (name, rank, r["losses"], ref_losses)
        for got, want in zip(r["grad_norms"], ref_norms):  # every shard's elements counted once
            assert abs(got - want) <= FP64_REL * abs(want), (name, rank, r["grad_norms"], ref_norms)
        for pname, (value, shard) in r["params"].items():
            seen.add(pname)
            want = ref_params[pname]
            for dim, index in shard or ():
                want = want.index_select(dim, index)
            assert value.shape == want.shape, (name, rank, pname)
            assert rel(value, want) <= FP64_REL, (name, rank, pname, rel(value, want))
            if shard is None:  # whole on every tp rank: the same bits on each
                for peer in r["tp_group"]:
                    assert torch.equal(value, results[peer][name]["params"][pname][0]), (name, rank, peer, pname)
    assert seen == set(ref_params), f"{name}: parameters missing on every rank: {set(ref_params) - seen}"
    cut = {n for res in results for n, (_, shard) in res[name]["params"].items() if shard is not None}
    assert any("q_proj" in n for n in cut) and any("lm_head" in n for n in cut), cut  # really cut


results_2 = layout_results(_train, 2, LAYOUTS_2, timeout_s=900)
results_4 = layout_results(_train, 4, LAYOUTS_4, timeout_s=900)
results_8 = layout_results(_train, 8, LAYOUTS_8, timeout_s=900)


@pytest.mark.parametrize("name", list(LAYOUTS_8))
def test_tp2_pp2_ep2_matches_single_process(results_8, name):
    check_layout(name, LAYOUTS_8[name], results_8)


@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_tp2_trainer_matches_single_process(results_2, name):
    check_layout(name, LAYOUTS_2[name], results_2)


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_tp2_with_dp_pp_ep_matches_single_process(results_4, name):
    check_layout(name, LAYOUTS_4[name], results_4)


@pytest.mark.parametrize("field,value,words", [
    ("model.num_heads", 3, "model.num_heads=3: must be a multiple of parallel.tp=2"),
    ("model.vocab_size", 33, "model.vocab_size=33: must be a multiple of parallel.tp=2"),
    ("schedule.seq_len", 15, "schedule.seq_len=15: must be a multiple of parallel.tp=2"),
    ("model.num_kv_heads", 3, "model.num_kv_heads=3: must divide or be divided by parallel.tp=2"),
])
def test_tp_layout_errors_name_the_field(field, value, words):
    cfg = tiny_cfg()
    cfg.parallel.tp = 2
    section, key = field.split(".")
    setattr(getattr(cfg, section), key, value)
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        ParallelDims.from_config(cfg, 2)


def test_tp_is_accepted_and_etp_only_as_the_tp_group():
    cfg = tiny_cfg()
    cfg.parallel.tp = 2
    assert ParallelDims.from_config(cfg, 4).dp == 2
    cfg.parallel.etp = 4
    with pytest.raises(ConfigError, match="parallel.etp=4: expert tensor parallelism is implemented with the etp"):
        ParallelDims.from_config(cfg, 8)
