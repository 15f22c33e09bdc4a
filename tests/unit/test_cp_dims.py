"""`parallel.cp` in `ParallelDims`: the cp groups are cp consecutive dp coordinates (Megatron-Core's
tp-cp-dp-pp order), the data-parallel size excludes cp, and every combination the sequence split
does not implement is one ConfigError naming the field and the fix."""
import pytest
import torch

from megatron_fp4.config import Config, ConfigError
from megatron_fp4.parallel.dims import ParallelDims


def cp_cfg(cp: int = 2, **fields) -> Config:
    cfg = Config()
    cfg.parallel.cp = cp
    cfg.fp4.scope, cfg.fp4.train_mode = "none", "bf16"
    for dotted, value in fields.items():
        section, name = dotted.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def test_cp_layout_ranks_follow_megatron_order():
    # world 8 = pp 2 × dp 2 × cp 2 × tp 1, by hand: rank = ((pp·2 + data)·2 + cp)
    dims = ParallelDims(8, pp=2, dp=4, tp=1, ep=1, etp=1, cp=2).validate()
    assert dims.data_dp == 2
    assert dims.groups("cp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.groups("dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the ranks holding the same parameters
    assert [(dims.coords(r)["data"], dims.coords(r)["cp"]) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # with tp 2 the cp peers are tp apart
    dims = ParallelDims(4, pp=1, dp=2, tp=2, ep=1, etp=1, cp=2).validate()
    assert dims.groups("cp") == [[0, 2], [1, 3]]


def test_parallel_dp_counts_data_replicas():
    cfg = cp_cfg(2, schedule__global_batch_size=8, schedule__micro_batch_size=2)
    assert ParallelDims.from_config(cfg, 4) == ParallelDims(4, 1, 4, 1, 1, 1, 2)  # dp = -1 inferred
    cfg.parallel.dp = 2
    assert ParallelDims.from_config(cfg, 4).data_dp == 2
    cfg.parallel.dp = 1
    assert ParallelDims.from_config(cfg, 2).data_dp == 1


BAD = [
    (dict(), 1, "parallel.cp=2", "needs several processes"),
    (dict(parallel__dp=2), 2, "parallel.dp=2", "dp×cp×pp×tp = 2×2×1×1 must equal the world size 2"),
    (dict(schedule__seq_len=18), 2, "schedule.seq_len=18", "multiple of 2×parallel.cp = 4"),
    (dict(parallel__etp=2, parallel__tp=2), 4, "parallel.etp=2", "with parallel.etp > 1 is not implemented yet"),
    (dict(parallel__tp=2, parallel__moe_tp_tokens="local"), 4, "parallel.moe_tp_tokens='local'", "not implemented yet"),
    (dict(parallel__tp=4, schedule__seq_len=20), 8, "schedule.seq_len=20", "a multiple of parallel.tp=4"),
    (dict(model__moe_capacity_factor=1.0), 2, "model.moe_capacity_factor=1.0", "not with parallel.cp=2"),
    (dict(model__moe_aux_loss_type="seq"), 2, "model.moe_aux_loss_type='seq'", "not with parallel.cp=2"),
    (dict(model__recompute="full"), 2, "model.recompute='full'", "not implemented yet"),
    (dict(fp4__scope="experts", fp4__train_mode="fp4_resq"), 2, "fp4.scope='experts'",
     "FP4 training with parallel.cp=2"),
]


@pytest.mark.parametrize("fields, world, start, words", BAD)
def test_unsupported_cp_combinations_are_refused(fields, world, start, words):
    with pytest.raises(ConfigError) as err:
        ParallelDims.from_config(cp_cfg(2, **fields), world)
    assert str(err.value).startswith(start) and words in str(err.value), str(err.value)


def test_cp_below_one_is_refused():
    with pytest.raises(ConfigError, match="parallel.cp=0: must be >= 1"):
        ParallelDims.from_config(cp_cfg(0), 2)


# -- the sequence split and the refusals of `parallel/context.py` (no process group) ---------------
def test_load_balanced_chunks_by_hand():
    from megatron_fp4.parallel.context import local_positions, natural_order

    # 8 tokens, cp 2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    # cp 3, 12 tokens: rank r holds chunks r and 5-r
    assert [local_positions(12, 3, r).tolist() for r in range(3)] == [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]
    gathered = torch.cat([local_positions(12, 3, r) for r in range(3)])
    assert gathered[natural_order(12, 3)].tolist() == list(range(12))
    with pytest.raises(ValueError, match="multiple of 6"):
        local_positions(10, 3, 0)


def test_cp_attention_refuses_a_kv_cache_and_a_padding_mask():
    from megatron_fp4.model.layers import Attention, KVCache

    attn = Attention(16, 2, 1, 8, 1e-6, 10000.0).double()
    attn.kv_gather = lambda k, v: (k, v)  # a cp group of one
    x, pos = torch.randn(1, 4, 16, dtype=torch.float64), torch.arange(4)[None]
    # a cp group of one is plain causal attention (fp64: an explicit mask vs is_causal, a few ulps)
    plain = Attention(16, 2, 1, 8, 1e-6, 10000.0).double()
    plain.load_state_dict(attn.state_dict())
    torch.testing.assert_close(attn(x, pos), plain(x, pos), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="neither a KV cache nor a padding mask"):
        attn(x, pos, cache=KVCache.empty(1).layers[0])
    with pytest.raises(ValueError, match="neither a KV cache nor a padding mask"):
        attn(x, pos, torch.ones(1, 4))


def test_cp_loss_refuses_other_losses():
    from megatron_fp4.parallel.context import ContextParallelPlan
    from megatron_fp4.training.step_loss import StepLoss, context_parallel_loss, lm_loss_fn

    plan = ContextParallelPlan(None, 2, 0)
    assert context_parallel_loss(lm_loss_fn, None) is lm_loss_fn

    class Policy(StepLoss):
        pass

    with pytest.raises(ValueError, match=r"parallel.cp=2\) trains the LM loss only.*Policy"):
        context_parallel_loss(Policy(), plan)
    with pytest.raises(ValueError, match="must be megatron_fp4.training.step_loss.lm_loss_fn"):
        context_parallel_loss(lambda model, mb: None, plan)
    # the model reads this rank's tokens at their global positions
    inputs = context_parallel_loss(lm_loss_fn, plan).model_inputs({"tokens": torch.arange(10, 18)[None]})
    assert inputs["tokens"].tolist() == [[10, 11, 16, 17]] and inputs["positions"].tolist() == [[0, 1, 6, 7]]
