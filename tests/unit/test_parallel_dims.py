"""`ParallelDims`: every layout check in one `validate()` (no processes), and its pure groups.

Each case is a layout that used to be refused in one of the seven places the checks lived
(config_validate, the trainer, the mesh, the pipeline split / V placement / runner, the expert
placement, the GC-MoE dispatchers), or not at all before a process group existed (GC-MoE's ring
against ep, the SM split, virtual stages without a pipeline): one ConfigError naming the field.
"""
import pytest
import torch
from torch import nn

from megatron_fp4.config import Config, ConfigError
from megatron_fp4.parallel.dims import ParallelDims, resolve_dp
from megatron_fp4.parallel.mesh import ParallelMesh


def cfg_with(**fields) -> Config:
    cfg = Config()
    for dotted, value in fields.items():
        section, name = dotted.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def refused(cfg: Config, world: int) -> str:
    with pytest.raises(ConfigError) as err:
        ParallelDims.from_config(cfg, world)
    return str(err.value)


# (config fields, world size, the message's start, words it must hold)
BAD_LAYOUTS = [
    (dict(parallel__tp=2), 1, "parallel.tp=2", "needs several processes"),
    (dict(parallel__tp=2, model__num_heads=3), 2, "model.num_heads=3", "multiple of parallel.tp=2"),
    (dict(parallel__etp=2), 2, "parallel.etp=2", "with the etp group = the tp group: set etp=1 or etp=parallel.tp=1"),
    (dict(parallel__pp=0), 1, "parallel.pp=0", "must be >= 1"),
    (dict(parallel__ep=0), 1, "parallel.ep=0", "must be >= 1"),
    (dict(parallel__dp=0), 1, "parallel.dp=0", "-1 to infer it"),
    (dict(parallel__pp=2), 1, "parallel.pp=2, parallel.ep=1", "need several processes: launch with torchrun"),
    (dict(parallel__ep=2), 1, "parallel.pp=1, parallel.ep=2", "need several processes"),
    (dict(parallel__pp=3), 4, "parallel.pp=3", "world size 4 is not divisible by pp×tp=3"),
    (dict(parallel__dp=3), 4, "parallel.dp=3", "dp×pp×tp = 3×1×1 must equal the world size 4"),
    (dict(parallel__pp=2, parallel__ep=4), 4, "parallel.ep=4", "ep must divide dp=2"),
    (dict(parallel__ep=3, model__num_experts=8), 3, "parallel.ep=3", "num_experts=8 is not divisible by parallel.ep=3"),
    (dict(parallel__pp=2, parallel__virtual_stages=4, parallel__schedule="interleaved_1f1b"), 2,
     "parallel.virtual_stages=4", "8 model chunks but only model.num_layers=4"),
    (dict(schedule__global_batch_size=10), 4, "schedule.global_batch_size=10", "micro_batch_size×dp = 4×4"),
    (dict(parallel__pp=2, schedule__global_batch_size=8), 4, "schedule.global_batch_size=8",
     "schedule 1f1b needs at least pp=2 micro-batches per step, got 1"),
    (dict(parallel__pp=2, parallel__schedule="interleaved_zero_bubble"), 2, "parallel.virtual_stages=1",
     "virtual_stages >= 2"),
    (dict(parallel__pp=2, parallel__virtual_stages=2, parallel__schedule="interleaved_1f1b",
          schedule__micro_batch_size=16), 2, "schedule.global_batch_size=16", "multiple of pp=2"),
    (dict(parallel__pp=2, parallel__virtual_stages=3, parallel__schedule="zbv", model__num_layers=6), 2,
     "parallel.virtual_stages=3", "exactly 2 model chunks per pipeline rank"),
    (dict(parallel__pp=2, parallel__virtual_stages=2), 2, "parallel.schedule='1f1b'", "multi-chunk schedule"),
    (dict(parallel__virtual_stages=2, parallel__schedule="interleaved_1f1b"), 2, "parallel.virtual_stages=2",
     "needs parallel.pp > 1"),
    (dict(parallel__ep=4, parallel__expert_dispatcher="gcmoe", parallel__gcmoe_ring_slots=2), 4,
     "parallel.gcmoe_ring_slots=2", ">= max(1, parallel.ep - 1) = 3"),
    (dict(parallel__gcmoe_chunk_tokens=0), 1, "parallel.gcmoe_chunk_tokens=0", "must be >= 1"),
    (dict(parallel__gcmoe_ring_slots=0), 1, "parallel.gcmoe_ring_slots=0", "must be >= max(1"),
    (dict(parallel__gcmoe_transfer_sms=-1), 1, "parallel.gcmoe_transfer_sms=-1", "must be >= 0"),
]


