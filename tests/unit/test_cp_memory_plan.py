"""The memory planner under context parallel (``parallel.cp``) against the saved tensors of one
forward (the method of tests/unit/test_memory_plan.py). One process emulates a cp rank: the model
reads 1/cp of the sequence and its attention's `kv_gather` returns K/V of the whole length (the
gathered keys' values do not change what autograd saves; the real gather, `context.gather_kv`,
saves nothing but its index, one tensor per sequence length held by the plan, not an activation)."""
import pytest
import torch

from megatron_fp4.config import default_config_path, load_config
from megatron_fp4.model.layers import Attention
from megatron_fp4.model.transformer import lm_loss
from megatron_fp4.training.memory_plan import chunk_activation_bytes, local_meta_model, plan_memory
from tests.unit.test_memory_plan import TINY, _saved_bytes


def _emulate_cp(cp):
    def gather(k, v):  # k, v [B, KV, T/cp, D] -> [B, KV, T, D]
        pad = [k.new_zeros(k.shape)] * (cp - 1)
        return torch.cat([k, *pad], dim=2), torch.cat([v, *pad], dim=2)

    def cut(model):
        for m in model.modules():
            if isinstance(m, Attention):
                m.kv_gather = gather
        return lm_loss
    return cut


@pytest.mark.parametrize("cp, extra", [(2, []), (4, ["model.num_kv_heads=1", "dtype=bf16"]),
                                       (2, ["numerics.invariance=batch", "schedule.seq_len=40"]),
                                       (4, ["numerics.invariance=batch", "dtype=bf16", "model.num_kv_heads=1"])])
def test_cp_activation_bytes_match_saved_tensors(cp, extra):
    """The standard level and the ``batch`` level (the trainer's default: the block attention on
    the gathered K/V, the level's kernels applied as the trainer does; partial row tiles)."""
    from megatron_fp4.fp4 import apply_numerics
    from megatron_fp4.model.specs import numerics_from_config

    overrides = TINY + ["fp4.scope=none", "fp4.train_mode=bf16", f"parallel.cp={cp}"] + extra
    cfg = load_config(default_config_path(), overrides)
    s, m = cfg.schedule, cfg.model
    local = torch.randint(0, m.vocab_size, (s.micro_batch_size, s.seq_len // cp),
                          generator=torch.Generator().manual_seed(1))
    measured, _ = _saved_bytes(cfg, local, _emulate_cp(cp), numerics=numerics_from_config(cfg, "train"),
                               apply=apply_numerics)
    planned = chunk_activation_bytes(cfg, local_meta_model(cfg, 0, 0), range(m.num_layers), True, True,
                                     s.micro_batch_size, s.seq_len)
    assert planned == measured, (planned, measured)


def test_cp_plan_divides_activations_not_state():
    base = TINY + ["fp4.scope=none", "fp4.train_mode=bf16", "schedule.seq_len=128"]
    one = plan_memory(load_config(default_config_path(), base), 2)[0]  # dp 2
    cp2 = plan_memory(load_config(default_config_path(), base + ["parallel.cp=2"]), 2)[0]  # dp 1 × cp 2
    # the same ranks hold the same parameters (ZeRO shards over dp × cp): the same state bytes
    assert (cp2.params, cp2.grads, cp2.masters, cp2.moments) == (one.params, one.grads, one.masters, one.moments)
    # dp 2: 2 micro-batches per rank, each of the whole sequence; cp 2: 4 of half of it, 1 in flight
    assert cp2.activations < one.activations and cp2.head_transient * 2 == one.head_transient
