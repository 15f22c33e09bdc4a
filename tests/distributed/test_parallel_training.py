"""Every parallel layout trains like the single-process run (gloo, CPU, tiny model).

One spawn per world size runs several layouts in turn (each builds its own mesh), to keep the
suite within a few minutes on 2 cores. Three kinds of check, each portable to any CPU, kernel set
and BLAS mode (the bounds are derived in tests/numerics.py):

- **float64** (``dtype: fp64``, every layout: pp 1F1B / GPipe / interleaved / zero-bubble ZB1P and
  ZB-V, dp × ZeRO 0/1/2, pp × dp, FP4 MoEResQ experts under pp and dp): losses of 3 AdamW steps,
  every parameter tensor and the first step's gradients (routers included: the aux loss of every
  stage must reach them) within ``FP64_REL`` = 1e-10 relative of the single process.
- **bitwise, pipeline only** (fp32 and fp64): the first step's loss and every gradient (the
  pipeline's forward and backward; not the update: the norm for clipping, summed per stage and
  then across stages, rounds differently from the single process's sum over its buffers (the same
  `ZeroAdamW` at dp = 1), so updated parameters are checked in float64). Stage boundaries change nothing. Every micro-batch
  runs the same kernels on the same shapes in both runs, the gradients of a micro-batch accumulate
  in the same order, and the zero-bubble split backward (an input-grad and a deferred weight-grad
  pass, re-running the custom autograd Functions' deterministic backward) still accumulates weight
  grads micro-batch by micro-batch. This needs the same intra-op thread count on both sides (ATen
  splits reductions by thread), so the reference runs single-threaded like the children. CI runs
  these cases again under ``ATEN_CPU_CAPABILITY=default`` and ``MKL_CBWR=COMPATIBLE``.
- **fp32 data parallel**: the first step's gradients. Each micro-batch gradient g_i is computed
  bitwise-identically (same argument as above); dp only adds them in another order,
  (g0+g1)+(g2+g3) instead of ((g0+g1)+g2)+g3, so every element lies within
  2·γ_{n−1}·Σ|g_i| of the single process (``sum_order_bound``). Parameters after AdamW are not
  compared in fp32: Adam divides by √v + ε and so amplifies a rounding difference on a
  near-zero gradient without a useful bound (the float64 runs cover the update).
"""

import pytest
import torch

from megatron_fp4.config import Config
from tests.distributed.conftest import layout_results
from tests.numerics import FP64_REL, rel, single_thread, sum_order_bound

STEPS = 3


def tiny_cfg(fp4: bool = False, dtype: str = "fp64", **parallel) -> Config:
    cfg = Config()
    cfg.dtype = dtype
    s = cfg.schedule
    s.global_batch_size, s.micro_batch_size, s.seq_len, s.train_steps, s.warmup_steps = 8, 2, 16, STEPS, 1
    cfg.data.num_samples = 200
    cfg.logging.tensorboard_dir, cfg.logging.progress = None, False
    if not fp4:
        cfg.fp4.scope, cfg.fp4.train_mode = "none", "bf16"
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


