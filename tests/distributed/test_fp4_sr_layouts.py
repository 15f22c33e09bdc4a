"""FP4 stochastic rounding draws the same streams on pp2 (ZB1P) and dp2 as in one process.

Every stream is seeded by ``sr_seed(recipe seed, layer, step, micro-batch, operand)``; each
process records the keys it seeds (a spy on ``sr_seed``), and the union over the ranks of a layout
must equal the single-process set. Attention projections are compared (FP4 scope
``experts+attention``): they run on every token, whereas which experts get tokens can differ
between layouts (FP4 makes pp not bitwise, see test_parallel_training.py), so expert keys are
only checked to be well formed.
"""
from __future__ import annotations

from megatron_fp4.config import Config
from tests.distributed.launch import run_distributed

STEPS = 2


def sr_cfg(**parallel) -> Config:
    cfg = Config()
    s = cfg.schedule
    s.global_batch_size, s.micro_batch_size, s.seq_len, s.train_steps, s.warmup_steps = 8, 2, 16, STEPS, 1
    cfg.model.num_layers = 4
    cfg.data.num_samples = 100
    cfg.logging.tensorboard_dir, cfg.logging.progress = None, False
    cfg.fp4.scope, cfg.fp4.grad_rounding = "experts+attention", "stochastic"
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


LAYOUTS = {"pp2_zero_bubble": dict(pp=2, virtual_stages=2, schedule="interleaved_zero_bubble"), "dp2": {}}


def _record(make_trainer) -> set:
    import megatron_fp4.fp4.moeresq as moeresq

    seen, original = set(), moeresq.sr_seed
    moeresq.sr_seed = lambda *key: seen.add(key) or original(*key)
    try:
        trainer = make_trainer()
        for _ in range(STEPS):
            trainer.train_step()
    finally:
        moeresq.sr_seed = original
    return seen


def _layouts(rank, world_size):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    out = {}
    for name, spec in LAYOUTS.items():
        cfg = sr_cfg(**spec)
        mesh = ParallelMesh.build(cfg.parallel.pp, world_size // cfg.parallel.pp, 1)
        out[name] = _record(lambda: Trainer(cfg, mesh))
    return out


def attention(keys: set) -> set:
    return {k for k in keys if ".self_attn." in k[1]}


def test_pp2_and_dp2_draw_the_single_process_streams():
    from megatron_fp4.training.trainer import Trainer

    single = _record(lambda: Trainer(sr_cfg()))
    assert {k[2] for k in single} == set(range(STEPS)) and {k[3] for k in single} == set(range(4))
    per_rank = run_distributed(_layouts, 2, timeout_s=600)
    for name in LAYOUTS:
        union = per_rank[0][name] | per_rank[1][name]
        assert attention(union) == attention(single), name
        assert {k[2:4] for k in union} == {k[2:4] for k in single}, name
        assert all(k[1].startswith("layers.") for k in union), name  # global names on every rank
    # pp splits the layers, dp the micro-batches: each rank draws only its share
    assert attention(per_rank[0]["pp2_zero_bubble"]) != attention(single)
    assert {k[3] for k in per_rank[1]["dp2"]} == {2, 3}
