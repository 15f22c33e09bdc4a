"""``parallel.etp`` (expert-tensor parallel) in the trainer, with the etp group = the tp group (gloo, fp64).

The MoE layers run whole on every tp rank (``moe_tp_tokens=whole``), so the etp ranks hold the
same rows and each runs its slice of every local expert's ffn dim (w1/w3 column cut, w2 row cut,
`parallel/moe/expert_tensor_parallel.py` ``replicated``); FP4 MoEResQ (NVFP4) experts get their amaxes
max-reduced over the etp group (`fp4/tensor_cut.py`). The ep groups then join the same tp
coordinate of other dp ranks (no token dispatched twice: expert gradients 1/dp), ZeRO shards each
etp slice over its edp group, and the gradient norm counts every slice once. Each layout must
match the single-process `Trainer` under `test_tp_trainer.check_layout`'s rule (an expert weight
against its ep block and ffn slice of the reference; ``FP64_REL``, derivation there). etp 1 with
the same tp2×dp2×ep2 layout: ``test_tp_trainer.py``'s ``tp2_dp2_ep2`` (and the local variants in
``test_tp_trainer_local.py``).
"""
from __future__ import annotations

import pytest

from megatron_fp4.config import ConfigError
from megatron_fp4.parallel.dims import ParallelDims
from tests.distributed.conftest import layout_results
from tests.distributed.test_parallel_training import tiny_cfg
from tests.distributed.test_tp_trainer import _train, check_layout

pytestmark = pytest.mark.distributed

LAYOUTS_4 = {
    "tp2_dp2_ep2_etp2": dict(tp=2, ep=2, etp=2),
    "tp2_dp2_etp2_attn": dict(tp=2, etp=2, scope="experts+attention"),  # ep 1: etp alone, FP4 attention too
    "tp2_pp2_etp2": dict(tp=2, pp=2, etp=2),  # per pipeline stage
}


results_4 = layout_results(_train, 4, LAYOUTS_4, timeout_s=900)


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_tp2_etp2_matches_single_process(results_4, name):
    check_layout(name, LAYOUTS_4[name], results_4)
    etp_cut = {n for res in results_4 for n, (_, shard) in res[name]["params"].items() if shard and len(shard) == 2}
    assert any("experts.w13" in n for n in etp_cut) and any("experts.w2" in n for n in etp_cut), etp_cut


@pytest.mark.parametrize("fields,words", [
    (dict(moe_tp_tokens="local"), "parallel.moe_tp_tokens='local': expert tensor parallel (parallel.etp=2) with"),
    (dict(expert_dispatcher="gcmoe"), "parallel.expert_dispatcher='gcmoe': expert tensor parallel"),
    (dict(moe_ffn=48), "model.moe_ffn_hidden_size=48: over parallel.etp=2 leaves 24 ffn features per rank"),
])
def test_etp_layout_errors_name_the_field(fields, words):
    cfg = tiny_cfg(fp4=True, tp=2, ep=2, etp=2)
    fields = dict(fields)
    cfg.model.moe_ffn_hidden_size = fields.pop("moe_ffn", cfg.model.moe_ffn_hidden_size)
    for key, value in fields.items():
        setattr(cfg.parallel, key, value)
    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        ParallelDims.from_config(cfg, 4)