LAYOUTS_2 = {
    "pp2_1f1b": dict(pp=2, schedule="1f1b"),
    "pp2_gpipe": dict(pp=2, schedule="gpipe"),
    "pp2_interleaved": dict(pp=2, virtual_stages=2, schedule="interleaved_1f1b"),
    "dp2_zero0": dict(zero_stage=0),
    "dp2_zero1": dict(zero_stage=1),
    "dp2_zero2": dict(zero_stage=2),
    "pp2_zero_bubble": dict(pp=2, virtual_stages=2, schedule="interleaved_zero_bubble"),
    "pp2_zbv": dict(pp=2, virtual_stages=2, schedule="zbv"),
    "fp4_pp2": dict(pp=2, fp4=True),
    "fp4_pp2_zero_bubble": dict(pp=2, virtual_stages=2, schedule="interleaved_zero_bubble", fp4=True),
    "fp4_dp2_zero1": dict(zero_stage=1, fp4=True),
}
# fp32, the production precision: bitwise for the pipeline, the sum-order bound for dp. A spawn of
# their own, so that tools/check_portability.sh can rerun just these under every kernel set.
LAYOUTS_2_FP32 = {
    "fp32_pp2_interleaved": dict(pp=2, virtual_stages=2, schedule="interleaved_1f1b", dtype="fp32"),
    "fp32_pp2_zero_bubble": dict(pp=2, virtual_stages=2, schedule="interleaved_zero_bubble", dtype="fp32"),
    "fp32_fp4_pp2": dict(pp=2, fp4=True, dtype="fp32"),
    "fp32_dp2_zero1": dict(zero_stage=1, dtype="fp32"),
    "fp32_fp4_dp2_zero0": dict(zero_stage=0, fp4=True, dtype="fp32"),
}
LAYOUTS_4 = {
    "pp2_dp2_zero1": dict(pp=2, zero_stage=1),
    "pp2_interleaved_dp2_zero2": dict(pp=2, virtual_stages=2, schedule="interleaved_1f1b", zero_stage=2),
    "fp32_pp2_dp2_zero1": dict(pp=2, zero_stage=1, dtype="fp32"),
}
ZERO_BUBBLE = {"pp2_zero_bubble", "pp2_zbv", "fp4_pp2_zero_bubble"}


def is_bitwise(spec: dict) -> bool:
    """Pipeline-only layouts (no data parallelism, see the module doc)."""
    return spec.get("pp", 1) > 1 and "zero_stage" not in spec


def layout_cfg(spec: dict) -> Config:
    spec = dict(spec)
    invariance = spec.pop("invariance", None)
    cfg = tiny_cfg(spec.pop("fp4", False), spec.pop("dtype", "fp64"), **spec)
    if invariance is not None:
        cfg.numerics.invariance = invariance
    return cfg


def _train_layouts(rank, world_size, layouts):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer
    from megatron_fp4.training.trainer import lm_loss_fn

    out = {}
    for name, spec in layouts.items():
        cfg = layout_cfg(spec)
        mesh = ParallelMesh.build(cfg.parallel.pp, world_size // cfg.parallel.pp, 1)
        trainer = Trainer(cfg, mesh)
        # First step's gradients (the aux loss of every stage must reach the routers).
        trainer.model.train()
        trainer.optimizer.zero_grad()
        first = trainer.next_micro_batches()
        trainer.forward_backward(first, lm_loss_fn)
        trainer.optimizer.finish_grad_sync()
        # (ZeRO-2 keeps only its reduced grad shard, so p.grad is not the full gradient there.)
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()
                 if cfg.parallel.zero_stage != 2}
        trainer.sampler.load_state_dict({"epoch": 0, "consumed": 0})
        losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        zero_bytes = trainer.optimizer.state_bytes()
        numel = sum(p.numel() for p in trainer.model.parameters())
        padding = sum(len(b.buckets) * b.group_size for b in trainer.optimizer.buffers)
        # Which computation kinds the schedule ran here (F, B full backward, I input-grad, W weight-grad).
        actions = set()
        if getattr(trainer, "pipeline", None) is not None:
            order = getattr(trainer.pipeline.schedule, "pipeline_order", None)
            if order is not None:
                actions = {a.computation_type.name for a in order[mesh.coord("pp")] if a is not None}
        out[name] = dict(losses=losses, params=params, grads=grads, zero_bytes=zero_bytes, numel=numel,
                         padding=padding, pp_rank=mesh.coord("pp"), actions=actions)
        trainer.optimizer.remove_hooks()
    return out


def _reference(spec: dict, steps: int = STEPS):
    """Single process, one intra-op thread: (losses, params, first-step grads, Σ_i |g_i| per param,
    number of micro-batches). The first step's micro-batch gradients are also taken one by one, for
    the sum-order bound."""
    from megatron_fp4.training.trainer import Trainer, lm_loss_fn

    cfg = layout_cfg(spec)
    cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.virtual_stages, cfg.parallel.schedule = 1, 1, 1, "1f1b"
    with single_thread():
        trainer = Trainer(cfg)
        trainer.model.train()
        micro_batches = trainer.next_micro_batches()
        n = len(micro_batches)
        trainer.model.set_aux_loss_scale(1.0 / n)
        abs_sum = {}
        for mb in micro_batches:  # the terms g_i, exactly as forward_backward computes each
            trainer.optimizer.zero_grad()
            loss, _ = lm_loss_fn(trainer.model, mb)
            (loss / n).backward()
            for name, p in trainer.model.named_parameters():
                abs_sum[name] = abs_sum.get(name, 0) + p.grad.abs().double()
        trainer.optimizer.zero_grad()
        trainer.forward_backward(micro_batches, lm_loss_fn)
        grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters()}
        trainer.sampler.load_state_dict({"epoch": 0, "consumed": 0})
        losses = [trainer.train_step()["loss"] for _ in range(steps)]
    return losses, dict(trainer.model.named_parameters()), grads, abs_sum, n


