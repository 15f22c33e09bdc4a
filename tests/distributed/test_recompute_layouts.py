"""Activation recomputation on the parallel layouts: pp2 interleaved 1F1B, pp2 ZB-V (zero-bubble:
input-grad and weight-grad passes, each recomputing) and ep2 with the all-to-all and the GC-MoE
dispatchers (with ``moe`` selected, or full, the recompute repeats the dispatch) give every rank
the gradients of recompute=none on the same layout bit for bit (2 gloo processes). FP4 MoEResQ on experts and attention, stochastic rounding of
the gradients, fp32: the same kernels on the same inputs, so bitwise holds by construction.
"""
from __future__ import annotations

from megatron_fp4.config import Config
from tests.distributed.launch import run_distributed

LAYOUTS = {
    "pp2_interleaved": dict(pp=2, virtual_stages=2, schedule="interleaved_1f1b"),
    "pp2_zbv": dict(pp=2, virtual_stages=2, schedule="zbv"),
    "ep2": dict(ep=2),
    "ep2_gcmoe": dict(ep=2, expert_dispatcher="gcmoe", gcmoe_chunk_tokens=8, gcmoe_ring_slots=2),
}
MODES = {"full": dict(recompute="full"), "selective": dict(recompute="selective")}
EP_MODES = {"selective_moe": dict(recompute="selective", recompute_modules=["moe", "attention"])}


def layout_cfg(parallel: dict, model: dict) -> Config:
    cfg = Config()
    s = cfg.schedule
    s.global_batch_size, s.micro_batch_size, s.seq_len, s.train_steps, s.warmup_steps = 8, 2, 16, 1, 0
    cfg.data.num_samples = 40
    cfg.logging.tensorboard_dir, cfg.logging.progress = None, False
    cfg.fp4.scope, cfg.fp4.grad_rounding = "experts+attention", "stochastic"
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    for key, value in model.items():
        setattr(cfg.model, key, value)
    return cfg


def _grads(rank, world_size):
    import megatron_fp4.model.recompute as recompute
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer
    from megatron_fp4.training.trainer import lm_loss_fn

    regions, original = [0], recompute.checkpoint

    def counting(*args, **kwargs):
        regions[0] += 1
        return original(*args, **kwargs)
    recompute.checkpoint = counting
    out = {}
    try:
        for layout, parallel in LAYOUTS.items():
            modes = {"none": {}, **MODES, **(EP_MODES if parallel.get("ep", 1) > 1 else {})}
            for mode, model in modes.items():
                cfg = layout_cfg(parallel, model)
                pp = cfg.parallel.pp
                trainer = Trainer(cfg, ParallelMesh.build(pp, world_size // pp, cfg.parallel.ep))
                trainer.model.train()
                trainer.optimizer.zero_grad()
                regions[0] = 0
                trainer.forward_backward(trainer.next_micro_batches(), lm_loss_fn)
                trainer.optimizer.finish_grad_sync()
                out[layout, mode] = ({n: p.grad.clone() for n, p in trainer.model.named_parameters()}, regions[0])
                trainer.optimizer.remove_hooks()
    finally:
        recompute.checkpoint = original
    return out


def test_recompute_gives_the_gradients_of_none_on_every_layout():
    per_rank = run_distributed(_grads, 2, timeout_s=900)
    for rank, results in enumerate(per_rank):
        for (layout, mode), (grads, regions) in results.items():
            ref, ref_regions = results[layout, "none"]
            assert ref_regions == 0
            if mode == "none":
                continue
            assert regions > 0, (layout, mode, rank)  # the recompute ran here
            assert grads.keys() == ref.keys()
            unequal = [n for n in grads if not (grads[n] is not None and ref[n] is not None
                                                and grads[n].equal(ref[n]))]
            assert not unequal, f"{layout} {mode} rank {rank}: gradients differ from recompute=none in {unequal}"
