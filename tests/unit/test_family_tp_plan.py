"""What tensor parallelism refuses for the families beside Qwen3-MoE, up front and naming the fix
(their tp/etp training runs: tests/distributed/test_family_layouts.py)."""
import pytest

from megatron_fp4.config import ConfigError
from megatron_fp4.parallel.dims import ParallelDims
from tests.distributed.test_family_layouts import family_cfg


def test_fp4_latent_attention_under_tp_is_refused_before_any_group():
    cfg = family_cfg("deepseek_v3", dict(tp=2, fp4=True))
    cfg.fp4.scope = "experts+attention"
    with pytest.raises(ConfigError, match=r"parallel\.tp=2 .*FP4 latent attention.*use fp4\.scope=experts"):
        ParallelDims.from_config(cfg, 2)
    cfg.fp4.scope = "experts"
    assert ParallelDims.from_config(cfg, 2).tp == 2


def test_gpt_oss_etp_needs_hidden_divisible():
    cfg = family_cfg("gpt_oss", dict(tp=2, etp=2))
    cfg.validate()
    cfg.parallel.tp, cfg.parallel.etp = 3, 3
    with pytest.raises(ConfigError, match=r"model\.hidden_size=.*parallel\.etp=3 for the gpt_oss family"):
        cfg.validate()
