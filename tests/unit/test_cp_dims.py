"""`parallel.cp` in `ParallelDims`: the cp groups are cp consecutive dp coordinates (Megatron-Core's
tp-cp-dp-pp order), the data-parallel size excludes cp, and every combination the sequence split
does not implement is one ConfigError naming the field and the fix."""
import pytest

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
    (dict(parallel__tp=2), 4, "parallel.tp=2", "with parallel.tp > 1 is not implemented yet"),
    (dict(parallel__pp=2), 4, "parallel.pp=2", "with parallel.pp > 1 is not implemented yet"),
    (dict(model__moe_capacity_factor=1.0), 2, "model.moe_capacity_factor=1.0", "not with parallel.cp=2"),
    (dict(model__moe_aux_loss_type="seq"), 2, "model.moe_aux_loss_type='seq'", "not with parallel.cp=2"),
    (dict(model__recompute="full"), 2, "model.recompute='full'", "not implemented yet"),
    (dict(fp4__scope="experts", fp4__train_mode="fp4_resq"), 2, "fp4.scope='experts'", "FP4 training with parallel.cp=2"),
]


@pytest.mark.parametrize("fields, world, start, words", BAD)
def test_unsupported_cp_combinations_are_refused(fields, world, start, words):
    with pytest.raises(ConfigError) as err:
        ParallelDims.from_config(cp_cfg(2, **fields), world)
    assert str(err.value).startswith(start) and words in str(err.value), str(err.value)


def test_cp_below_one_is_refused():
    with pytest.raises(ConfigError, match="parallel.cp=0: must be >= 1"):
        ParallelDims.from_config(cp_cfg(0), 2)
