"""Sharded (DCP) checkpoints: exact resume, and resharding dp2 → dp1, dp1 → dp2 and dp2 → pp2.

Reference: the single-process run of 4 steps, in float64. A run saved after 2 steps and resumed for
2 more must give the same losses and parameters: bitwise when the layout is unchanged (the same
kernels on the same shapes in the same process: by construction), within ``FP64_REL`` (1e-10
relative, tests/numerics.py) when it changes.
"""
import json

import torch

from tests.distributed.launch import run_distributed
from tests.distributed.test_parallel_training import tiny_cfg
from tests.numerics import FP64_REL, rel


def _trainer(world_size, **parallel):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    cfg = tiny_cfg(**parallel)
    cfg.schedule.train_steps = 4
    mesh = ParallelMesh.build(cfg.parallel.pp, world_size // cfg.parallel.pp, 1)
    return Trainer(cfg, mesh)


def _params(trainer):
    return {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters()}


def _save_dp2_then_resume(rank, world_size, root):
    """dp2 ZeRO-1: 4 steps with a checkpoint at 2; resume dp2 (exact) and pp2 (resharded)."""
    t = _trainer(world_size, zero_stage=1)
    losses = [t.train_step()["loss"] for _ in range(2)]
    t.save_checkpoint(root)
    losses += [t.train_step()["loss"] for _ in range(2)]
    out = {"full": (losses, _params(t))}
    t.optimizer.remove_hooks()
    for name, parallel in (("dp2", dict(zero_stage=1)), ("pp2", dict(pp=2, zero_stage=2))):
        r = _trainer(world_size, **parallel)
        assert r.load_checkpoint(root) == 2
        out[name] = ([r.train_step()["loss"] for _ in range(2)], _params(r))
        r.optimizer.remove_hooks()
    return out


def _resume_dp1_then_save(rank, world_size, root_in, root_out):
    t = _trainer(world_size, zero_stage=1)
    t.load_checkpoint(root_in)
    out = {"dp1": ([t.train_step()["loss"] for _ in range(2)], _params(t))}
    t.optimizer.remove_hooks()
    s = _trainer(world_size, zero_stage=1)
    s.train_step(), s.train_step()
    s.save_checkpoint(root_out)
    return out


def _resume_dp2(rank, world_size, root):
    t = _trainer(world_size, zero_stage=2)
    t.load_checkpoint(root)
    return {"dp2_from_dp1": ([t.train_step()["loss"] for _ in range(2)], _params(t))}


def _reference():
    from megatron_fp4.training.trainer import Trainer

    cfg = tiny_cfg()
    cfg.schedule.train_steps = 4
    t = Trainer(cfg)
    losses = [t.train_step()["loss"] for _ in range(4)]
    return losses, {n: p.detach().clone() for n, p in t.model.named_parameters()}


def _check(result, ref_losses, ref_params, bitwise=False):
    losses, params = result
    names = set()
    for got, want in zip(losses, ref_losses):
        assert (got == want) if bitwise else abs(got - want) <= FP64_REL * abs(want), (losses, ref_losses)
    for name, value in params.items():
        if bitwise:
            assert torch.equal(torch.from_numpy(value), ref_params[name]), name
        else:
            assert rel(value, ref_params[name]) <= FP64_REL, (name, rel(value, ref_params[name]))
        names.add(name)
    return names


def test_dcp_resume_and_reshard(tmp_path):
    root_a, root_b = str(tmp_path / "dp2"), str(tmp_path / "dp1")
    ref_losses, ref_params = _reference()
    first = run_distributed(_save_dp2_then_resume, 2, (root_a,), timeout_s=600)
    meta = json.loads((tmp_path / "dp2" / "step_00000002" / "meta.json").read_text())
    assert meta["kind"] == "dcp" and meta["step"] == 2 and meta["layout"]["dp"] == 2
    assert (tmp_path / "dp2" / "latest").read_text().strip() == "step_00000002"
    assert not list((tmp_path / "dp2").glob(".tmp-*"))
    for rank in range(2):
        full = first[rank]["full"]
        _check(full, ref_losses, ref_params)
        # Same layout: bitwise equal to the uninterrupted parallel run.
        _check(first[rank]["dp2"], full[0][2:], {n: torch.from_numpy(v) for n, v in full[1].items()}, bitwise=True)
    assert set().union(*(_check(first[r]["pp2"], ref_losses[2:], ref_params) for r in range(2))) == set(ref_params)
    second = run_distributed(_resume_dp1_then_save, 1, (root_a, root_b), timeout_s=600)
    _check(second[0]["dp1"], ref_losses[2:], ref_params)
    third = run_distributed(_resume_dp2, 2, (root_b,), timeout_s=600)
    for rank in range(2):
        _check(third[rank]["dp2_from_dp1"], ref_losses[2:], ref_params)
