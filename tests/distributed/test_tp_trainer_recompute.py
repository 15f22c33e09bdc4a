"""Activation recomputation under tensor parallel (+ sequence parallel) in the trainer (gloo, fp64).

Also tp2×pp2 interleaved zero-bubble (4 processes), whose split backward recomputes in both passes.

`model.recompute` full and selective (every module: attention, experts, mlp, moe) on tp2 (SP on and
off) and on tp2 with FP4 MoEResQ on the cut linears (``fp4.scope=experts+attention``: q/k/v/o FP4
with their amaxes max-reduced over tp inside the recomputed region) must give every rank the
losses and weights of recompute=none on the same layout bit for bit — the recompute reruns the same
kernels, and the same tp collectives (SP gather / reduce-scatter, the row-parallel all-reduce, the
amax max-reductions) in the same order on every rank, on the same inputs. And each layout matches
the single process under `test_tp_trainer.check_layout`'s rule (``FP64_REL``, derivation there).
A count of `recompute.checkpoint` regions shows the recompute really ran.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import layout_results
from tests.distributed.test_tp_trainer import _train, check_layout

pytestmark = pytest.mark.distributed

BASES = {
    "tp2_sp": dict(tp=2),
    "tp2_no_sp": dict(tp=2, sequence_parallel=False),
    "tp2_attn": dict(tp=2, scope="experts+attention"),
}
MODES = {"none": {}, "full": dict(recompute="full"),
         "selective": dict(recompute="selective", recompute_modules=["attention", "experts", "mlp", "moe"])}
LAYOUTS_2 = {f"{b}_{m}": dict(**spec, **mode) for b, spec in BASES.items() for m, mode in MODES.items()}
# zero-bubble: the recompute runs in the input-grad pass and again in the deferred weight-grad pass
ZB = dict(tp=2, pp=2, virtual_stages=2, schedule="interleaved_zero_bubble", layers=4, scope="experts+attention")
LAYOUTS_4 = {f"tp2_pp2_zb_{m}": dict(**ZB, **mode) for m, mode in MODES.items()}


def _train_counting(rank, world_size, layouts):
    import megatron_fp4.model.recompute as recompute

    original, out = recompute.checkpoint, {}

    def counting(*args, **kwargs):
        counting.n += 1
        return original(*args, **kwargs)
    recompute.checkpoint = counting
    try:
        for name, spec in layouts.items():
            counting.n = 0
            out.update(_train(rank, world_size, {name: spec}))
            out[name]["regions"] = counting.n
    finally:
        recompute.checkpoint = original
    return out


results_2 = layout_results(_train_counting, 2, LAYOUTS_2, timeout_s=900)
results_4 = layout_results(_train_counting, 4, LAYOUTS_4, timeout_s=900)


def check_equal_to_none(results, base, mode):
    for rank, res in enumerate(results):
        got, ref = res[f"{base}_{mode}"], res[f"{base}_none"]
        assert ref["regions"] == 0 and got["regions"] > 0, (base, mode, rank, got["regions"])
        assert [x.hex() for x in got["losses"]] == [x.hex() for x in ref["losses"]], (base, mode, rank)
        assert got["params"].keys() == ref["params"].keys()
        unequal = [n for n, (v, _) in got["params"].items() if not torch.equal(v, ref["params"][n][0])]
        assert not unequal, f"{base} {mode} rank {rank}: weights differ from recompute=none in {unequal}"


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_tp2_recompute_equals_none_bitwise(results_2, base, mode):
    check_equal_to_none(results_2, base, mode)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_tp2_pp2_zero_bubble_recompute_equals_none_bitwise(results_4, mode):
    check_equal_to_none(results_4, "tp2_pp2_zb", mode)
    check_layout(f"tp2_pp2_zb_{mode}", LAYOUTS_4[f"tp2_pp2_zb_{mode}"], results_4)


@pytest.mark.parametrize("name", [n for n in LAYOUTS_2 if not n.endswith("_none")])
def test_tp2_recompute_matches_single_process(results_2, name):
    check_layout(name, LAYOUTS_2[name], results_2)
