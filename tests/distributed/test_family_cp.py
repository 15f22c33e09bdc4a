"""Context parallelism (``parallel.cp``) scoring of the families beside Qwen3-MoE: per-token
log-probs of a cp 2 forward vs `rollout.scoring.compute_log_probs` in one process, fp32,
**bitwise** at the ``batch`` and ``exact`` levels, FP4 off and with NVFP4 MoEResQ experts in
``fp4_resq``, for DeepSeek-V3 (latent attention: the per-head non-rotary keys and values and the
shared rotary key part gathered, its own softmax scale and value dim) and GPT-OSS (sliding window
crossing the cp chunks, sinks, biases): the invariant attention (`fp4/invariant.py`) reads keys by
position with fixed reduction trees (the window and the sink included), which the gathered keys in
position order feed unchanged, and every other op computes a row on its own.

Training under cp (fp64, 1e-10 of the single process: cp2, cp2×ep2, cp2×tp2, cp2×pp2×ep2) is
in tests/distributed/test_family_layouts.py.
"""
import pytest
import torch

from tests.distributed.launch import run_distributed
from tests.distributed.test_cp_layouts import cp_token_log_probs
from tests.distributed.test_family_layouts import FAMILIES, family_cfg
from tests.numerics import single_thread

pytestmark = pytest.mark.distributed
LEVELS = ("batch", "exact", "fp4_batch", "fp4_exact")


def _level_cfg(family: str, level: str, cp: int):
    fp4 = level.startswith("fp4_")
    cfg = family_cfg(family, dict(cp=cp, fp4=fp4))
    cfg.dtype = "fp32"
    cfg.numerics.invariance = level.removeprefix("fp4_")
    if fp4:  # FP4 MoEResQ experts for scoring (FP4 training is refused with cp)
        cfg.fp4.scope, cfg.fp4.train_mode = "experts", "bf16"
    return cfg


def _score(rank, world_size):
    """cp 2 scoring of one micro-batch, each family at each level (a trainer built at the level)."""
    from megatron_fp4.parallel.dims import ParallelDims
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    out = {}
    for family in FAMILIES:
        for level in LEVELS:
            cfg = _level_cfg(family, level, 2)
            t = Trainer(cfg, ParallelMesh.from_dims(ParallelDims.from_config(cfg, world_size)))
            if level.startswith("fp4_"):
                t.model.set_fp4_mode("fp4_resq")
            out[family, level] = cp_token_log_probs(t)
            t.optimizer.remove_hooks()
    return out


@pytest.fixture(scope="module")
def scores():
    return run_distributed(_score, 2, timeout_s=900)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("level", LEVELS)
def test_cp_scoring_bitwise_single_process(scores, family, level):
    from megatron_fp4.rollout.scoring import compute_log_probs
    from megatron_fp4.training.trainer import Trainer

    tokens = scores[0][family, level][0]
    with single_thread(), torch.no_grad():
        t = Trainer(_level_cfg(family, level, 1), build_data=False)
        if level.startswith("fp4_"):
            t.model.set_fp4_mode("fp4_resq")
        t.model.eval()
        want = compute_log_probs(t.model, tokens, torch.ones_like(tokens)).log_probs
    for rank, res in enumerate(scores):
        got_tokens, got = res[family, level]
        assert torch.equal(got_tokens, tokens)
        assert got.shape == want.shape and got.dtype == want.dtype == torch.float32
        assert torch.equal(got, want), (family, level, rank, (got - want).abs().max())
        if level.startswith("fp4_"):  # FP4 really ran: not the unquantized experts' numbers
            assert not torch.equal(got, res[family, level.removeprefix("fp4_")][1])
