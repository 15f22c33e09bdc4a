"""GC-MoE inside the full trainer: pp2 × ep2 (4 processes) with ``expert_dispatcher="gcmoe"``, small
chunks (8 rows) and a 2-slot receive ring, against the single-process run and the same layout on
the all-to-all dispatcher.

Tolerances: against the single process, those of test_parallel_training_ep.py (float64, losses
and params within ``FP64_REL``; same layout, same reasons). Against the all-to-all layout: bitwise
losses and parameters, since GC-MoE's default compute="expert" gives every expert GEMM the same
batch and its backward is the baseline's exchange plus the same whole-batch expert forward.
"""
from tests.distributed.launch import run_distributed
from tests.distributed.test_parallel_training import STEPS, _reference, tiny_cfg
from tests.distributed.test_parallel_training_ep import SPEC
from tests.numerics import FP64_REL, rel

GCMOE = dict(expert_dispatcher="gcmoe", gcmoe_chunk_tokens=8, gcmoe_ring_slots=2)


def _run(rank, world_size):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    out = {}
    for name, extra in [("alltoall", {}), ("gcmoe", GCMOE)]:
        cfg = tiny_cfg(**SPEC, **extra)
        t = Trainer(cfg, ParallelMesh.build(2, 2, 2))
        losses = [t.train_step()["loss"] for _ in range(STEPS)]
        params = {}
        for moe in t.model.moe_layers():
            for pname in ("w13", "w2"):
                p = getattr(moe.experts, pname)
                full = [n for n, q in t.model.named_parameters() if q is p][0]
                params[full] = (moe.experts.expert_offset, p.detach().numpy().copy())
        for n, p in t.model.named_parameters():
            if not getattr(p, "is_expert", False):
                params[n] = (None, p.detach().numpy().copy())
        dispatchers = {type(m.dispatcher).__name__ for m in t.model.moe_layers()}
        stats = [(m.dispatcher.chunk_tokens, m.dispatcher.ring_slots, m.dispatcher.round, m.dispatcher.ring_high_water)
                 for m in t.model.moe_layers() if hasattr(m.dispatcher, "ring_slots")]
        out[name] = dict(losses=losses, params=params, dispatchers=dispatchers, stats=stats)
        t.optimizer.remove_hooks()
    return out


def test_pp2_ep2_gcmoe_matches_single_process_and_alltoall():
    results = run_distributed(_run, 4, timeout_s=600)
    ref_losses, ref_params, *_ = _reference(SPEC)
    seen = set()
    for rank, r in enumerate(results):
        gc, a2a = r["gcmoe"], r["alltoall"]
        assert gc["dispatchers"] == {"GCMoEDispatcher"} and a2a["dispatchers"] == {"AllToAllDispatcher"}
        # the config reached every layer's dispatcher, which ran (fwd per micro-batch) and used the ring
        assert gc["stats"] and all(c == 8 and s == 2 and rounds > 0 and 0 < hw <= 2
                                   for c, s, rounds, hw in gc["stats"]), gc["stats"]
        assert gc["losses"] == a2a["losses"], (rank, gc["losses"], a2a["losses"])
        for got, want in zip(gc["losses"], ref_losses):
            assert abs(got - want) <= FP64_REL * abs(want), (gc["losses"], ref_losses)
        for name, (off, value) in gc["params"].items():
            assert (value == a2a["params"][name][1]).all(), (rank, name)
            want = ref_params[name].detach()
            if off is not None:
                want = want[off:off + value.shape[0]]
            assert rel(value, want) <= FP64_REL, (name, rel(value, want))
            seen.add(name)
    assert seen == set(ref_params)
