"""DCP checkpoints of an expert-tensor-parallel trainer (tp2 = etp2 on 2 gloo ranks, fp64; checkpoint/dcp_etp.py).

- resume at tp2 etp2: the loss and every weight of the step after the save are the same bits as
  the uninterrupted run's (the same kernels on the same shards, the same optimizer state);
- the expert weights are stored as chunks of the global tensors (w13 as its gate and up halves):
  `load_full_model_state` (one process) of the trained checkpoint equals the single-process
  trainer after the same steps within FP64_REL (tests/numerics.py: tp sums in another order);
- weights reshard across etp: the weights-only etp2 checkpoint (step 0) loads into a tp1 trainer
  as the single process's init bit for bit (init is sliced, not redrawn), and a tp2 etp1
  checkpoint (whole w13) into tp2 etp2 as the etp2 init;
- the optimizer state of etp shards reshards too: tests/distributed/test_dcp_optim_reshard.py;
- tp2×dp2×ep2 etp2 (4 ranks: per-global-expert keys, ``.../expert<e>/gate``) and tp2×dp2 etp2
  (edp 2: ZeRO shards an etp slice's AdamW state): resume bitwise and the global weights as above.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run_distributed
from tests.distributed.test_tp_trainer import layout_cfg, single_process
from tests.distributed.test_tp_trainer_checkpoint import assert_global_weights

pytestmark = pytest.mark.distributed
ETP2, ETP1 = dict(tp=2, etp=2), dict(tp=2)


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _etp_save_resume(rank, world_size, root):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    etp2, etp1 = ParallelMesh.build(1, 1, 1, tp=2, etp=2), ParallelMesh.build(1, 1, 1, tp=2)
    trainer = Trainer(layout_cfg(ETP2), etp2)
    init = _params(trainer)
    trainer.save_checkpoint(f"{root}/fresh")  # step 0: weights only
    for _ in range(2):
        trainer.train_step()
    trainer.save_checkpoint(f"{root}/trained")
    after = trainer.train_step()["loss"]
    params = _params(trainer)
    resumed = Trainer(layout_cfg(ETP2), etp2)
    resumed.load_checkpoint(f"{root}/trained")
    again = resumed.train_step()["loss"]
    same = [n for n, p in _params(resumed).items() if not torch.equal(p, params[n])]
    whole = Trainer(layout_cfg(ETP1), etp1)  # etp 1: w13 saved whole, loaded into etp2 slices
    whole.save_checkpoint(f"{root}/fresh_etp1")
    sliced = Trainer(layout_cfg(ETP2), etp2)
    sliced.load_checkpoint(f"{root}/fresh_etp1")
    from_whole = [n for n, p in _params(sliced).items() if not torch.equal(p, init[n])]
    return dict(after=after, again=again, unequal=same, step=resumed.step, from_whole=from_whole)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("etp_ckpt")
    return root, run_distributed(_etp_save_resume, 2, (str(root),), timeout_s=600)


def test_etp2_resume_is_bitwise(saved):
    for r in saved[1]:
        assert r["step"] == 3 and not r["unequal"], r
        assert r["again"].hex() == r["after"].hex(), r


def test_whole_w13_loads_into_etp2_slices(saved):
    for r in saved[1]:
        assert not r["from_whole"], r["from_whole"]


LAYOUTS_4 = {"ep_trained": dict(tp=2, ep=2, etp=2), "edp_trained": dict(tp=2, etp=2)}  # edp 2: ZeRO over an etp slice


def _ep_save_resume(rank, world_size, root):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    out = {}
    for name, spec in LAYOUTS_4.items():
        mesh = ParallelMesh.build(1, 2, spec.get("ep", 1), tp=2, etp=2)
        trainer = Trainer(layout_cfg(spec), mesh)
        for _ in range(2):
            trainer.train_step()
        trainer.save_checkpoint(f"{root}/{name}")
        after, params = trainer.train_step()["loss"], _params(trainer)
        resumed = Trainer(layout_cfg(spec), mesh)
        resumed.load_checkpoint(f"{root}/{name}")
        again = resumed.train_step()["loss"]
        out[name] = dict(after=after, again=again,
                         unequal=[n for n, p in _params(resumed).items() if not torch.equal(p, params[n])])
    return out


@pytest.fixture(scope="module")
def saved_ep(tmp_path_factory):
    root = tmp_path_factory.mktemp("etp_ep_ckpt")
    return root, run_distributed(_ep_save_resume, 4, (str(root),), timeout_s=600)


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_etp2_ep2_resume_is_bitwise_and_holds_the_global_weights(saved_ep, name):
    from megatron_fp4.training.checkpoint.directory import read_meta
    from megatron_fp4.training.checkpoint.dcp import load_full_model_state, read_full_model_state

    root, results = saved_ep
    for r in results:
        assert not r[name]["unequal"] and r[name]["again"].hex() == r[name]["after"].hex(), r[name]
    _, ref = _single(2)
    full = load_full_model_state(root / name)
    want = assert_global_weights(full, ref)
    step_dir = next((root / name).glob("step_*"))  # the shape check tools/convert_checkpoint.py runs
    checked = read_full_model_state(step_dir, read_meta(step_dir), {n: tuple(p.shape) for n, p in want.items()})
    assert all(torch.equal(checked[n], full[n]) for n in full)


def _single(steps: int):
    cfg, trainer, _ = single_process({}, steps)
    return cfg, trainer


def test_etp2_checkpoint_holds_the_global_weights(saved):
    from megatron_fp4.training.checkpoint.dcp import load_full_model_state

    root, _ = saved
    _, ref = _single(2)
    full = load_full_model_state(root / "trained")
    assert_global_weights(full, ref)
    assert any(n.endswith("experts.w13") for n in full)


def test_etp2_weights_reshard_to_tp1(saved):
    from megatron_fp4.training.trainer import Trainer

    root, _ = saved
    cfg, ref = _single(0)
    tp1 = Trainer(cfg)
    tp1.load_checkpoint(str(root / "fresh"))
    want = dict(ref.model.named_parameters())
    for name, p in tp1.model.named_parameters():
        assert torch.equal(p.detach(), want[name].detach()), name
