"""FP4 MoEResQ on the linears tensor parallelism cuts, in the trainer (gloo, fp64).

`fp4.scope=experts+attention` under ``parallel.tp``: q/k/v (column-parallel) and o (row-parallel)
are FP4 with their blocks inside a rank's slice and every amax spanning the cut max-reduced over
the tp group (`fp4/tensor_cut.py`), so their codes are the single process's slices; the experts
are FP4 too (MoE layers whole on every tp rank). Each layout must match the single-process
`Trainer` under `test_tp_trainer.check_layout`'s rule (losses and every parameter, ``FP64_REL``:
the same products summed in another order, see that module) — NVFP4 (block 16, tensor scale) and
MXFP4 (block 32, no global amax).

Under tp × ep with ``moe_tokens='whole'`` the tp peers of an ep group dispatch the same tokens: an
expert receives each source's rows as a segment of its own (`parallel/moe/alltoall.py`), so its FP4 weight
gradient is quantized along each segment exactly as the single process quantizes that micro-batch
(the duplicate segment is the same bits), summed over the tp copies and scaled by 1/(dp·tp):
`tp2_dp2_ep2_attn` checks it.
"""
from __future__ import annotations

import pytest

from tests.distributed.conftest import layout_results
from tests.distributed.test_tp_trainer import _train, check_layout

pytestmark = pytest.mark.distributed

ATTN = dict(scope="experts+attention")
LAYOUTS_2 = {
    "tp2_attn_nvfp4": dict(tp=2, **ATTN),
    # MXFP4's 32-blocks: k/v need 32 output features per rank (4 kv heads of 16 over tp 2)
    "tp2_attn_mxfp4": dict(tp=2, format="mxfp4", kv_heads=4, **ATTN),
}
LAYOUTS_4 = {
    "tp2_pp2_attn_nvfp4": dict(tp=2, pp=2, **ATTN),
    "tp2_dp2_ep2_attn": dict(tp=2, ep=2, **ATTN),
}


results_2 = layout_results(_train, 2, LAYOUTS_2, timeout_s=900)
results_4 = layout_results(_train, 4, LAYOUTS_4, timeout_s=900)


@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_tp2_fp4_attention_matches_single_process(results_2, name):
    check_layout(name, LAYOUTS_2[name], results_2)


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_tp2_pp2_and_ep_fp4_attention_matches_single_process(results_4, name):
    check_layout(name, LAYOUTS_4[name], results_4)
