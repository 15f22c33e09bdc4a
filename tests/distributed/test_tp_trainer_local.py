"""``parallel.moe_tp_tokens=local`` (Megatron's parallel folding) in the trainer (gloo, fp64).

Each tp rank's MoE layers route only its 1/tp of the sequence (`parallel/moe/tp_moe.py`): the ep group
may span tp peers and dp ranks alike (ep up to dp·tp, not only divisors of dp), the all-to-all
dispatcher folds the tp ranks (``tp_fold``) so that an FP4 expert's weight gradient is quantized
along a micro-batch's tokens in single-process order, and expert gradients are scaled 1/dp (no tp
copies of a token, unlike ``whole``'s 1/(dp·tp)). FP4 MoEResQ (NVFP4) on the experts; each layout
must match the single-process `Trainer` under `test_tp_trainer.check_layout`'s rule (``FP64_REL``,
the derivation there).
"""
from __future__ import annotations

import pytest

from megatron_fp4.config import ConfigError
from megatron_fp4.parallel.dims import ParallelDims
from tests.distributed.conftest import layout_results
from tests.distributed.test_parallel_training import tiny_cfg
from tests.distributed.test_tp_trainer import _train, check_layout

pytestmark = pytest.mark.distributed

LOCAL = dict(moe_tp_tokens="local")
LAYOUTS_2 = {
    "tp2_ep2_local": dict(tp=2, ep=2, **LOCAL),  # ep = the tp group (dp = 1)
    "tp2_ep2_local_no_sp": dict(tp=2, ep=2, sequence_parallel=False, **LOCAL),
}
LAYOUTS_4 = {
    "tp2_dp2_ep2_local": dict(tp=2, ep=2, **LOCAL),
    "tp2_dp2_ep4_local": dict(tp=2, ep=4, scope="experts+attention", **LOCAL),  # ep over dp×tp
    "tp2_pp2_ep2_local": dict(tp=2, pp=2, ep=2, **LOCAL),  # dp 1: the ep group is each stage's tp group
}


results_2 = layout_results(_train, 2, LAYOUTS_2, timeout_s=900)
results_4 = layout_results(_train, 4, LAYOUTS_4, timeout_s=900)


@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_tp2_ep2_local_tokens_match_single_process(results_2, name):
    check_layout(name, LAYOUTS_2[name], results_2)


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_tp2_dp2_ep_local_tokens_match_single_process(results_4, name):
    check_layout(name, LAYOUTS_4[name], results_4)


@pytest.mark.parametrize("fields,world,words", [
    (dict(tp=2, ep=2), 2, "parallel.ep=2: expert parallel groups are carved out of the data-parallel ranks"),
    (dict(tp=2, ep=2, moe_tp_tokens="local", expert_dispatcher="gcmoe"), 2,
     "parallel.moe_tp_tokens='local': with FP4 experts"),
    (dict(tp=4, ep=2, moe_tp_tokens="local"), 8, "parallel.ep=2 a multiple of parallel.tp=4"),
])
def test_local_tokens_layout_errors_name_the_field(fields, world, words):
    cfg = tiny_cfg(fp4=True, **fields)
    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("(", r"\(")):
        ParallelDims.from_config(cfg, world)


def test_local_tokens_refuse_capacity_factor():
    cfg = tiny_cfg(tp=2, ep=2, moe_tp_tokens="local")
    cfg.model.moe_capacity_factor = 1.0
    with pytest.raises(ConfigError, match="parallel.moe_tp_tokens='local': does not take model.moe_capacity_factor"):
        ParallelDims.from_config(cfg, 2)
