"""Context parallelism (``parallel.cp``) for the families beside Qwen3-MoE matches the single process.

- DeepSeek-V3's latent attention (`model/deepseek_v3.py`): the per-head non-rotary keys and values
  and the one rotary key part all heads share (decoupled RoPE, rotated at each token's global
  position) are gathered over the cp group (`parallel/context.gather_kv`, one all-gather); the
  dense first layer, the shared expert, group-limited routing and aux-loss-free bias updates (the
  expert loads summed over dp × cp) run on the local tokens;
- GPT-OSS (`model/gpt_oss.py`): the sliding window (4 keys, crossing the cp chunks of 4 tokens)
  and the sinks masked by the queries' global positions, biases, YaRN.

**Training, float64** (the `test_family_layouts` check): cp 2, cp 2 × ep 2 (2 processes), cp 2 ×
tp 2 and cp 2 × pp 2 × ep 2 (4 processes): the losses of 2 AdamW steps, the first step's reduced
gradients and every parameter after the steps within ``FP64_REL`` = 1e-10 relative of the single
process (the K/V gather's backward and the loss shares only change fp64 summation orders).

**Scoring**: per-token log-probs of a cp 2 forward vs `rollout.scoring.compute_log_probs` in one
process, fp32, **bitwise** at the ``batch`` and ``exact`` levels (FP4 off and NVFP4 MoEResQ
experts): their attention reads keys by position with fixed reduction trees (the window and the
sink included), which the gathered keys in position order feed unchanged.
"""
import pytest
import torch

from tests.distributed.conftest import layout_results
from tests.distributed.launch import run_distributed
from tests.distributed.test_family_layouts import FAMILIES, _train, check_layout, family_cfg
from tests.numerics import single_thread

pytestmark = pytest.mark.distributed
LAYOUTS_2 = {f"{family}/{name}": (family, spec) for family in FAMILIES
             for name, spec in {"cp2": dict(cp=2), "cp2_ep2": dict(cp=2, ep=2)}.items()}
LAYOUTS_4 = {f"{family}/{name}": (family, spec) for family in FAMILIES
             for name, spec in {"cp2_tp2": dict(cp=2, tp=2), "cp2_pp2_ep2": dict(cp=2, pp=2, ep=2)}.items()}
LEVELS = ("batch", "exact", "fp4_batch", "fp4_exact")


def _trainer(world_size, cfg):
    from megatron_fp4.parallel.dims import ParallelDims
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    return Trainer(cfg, ParallelMesh.from_dims(ParallelDims.from_config(cfg, world_size)))


def _run(rank, world_size, layouts):
    out = {}
    for name, (family, spec) in layouts.items():
        t = _trainer(world_size, family_cfg(family, spec))
        assert t.cp_plan is not None and t.cp_plan.size == 2
        out[name] = _train(t)
    return out


results_2 = layout_results(_run, 2, LAYOUTS_2, timeout_s=900)
results_4 = layout_results(_run, 4, LAYOUTS_4, timeout_s=900)


@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_cp_layout_matches_single_process(results_2, name):
    check_layout(name, *LAYOUTS_2[name], results_2)


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_cp_layout_4_matches_single_process(results_4, name):
    check_layout(name, *LAYOUTS_4[name], results_4)


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
    from megatron_fp4.parallel import context
    from megatron_fp4.rollout.logprobs import log_softmax_rows

    out = {}
    for family in FAMILIES:
        for level in LEVELS:
            t = _trainer(world_size, _level_cfg(family, level, 2))
            if level.startswith("fp4_"):
                t.model.set_fp4_mode("fp4_resq")
            t.model.eval()
            tokens = t.next_micro_batches()[0]["tokens"]
            with torch.no_grad():
                positions = torch.arange(tokens.shape[1]).expand(tokens.shape)
                logits = t.model(context.split_sequence(tokens, t.cp_plan),
                                 context.split_sequence(positions, t.cp_plan)).logits
                rows = log_softmax_rows(logits, t.model.numerics)
                out[family, level] = (tokens, context.token_log_probs(rows, tokens, t.cp_plan))
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
    cfg = _level_cfg(family, level, 1)
    with single_thread(), torch.no_grad():
        t = Trainer(cfg, build_data=False)
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
