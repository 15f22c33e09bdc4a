"""The memory planner (megatron_fp4/training/memory_plan.py, tools/memory_plan.py) against the real thing.

- parameters, gradients and optimizer state: the planner's bytes equal the bytes of the tensors a
  real `Trainer` holds after one step (sum of numel × element_size per rank), exactly: one process
  and gloo meshes at pp2, ep2 and dp2 with ZeRO 0/1/2 (`ZeroAdamW` at every size);
- activations: the planner's bytes per micro-batch against the unique storages autograd saves in
  one forward (``torch.autograd.graph.saved_tensors_hooks``) that are still alive when the loss is
  formed (what backward holds). Derived bound: the planner counts
  ``Q(W)`` of every local FP4 expert, an expert that receives no token saves none, so
  ``planned - measured`` lies in [0, Q(W) bytes of the experts the router left empty]; every other
  term is an exact count of the forward's saved tensors.
"""
import json
import weakref

import pytest
import torch

from megatron_fp4.config import default_config_path, load_config
from megatron_fp4.model import build_model
from megatron_fp4.model.packing import segment_positions
from megatron_fp4.model.transformer import lm_loss
from megatron_fp4.training.memory_activations import packed_attention_bytes
from megatron_fp4.training.memory_plan import (chunk_activation_bytes, fp4_weight_bytes, inflight_microbatches,
                                               local_meta_model, param_dtype, plan_memory)
from tests.distributed.launch import run_distributed
from tools import memory_plan as cli

# The standard numerics level: `build_model` (the saved-tensor measurements below) builds with the
# standard kernels; the batch level's block attention is checked in test_memory_plan_families_activations.py.
TINY = ["schedule.global_batch_size=8", "schedule.micro_batch_size=2", "schedule.seq_len=32",
        "logging.tensorboard_dir=null", "checkpoint.dir=null", "logging.progress=false", "device=cpu",
        "numerics.invariance=standard"]


def _saved_bytes(cfg, tokens, cut=None, attention_mask=None, numerics=None, apply=None):
    """Unique non-parameter storages autograd saves in one training forward + loss, and the routing.
    ``cut(model)``: cuts the model in place (tensor parallel) and returns its loss function;
    ``attention_mask``: packed rows (`model/packing.py`), positions restarting per sequence;
    ``numerics``: a level applied by ``apply`` (default: `build_model`'s standard kernels)."""
    torch.manual_seed(0)
    model = build_model(cfg)
    loss_fn = cut(model) if cut is not None else lm_loss
    model.to(param_dtype(cfg))
    model.set_fp4_mode(cfg.fp4.train_mode)
    if numerics is not None:  # a numerics level as the trainer's (``apply``: fp4.apply_numerics)
        apply(model, numerics)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    packed = []  # weak references: a graph branch nothing keeps (aux losses with coefficients 0) frees its tensors

    def pack(t):
        alias = t.detach()  # held by the graph alone (a saved output returned as itself would hold its
        packed.append(weakref.ref(alias))  # own grad_fn: a cycle that keeps a dropped branch alive)
        return alias

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        positions = None if attention_mask is None else segment_positions(attention_mask)
        out = model(tokens, positions, attention_mask, return_routing=True)
        loss = loss_fn(out.logits, tokens)
    routing = out.routing
    del out
    live = {}  # storages still held by the graph of `loss`, each once
    for ref in packed:
        t = ref()
        if t is not None and t.untyped_storage().data_ptr() not in params:
            live[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert loss.requires_grad
    return sum(live.values()), routing


@pytest.mark.parametrize("extra", [
    [], ["model.dense_layers=[0]", "model.num_shared_experts=1"],
    ["model.num_kv_heads=1", "fp4.scope=experts+attention"], ["fp4.scope=none"], ["dtype=bf16"],
    ["dtype=bf16", "fp4.scope=none", "model.dense_layers=[1]", "model.num_shared_experts=2"], ["dtype=fp64"],
    ["model.router_aux_loss_coef=0", "model.router_z_loss_coef=0", "model.top_k=3"],
])
def test_activation_bytes_match_saved_tensors(extra):
    planned, measured, slack = plan_and_saved(load_config(default_config_path(), TINY + extra))
    assert 0 <= planned - measured <= slack, (planned, measured, slack)


def plan_and_saved(cfg, numerics=None, apply=None) -> tuple:
    """(planned, measured, slack) of one micro-batch through the whole model of `cfg`: the plan's
    activations and Q(W), what autograd saves (`_saved_bytes`), and the Q(W) bytes of the experts
    the router left empty (the derived bound of the module docstring)."""
    s, m = cfg.schedule, cfg.model
    tokens = torch.randint(0, m.vocab_size, (s.micro_batch_size, s.seq_len), generator=torch.Generator().manual_seed(1))
    measured, routing = _saved_bytes(cfg, tokens, numerics=numerics, apply=apply)
    meta = local_meta_model(cfg, 0, 0)
    planned = chunk_activation_bytes(cfg, meta, range(m.num_layers), True, True, s.micro_batch_size, s.seq_len)
    planned += fp4_weight_bytes(meta)
    per_expert_qw = (3 * m.moe_ffn_hidden_size * m.hidden_size * 4) if cfg.fp4.scope != "none" else 0
    empty = sum(m.num_experts - len(torch.unique(r)) for r in routing if r is not None)
    return planned, measured, empty * per_expert_qw


@pytest.mark.parametrize("level, lengths, extra", [("standard", [100, 60, 40, 30, 26], []),
                                                   ("batch", [100, 60, 40, 30, 26], []),
                                                   ("batch", [65, 64, 63, 33, 1, 30], ["dtype=bf16"])])
def test_packed_micro_batch_activation_bytes_bound_saved_tensors(level, lengths, extra):
    """A packed micro-batch (``rl.max_tokens_per_micro_batch``): the plan of one row of the budget's
    tokens, plus `packed_attention_bytes` per layer (the unpacked rows' padding, bounded by the
    tokens; at the ``batch`` level the block attention's per-slot tensors, repack's saved source and
    the index tensors), is at least what autograd saves and at most that plus the bound and the
    empty experts' Q(W). The ``batch`` level runs its kernels as the trainer does."""
    from megatron_fp4.fp4 import apply_numerics
    from megatron_fp4.model.specs import numerics_from_config

    cfg = load_config(default_config_path(), TINY + ["rl.max_tokens_per_micro_batch=256",
                                                     f"numerics.invariance={level}"] + extra)
    m = cfg.model
    mask = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)]).unsqueeze(0)
    tokens = torch.randint(0, m.vocab_size, (1, 256), generator=torch.Generator().manual_seed(2))
    measured, routing = _saved_bytes(cfg, tokens, attention_mask=mask, numerics=numerics_from_config(cfg, "train"),
                                     apply=apply_numerics)
    meta = local_meta_model(cfg, 0, 0)
    planned = chunk_activation_bytes(cfg, meta, range(m.num_layers), True, True, 1, 256, packed=True)
    planned += fp4_weight_bytes(meta)
    per_expert_qw = 3 * m.moe_ffn_hidden_size * m.hidden_size * 4
    empty = sum(m.num_experts - len(torch.unique(r)) for r in routing if r is not None)
    slack = m.num_layers * packed_attention_bytes(cfg, 256) + empty * per_expert_qw
    assert 0 <= planned - measured <= slack, (planned, measured, slack)
    plan = plan_memory(cfg, 1)[0]  # the planner takes the packed micro-batch: it holds more tokens than 2 × 32
    assert plan.activations == chunk_activation_bytes(cfg, meta, range(m.num_layers), True, True, 1, 256, packed=True)


