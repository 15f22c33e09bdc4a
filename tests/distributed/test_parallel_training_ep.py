"""Expert parallelism matches the single-process run: pp2 × ep2 (4 processes: pp2, dp2 = edp1 × ep2)
and ep2 (2 processes), FP4 off and on; expert params' ZeRO shards live on the edp group.

Run in float64, losses, the first step's gradients and parameters within ``FP64_REL`` (1e-10)
relative (Frobenius per tensor): under EP an expert's GEMM runs on the tokens of both dp ranks at
once, and a row's matmul result can differ in the last ulp with the number of rows the BLAS kernel
blocks together (which depends on the CPU and the BLAS mode); in float64 that is a ~1e-16 effect,
bounded as in tests/numerics.py. With FP4 (``fp4_resq``, backward quantized) that holds because the
expert's weight gradient quantizes the rows of each source rank (= each single-process micro-batch)
along their own tokens (`DispatchPlan.expert_segments`); quantizing the received rows as one batch
mixes micro-batches in one block and one amax, a ~1e-6 relative change of the expert gradients.
GC-MoE with FP4 gives the all-to-all dispatcher's bits (same batches, same segments) at the
`standard` numerics level; at `batch` (the default since the training forward runs the level's
kernels) the FP4 backward of GC-MoE's chunked exchange differs from the all-to-all's in the last
bits (2e-16 relative in float64, measured), so this bitwise comparison runs at `standard`; FP4 off,
GC-MoE equals the all-to-all bitwise at the default level too (test_parallel_training_gcmoe.py).
"""
import pytest

import megatron_fp4.parallel.moe.expert_parallel  # noqa: F401 - an ImportError fails the suite, never skips it
from tests.distributed.conftest import layout_results
from tests.distributed.test_parallel_training import STEPS, _reference, layout_cfg
from tests.numerics import FP64_REL, rel

SPEC = dict(pp=2, ep=2, zero_stage=1)
FP4_STEPS = 2
LAYOUTS_4 = {"pp2_ep2": (SPEC, STEPS), "fp4_pp2_ep2": (dict(SPEC, fp4=True), FP4_STEPS)}
LAYOUTS_2 = {"fp4_ep2": (dict(ep=2, zero_stage=1, fp4=True, invariance="standard"), FP4_STEPS),
             "fp4_ep2_gcmoe": (dict(ep=2, zero_stage=1, fp4=True, expert_dispatcher="gcmoe", invariance="standard",
                                    gcmoe_chunk_tokens=8, gcmoe_ring_slots=2), FP4_STEPS)}


def _run(rank, world_size, layouts):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer
    from megatron_fp4.training.trainer import lm_loss_fn

    out = {}
    for name, (spec, steps) in layouts.items():
        cfg = layout_cfg(spec)
        pp = cfg.parallel.pp
        t = Trainer(cfg, ParallelMesh.build(pp, world_size // pp, cfg.parallel.ep))
        t.model.train()
        t.optimizer.zero_grad()
        t.forward_backward(t.next_micro_batches(), lm_loss_fn)
        t.optimizer.finish_grad_sync()
        grads = {n: p.grad.clone() for n, p in t.model.named_parameters()}
        t.sampler.load_state_dict({"epoch": 0, "consumed": 0})
        losses = [t.train_step()["loss"] for _ in range(steps)]
        offsets = {}  # expert params: offset of this rank's block in the full [E, ...] tensor
        for moe in t.model.moe_layers():
            for pname in ("w13", "w2"):
                p = getattr(moe.experts, pname)
                offsets[[n for n, q in t.model.named_parameters() if q is p][0]] = moe.experts.expert_offset
        params = {n: p.detach().clone() for n, p in t.model.named_parameters()}
        axes = {b.axis: (b.group_size, list(b.names)) for b in t.optimizer.buffers}
        dispatchers = {type(m.dispatcher).__name__ for m in t.model.moe_layers()}
        out[name] = dict(losses=losses, grads=grads, params=params, offsets=offsets, axes=axes,
                         dispatchers=dispatchers)
        t.optimizer.remove_hooks()
    return out


def _check(name, spec, steps, results):
    ref_losses, ref_params, ref_grads, *_ = _reference(spec, steps)
    seen = set()
    for rank, res in enumerate(results):
        r = res[name]
        for got, want in zip(r["losses"], ref_losses):
            assert abs(got - want) <= FP64_REL * abs(want), (name, rank, r["losses"], ref_losses)
        for kind, got_all, want_all in (("grad", r["grads"], ref_grads), ("param", r["params"], ref_params)):
            for pname, value in got_all.items():
                want = want_all[pname].detach()
                if pname in r["offsets"]:
                    off = r["offsets"][pname]
                    want = want[off:off + value.shape[0]]
                assert rel(value, want) <= FP64_REL, (name, rank, kind, pname, rel(value, want))
                seen.add(pname)
        # Expert weights are reduced/sharded over edp (size dp/ep = 1), everything else over dp.
        assert r["axes"]["edp"][0] == 1 and r["axes"]["dp"][0] == 2
        assert r["axes"]["edp"][1] and all(".experts." in n for n in r["axes"]["edp"][1])
        assert not any(".experts." in n for n in r["axes"]["dp"][1])
    assert seen == set(ref_params), f"{name}: parameters missing on every rank: {set(ref_params) - seen}"


results_4 = layout_results(_run, 4, LAYOUTS_4)
results_2 = layout_results(_run, 2, LAYOUTS_2)


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_pp2_ep2_matches_single_process(results_4, name):
    _check(name, *LAYOUTS_4[name], results_4)


@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_ep2_fp4_matches_single_process(results_2, name):
    _check(name, *LAYOUTS_2[name], results_2)


def test_ep2_fp4_gcmoe_is_alltoall_bitwise(results_2):
    for r in results_2:
        gc, a2a = r["fp4_ep2_gcmoe"], r["fp4_ep2"]
        assert gc["dispatchers"] == {"GCMoEDispatcher"} and a2a["dispatchers"] == {"AllToAllDispatcher"}
        assert gc["losses"] == a2a["losses"]
        for kind in ("grads", "params"):
            for pname, value in gc[kind].items():
                assert value.equal(a2a[kind][pname]), (kind, pname, rel(value, a2a[kind][pname]))
