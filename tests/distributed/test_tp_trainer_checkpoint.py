"""DCP checkpoints of a tensor-parallel trainer (tp2 on 2 gloo ranks, fp64; checkpoint/dcp_tp.py).

- resume at tp2: the loss and every weight of the step after the save are the same bits as the
  uninterrupted run's (the same kernels on the same shards, the same optimizer state);
- the weights are stored as chunks of the global tensors: `read_full_model_state` (one process, no
  group) of the tp2 checkpoint equals the single-process trainer after the same steps within
  FP64_REL (tests/numerics.py: tp sums in another order), and a weights-only tp2 checkpoint (step
  0) loads into a tp1 trainer as the single process's init bit for bit (init is sliced, not redrawn);
- the optimizer state of cut weights reshards too: tests/distributed/test_dcp_optim_reshard.py.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run_distributed
from tests.distributed.test_tp_trainer import layout_cfg, single_process
from tests.numerics import FP64_REL, rel

pytestmark = pytest.mark.distributed


def _tp2_save_resume(rank, world_size, root):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    cfg = layout_cfg(dict(tp=2, kv_heads=1))  # a replicated kv head too (its own DTensor mesh)
    mesh = ParallelMesh.build(1, 1, 1, tp=2)
    trainer = Trainer(cfg, mesh)
    trainer.save_checkpoint(f"{root}/fresh")  # step 0: weights only
    for _ in range(2):
        trainer.train_step()
    trainer.save_checkpoint(f"{root}/trained")
    after = trainer.train_step()["loss"]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    resumed = Trainer(layout_cfg(dict(tp=2, kv_heads=1)), mesh)
    resumed.load_checkpoint(f"{root}/trained")
    again = resumed.train_step()["loss"]
    same = all(torch.equal(p.detach(), params[n]) for n, p in resumed.model.named_parameters())
    return dict(after=after, again=again, same=same, step=resumed.step)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_ckpt")
    return root, run_distributed(_tp2_save_resume, 2, (str(root),), timeout_s=600)


def test_tp2_resume_is_bitwise(saved):
    _, results = saved
    for r in results:
        assert r["step"] == 3 and r["same"], r
        assert r["again"].hex() == r["after"].hex(), r


def _single(steps: int):
    cfg, trainer, _ = single_process(dict(kv_heads=1), steps)
    return cfg, trainer


def assert_global_weights(full: dict, ref) -> dict:
    """A checkpoint's whole model state ``full`` is the single-process trainer ``ref``'s weights:
    the same names and shapes, values within FP64_REL. Returns ``ref``'s parameters by name."""
    want = dict(ref.model.named_parameters())
    assert set(full) == set(want)
    for name, value in full.items():
        assert value.shape == want[name].shape and rel(value, want[name].detach()) <= FP64_REL, name
    return want


def test_tp2_checkpoint_holds_the_global_weights(saved):
    from megatron_fp4.training.checkpoint.dcp import load_full_model_state

    root, _ = saved
    _, ref = _single(2)
    assert_global_weights(load_full_model_state(root / "trained"), ref)


def test_weights_reshard_tp2_to_tp1(saved):
    from megatron_fp4.training.trainer import Trainer

    root, _ = saved
    cfg, ref = _single(0)
    tp1 = Trainer(cfg)
    tp1.load_checkpoint(str(root / "fresh"))
    for name, p in tp1.model.named_parameters():
        assert torch.equal(p.detach(), dict(ref.model.named_parameters())[name].detach()), name