def _real_state_bytes(trainer) -> dict:
    """Bytes of the tensors the trainer's optimizer and model hold (each storage once)."""
    opt = trainer.optimizer
    out = dict(params=0, grads=0, masters=0, moments=0, steps=0)
    for o in opt.optimizers:
        for st in o.state.values():
            out["moments"] += sum(st[k].numel() * st[k].element_size() for k in ("exp_avg", "exp_avg_sq"))
            out["steps"] += st["step"].numel() * st["step"].element_size()
    for buf, master, shard in zip(opt.buffers, opt.masters, opt.grad_shards):  # params, grads: buffer views
        out["params"] += buf.data.numel() * buf.data.element_size()
        out["grads"] += buf.grad.numel() * buf.grad.element_size()
        out["grads"] += 0 if shard is None else shard.numel() * shard.element_size()
        shares = master.data_ptr() == buf.data.data_ptr()
        out["masters"] += 0 if shares else master.numel() * master.element_size()
    out["param_numel"] = sum(p.numel() for p in trainer.model.parameters())
    return out


def _one_step(trainer):
    s = trainer.cfg.schedule
    gen = torch.Generator().manual_seed(trainer.mesh.coord("dp"))
    mbs = [{"tokens": t, "labels": t} for t in
           torch.randint(0, trainer.cfg.model.vocab_size, (trainer.num_microbatches, s.micro_batch_size, s.seq_len),
                         generator=gen)]
    trainer.train_step_with_loss(mbs)