@pytest.mark.parametrize("fields, world, start, words", BAD_LAYOUTS)
def test_every_bad_layout_is_one_clear_error(fields, world, start, words):
    msg = refused(cfg_with(**fields), world)
    assert msg.startswith(start) and words in msg and "\n" not in msg, msg


def test_good_layouts_resolve_dp():
    assert ParallelDims.from_config(Config(), 1) == ParallelDims()  # one process: all ones
    assert ParallelDims.from_config(cfg_with(parallel__pp=2, parallel__ep=2, schedule__global_batch_size=32), 8) == ParallelDims(8, 2, 4, 1, 2, 1)
    assert resolve_dp(cfg_with(parallel__pp=2), 8) == 4 and resolve_dp(cfg_with(parallel__dp=4), 4) == 4
    gcmoe = cfg_with(parallel__ep=4, parallel__expert_dispatcher="gcmoe", parallel__gcmoe_ring_slots=3)
    assert ParallelDims.from_config(gcmoe, 4).ep == 4
    zb = cfg_with(parallel__pp=2, parallel__virtual_stages=2, parallel__schedule="zbv")
    assert ParallelDims.from_config(zb, 4).dp == 2


def test_the_pieces_call_the_same_checks():
    """The pipeline split, the V placement, the runner, the expert placement and the GC-MoE
    dispatchers refuse bad arguments with the layout's message (they call `dims` checks)."""
    from megatron_fp4.parallel.moe.expert_parallel import apply_expert_parallel, expert_placement
    from megatron_fp4.parallel.moe.gcmoe import GCMoEDispatcher
    from megatron_fp4.parallel.moe.gcmoe_decode import GCMoEDecodeDispatcher
    from megatron_fp4.parallel.pipeline import PipelineRunner, rank_chunks, split_layers

    cases = [
        (lambda: split_layers(3, 2, 2), "parallel.virtual_stages=2: pp×virtual_stages=4 model chunks"),
        (lambda: split_layers(4, 0, 1), "parallel.pp=0"),
        (lambda: rank_chunks(0, 2, 3, "v"), "parallel.virtual_stages=3: schedule zbv places exactly 2"),
        (lambda: PipelineRunner(nn.Module(), ParallelMesh(ParallelDims(world_size=2, pp=2)), "1f1b", 2),
         "parallel.schedule='1f1b': virtual_stages=2 needs a multi-chunk schedule"),
        (lambda: expert_placement(8, 3), "parallel.ep=3: model.num_experts=8 is not divisible"),
        (lambda: GCMoEDispatcher(None, 4, 8, channel=None, ring_slots=2), "parallel.gcmoe_ring_slots=2 must be"),
        (lambda: GCMoEDecodeDispatcher(None, 3, 8, 0, [0, 1, 2], None), "parallel.ep=3: model.num_experts=8"),
        (lambda: apply_expert_parallel(nn.Module(), ParallelMesh(), transfer_sms=-1), "parallel.gcmoe_transfer_sms=-1"),
    ]
    for call, start in cases:
        with pytest.raises(ConfigError) as err:
            call()
        assert str(err.value).startswith(start), str(err.value)


def test_trainer_refuses_a_mesh_of_another_layout():
    from megatron_fp4.training.trainer import Trainer

    mesh = ParallelMesh(ParallelDims(world_size=2, dp=2, ep=2))  # the config says ep=1
    with pytest.raises(ConfigError, match="the mesh passed to the Trainer has .*ep=2.* cfg.parallel gives .*ep=1"):
        Trainer(Config(), mesh, build_data=False)