def check_layout(name, spec, results):
    ref_losses, ref_params, ref_grads, abs_sum, n = _reference(spec)
    fp64, bitwise = spec.get("dtype", "fp64") == "fp64", is_bitwise(spec)
    seen = set()
    for rank, res in enumerate(results):
        r = res[name]
        first, want_first = r["losses"][0], ref_losses[0]  # before any update
        assert first == want_first if bitwise else abs(first - want_first) <= FP64_REL * abs(want_first), (name, rank)
        if fp64:
            for got, want in zip(r["losses"], ref_losses):
                assert abs(got - want) <= FP64_REL * abs(want), (name, rank, r["losses"], ref_losses)
        for pname, grad in r["grads"].items():
            want = ref_grads[pname]
            if bitwise:
                assert torch.equal(grad, want), (name, rank, pname, rel(grad, want))
            elif fp64:
                assert rel(grad, want) <= FP64_REL, (name, rank, pname, rel(grad, want))
            else:
                excess = (grad.double() - want.double()).abs() - sum_order_bound(abs_sum[pname], n, grad.dtype)
                assert excess.max() <= 0, (name, rank, pname, float(excess.max()))
        for pname, value in r["params"].items():
            seen.add(pname)
            want = ref_params[pname].detach()
            if fp64:
                assert rel(value, want) <= FP64_REL, (name, rank, pname, rel(value, want))
    assert seen == set(ref_params), f"{name}: parameters missing on every rank: {set(ref_params) - seen}"


results_2 = layout_results(_train_layouts, 2, LAYOUTS_2)
results_4 = layout_results(_train_layouts, 4, LAYOUTS_4)


@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_two_process_layout_matches_single_process(results_2, name):
    check_layout(name, LAYOUTS_2[name], results_2)


results_2_fp32 = layout_results(_train_layouts, 2, LAYOUTS_2_FP32)


@pytest.mark.parametrize("name", list(LAYOUTS_2_FP32))
def test_fp32_layout_matches_single_process(results_2_fp32, name):
    check_layout(name, LAYOUTS_2_FP32[name], results_2_fp32)


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_four_process_layout_matches_single_process(results_4, name):
    check_layout(name, LAYOUTS_4[name], results_4)


@pytest.mark.parametrize("name,bytes_per_param", [("dp2_zero1", 24), ("dp2_zero2", 24), ("fp32_dp2_zero1", 12)])
def test_zero_shards_masters_and_adam_state(results_2, results_2_fp32, name, bytes_per_param):
    """master + exp_avg + exp_avg_sq (fp32: 12 bytes per parameter, fp64: 24) unsharded, 1/dp of it per rank."""
    for res in (results_2_fp32 if name.startswith("fp32") else results_2):
        r = res[name]
        unsharded = bytes_per_param * r["numel"]
        held = r["zero_bytes"]["masters"] + r["zero_bytes"]["moments"]
        assert abs(held - unsharded / 2) <= bytes_per_param * r["padding"], (held, unsharded)


@pytest.mark.parametrize("name", sorted(ZERO_BUBBLE))
def test_zero_bubble_schedules_split_the_backward(results_2, name):
    """The zero-bubble layouts really ran input-grad and weight-grad passes (not a full backward)."""
    for res in results_2:
        assert {"BACKWARD_INPUT", "BACKWARD_WEIGHT"} <= res[name]["actions"], res[name]["actions"]


def test_zero0_keeps_full_state(results_2):
    r = results_2[0]["dp2_zero0"]
    assert r["zero_bytes"]["moments"] >= 8 * r["numel"]