def _rank_state(rank, world, overrides):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    cfg = load_config(default_config_path(), TINY + overrides)
    p = cfg.parallel
    trainer = Trainer(cfg, ParallelMesh.build(p.pp, world // p.pp, p.ep, device=torch.device("cpu")), build_data=False)
    _one_step(trainer)
    return trainer.mesh.coord("pp"), _real_state_bytes(trainer)


def _planned(plan) -> dict:
    out = {k: getattr(plan, k) for k in ("params", "grads", "masters", "moments", "steps")}
    out["param_numel"] = plan.param_numel
    return out


def test_state_bytes_single_process_exact():
    from megatron_fp4.training.trainer import Trainer

    for extra in ([], ["dtype=bf16"]):
        cfg = load_config(default_config_path(), TINY + extra)
        trainer = Trainer(cfg, build_data=False)
        _one_step(trainer)
        assert _planned(plan_memory(cfg, 1)[0]) == _real_state_bytes(trainer)


@pytest.mark.distributed
@pytest.mark.parametrize("overrides", [
    ["parallel.pp=2", "model.tie_embeddings=true"], ["parallel.ep=2", "parallel.zero_stage=2"],
    ["parallel.zero_stage=0", "parallel.bucket_size_mb=0.01"], ["parallel.zero_stage=2", "dtype=bf16"],
])
def test_state_bytes_zero_exact(overrides):
    cfg = load_config(default_config_path(), TINY + overrides)
    plans = plan_memory(cfg, 2)
    for pp_rank, real in run_distributed(_rank_state, 2, args=(overrides,)):
        assert _planned(plans[pp_rank]) == real, (pp_rank, overrides)


def test_inflight_microbatches():
    assert inflight_microbatches("1f1b", 4, 0, 1, 8) == [4] and inflight_microbatches("1f1b", 4, 3, 1, 8) == [1]
    assert inflight_microbatches("1f1b", 4, 0, 1, 2) == [2]
    assert inflight_microbatches("gpipe", 2, 1, 1, 6) == [6]
    # Megatron's interleaved rank 0 holds pp·(1 + (pp−1)/(pp·v)) micro-batches' worth of its layers:
    # v·pp + pp − 1 chunk micro-batches.
    for pp, v in ((2, 2), (4, 2), (4, 3)):
        assert sum(inflight_microbatches("interleaved_1f1b", pp, 0, v, 64)) == v * pp + pp - 1
        assert sum(inflight_microbatches("interleaved_1f1b", pp, pp - 1, v, 64)) == (v - 1) * pp + 1


@pytest.mark.parametrize("args, words", [
    (["--world-size", "4", "--set", "parallel.ep=3"], "parallel.ep=3"),
    (["--world-size", "3", "--set", "parallel.tp=3"], "model.num_heads=4"),
    (["--world-size", "2", "--set", "parallel.etp=2"], "parallel.etp"),
    (["--world-size", "8", "--set", "parallel.pp=8"], "model.num_layers=4"),
    (["--world-size", "4", "--set", "parallel.pp=2", "parallel.virtual_stages=2", "parallel.schedule=zbv"], "zbv"),
    (["--world-size", "2", "--set", "parallel.pp=2", "parallel.virtual_stages=2"], "multi-chunk schedule"),
])
def test_cli_bad_layout_is_one_line_exit_2(args, words, capsys):
    assert cli.main([str(default_config_path())] + args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err


def test_cli_json_matches_plan(capsys):
    assert cli.main([str(default_config_path()), "--world-size", "4", "--set", "parallel.pp=2", "parallel.ep=2",
                     "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    plans = plan_memory(load_config(default_config_path(), ["parallel.pp=2", "parallel.ep=2"]), 4)
    assert [(r["first_rank"], r["last_rank"]) for r in rows] == [(0, 1), (2, 3)]
    assert [r["total"] for r in rows] == [p.total for p in plans]


def test_cli_markdown_rows_match_plan(capsys):
    """``--format markdown`` (docs/memory.md's rows): one row per stage, the label on the first, GB
    to 2 decimals of the plan's bytes, "fits" each ``--gpu-gb`` size by the total; a bad size: one line, exit 2."""
    assert cli.main([str(default_config_path()), "--world-size", "4", "--set", "parallel.pp=2", "parallel.ep=2",
                     "--format", "markdown", "--label", "4: pp2 × ep2", "--gpu-gb", "1e-9,1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    plans = plan_memory(load_config(default_config_path(), ["parallel.pp=2", "parallel.ep=2"]), 4)
    assert lines[0].endswith("| total | fits 1e-09 GB | fits 1 GB |") and len(lines) == 2 + len(plans)
    for line, plan in zip(lines[2:], plans):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == plan.role and float(cells[11]) == round(plan.total / 1e9, 2)
        assert cells[12:] == ["yes" if plan.total <= 1 else "no", "yes" if plan.total <= 1e9 else "no"]
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["4: pp2 × ep2", ""]
    assert cli.main([str(default_config_path()), "--world-size", "1", "--format", "markdown", "--gpu-gb", "80GB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--gpu-gb" in err


def test_a_billion_ranks_are_planned_without_a_list_of_them():
    """Issue 36: `--world-size 1000000000` (a valid layout) used to build a list over every rank
    (MemoryError). Run under a 3 GiB address-space limit and a timeout, so the old code fails fast."""
    import os
    import resource
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.run([sys.executable, str(repo / "tools" / "memory_plan.py"), str(default_config_path()),
                           "--world-size", "1000000000", "--set", "schedule.global_batch_size=4000000000",
                           "--format", "json"], env=env, capture_output=True, text=True, timeout=120,
                          preexec_fn=limit)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(proc.stdout)
    assert (row["first_rank"], row["last_rank"]) == (0, 999_999_999)