def old_layout_groups(pp, dp, ep):
    """The group lists of the mesh before DeviceMesh, written out independently (tp = 1): rank
    ``pp_rank·dp + dp_rank``; ep groups: consecutive dp ranks of a stage; edp: stride ep."""
    stage = lambda p: [p * dp + d for d in range(dp)]  # noqa: E731
    return {
        "pp": [[p * dp + d for p in range(pp)] for d in range(dp)],
        "dp": [stage(p) for p in range(pp)],
        "ep": [stage(p)[i:i + ep] for p in range(pp) for i in range(0, dp, ep)],
        "edp": [stage(p)[e::ep] for p in range(pp) for e in range(ep)],
        "embed": [stage(0) + stage(pp - 1)] if pp > 1 else [],
        "world": [list(range(pp * dp))],
    }


@pytest.mark.parametrize("pp, dp, ep", [(1, 1, 1), (1, 8, 4), (2, 4, 2), (4, 2, 2), (2, 2, 1), (3, 4, 4)])
def test_groups_and_coords_match_the_old_layout(pp, dp, ep):
    dims = ParallelDims(pp * dp, pp, dp, 1, ep, 1).validate()
    for axis, want in old_layout_groups(pp, dp, ep).items():
        assert sorted(dims.groups(axis)) == sorted(want), axis
    assert dims.groups("tp") == [[r] for r in range(pp * dp)] and dims.groups("etp") == dims.groups("tp")
    for rank in range(pp * dp):
        c = dims.coords(rank)
        assert (c["pp"], c["dp"], c["tp"]) == (rank // dp, rank % dp, 0)
        assert (c["ep"], c["edp"], c["etp"]) == (rank % dp % ep, rank % dp // ep, 0)
        for axis in ("pp", "dp", "ep", "edp"):
            assert dims.group_of(axis, rank).index(rank) == c[axis]  # the coordinate is the rank in its group


def test_single_process_mesh_is_all_ones():
    mesh = ParallelMesh.single()
    assert mesh.dims == ParallelDims() and mesh.size("edp") == 1 and not mesh.groups
    assert {axis: mesh.coord(axis) for axis in ("pp", "dp", "tp", "ep", "edp", "etp")} == dict.fromkeys(
        ("pp", "dp", "tp", "ep", "edp", "etp"), 0)
    assert mesh.device == torch.device("cpu")


@pytest.mark.parametrize("fields, needles", [
    ({"model__num_kv_heads": 1}, ("parallel.tp=2 cannot cut", "model.num_kv_heads=1 >= tp")),
    ({"model__num_heads": 4, "model__head_dim": 8, "model__num_kv_heads": 2},
     ("parallel.tp=2 cannot cut", "self_attn.k_proj", "8 output features per rank", "block (16)")),
])
def test_fp4_attention_the_tp_ranks_cannot_split_is_refused_before_any_group(fields, needles):
    """Issue 36: these used to pass validation and end in a ValueError traceback from
    `parallelize_tp` on every rank, after the process groups were made."""
    cfg = cfg_with(fp4__scope="experts+attention", parallel__tp=2, **fields)
    message = refused(cfg, 2)
    assert all(n in message for n in needles), message
    cfg.fp4.scope = "experts"  # the same model with FP4 experts only splits
    assert ParallelDims.from_config(cfg, 2).tp == 2


def test_cli_refuses_an_fp4_attention_tp_layout_in_one_line():
    import os
    import subprocess
    import sys

    from tests.faults.test_bad_input_config import REPO, SMALL, _assert_one_line

    env = {**os.environ, "PYTHONPATH": str(REPO), "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    proc = subprocess.run([sys.executable, "-m", "megatron_fp4.train", *SMALL, "--set", "parallel.tp=2", "--set",
                           "fp4.scope=experts+attention", "--set", "model.num_kv_heads=1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    _assert_one_line(proc, "config error", "parallel.tp=2 cannot cut", "model.num_kv_heads=1 >= tp")
