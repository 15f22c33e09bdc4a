"""The AdamW state of tp / etp-cut weights reshards across tp and etp (checkpoint/dcp_state.py; 2 gloo ranks, fp64).

Train 2 steps at one layout, save, resume at another and train a 3rd step: the 3rd step's loss,
every weight and every weight's AdamW state (master, exp_avg, exp_avg_sq, step) equal the
uninterrupted single-process run's 3 steps (the same seeds) within ``FP64_REL`` (tests/numerics.py:
the layouts add the same products in other orders; a cut weight against its slice of the reference):
tp2 → tp1, tp1 → tp2, tp2·etp2 → tp1 and tp2·etp2 → tp2·etp1 (one kv head, replicated on both tp
ranks). Resuming at the same layout is bitwise (tests/distributed/test_tp_trainer_checkpoint.py,
test_tp_trainer_etp_checkpoint.py).

A checkpoint written the old way (cut weights' state as flat pieces of the local shard under
``optim/<name>/tp<i>/...``, written here by that writer) still resumes at its tp bitwise, and at
another tp is one clear CheckpointError (those pieces cannot be placed in the global tensor: they
are not written with it). A state tensor whose declared global shape is not the weight's is one
clear CheckpointError before anything is allocated for it.
"""
from __future__ import annotations

import pickle
import shutil

import pytest
import torch

from megatron_fp4.training.checkpoint.directory import CheckpointError
from tests.distributed.launch import run_distributed
from tests.distributed.test_tp_trainer import layout_cfg, single_process
from tests.numerics import FP64_REL, rel

pytestmark = pytest.mark.distributed
KINDS = ("master", "exp_avg", "exp_avg_sq")
SPEC = dict(kv_heads=1)  # the single-process reference's
TP2, ETP2, ETP1 = dict(tp=2, kv_heads=1), dict(tp=2, etp=2, kv_heads=1), dict(tp=2, kv_heads=1)


def local_states(trainer) -> dict:
    """name -> (weight, {kind: its AdamW state, shaped like it}, adam step, its cut (dim, index) or
    None) of every weight this rank keeps all the state of (dp 1: every weight)."""
    opt, out = trainer.optimizer, {}
    for k, buf in enumerate(opt.buffers):
        st = opt.adam_state(k)
        flat = {}
        for i, lo, hi, pos in buf.pieces():
            p = buf.params[i]
            d = flat.setdefault(i, {kind: torch.full((p.numel(),), float("nan"), dtype=torch.float64) for kind in KINDS})
            for kind in KINDS:
                d[kind][lo:hi] = st[kind][pos:pos + hi - lo].to(torch.float64)
        for i, d in flat.items():
            p = buf.params[i]
            cut = getattr(p, "tp_shard", None) or getattr(p, "etp_shard", None)
            out[buf.names[i]] = (p.detach().clone(), {kind: v.view(p.shape) for kind, v in d.items()}, st["step"],
                                 None if cut is None else (cut[0], cut[1].clone()))
    return out


def _legacy_optim_entries(trainer) -> dict:
    """The optimizer pieces as `dcp.save` wrote them before session 13: a cut weight's under
    ``optim/<name>/tp<i>/<kind>/<offset>``, flat pieces of the local shard."""
    from megatron_fp4.training.checkpoint import dcp_optim

    opt, info, out = trainer.optimizer, dcp_optim.expert_info(trainer.model), {}
    for k, buf in enumerate(opt.buffers):
        state = opt.adam_state(k)
        for i, lo, hi, _ in buf.pieces(buf.owned):
            start = dcp_optim._state_index(buf, buf.offsets[i] + lo)
            stem = dcp_optim._optim_stem(buf.names[i], buf.params[i], trainer.mesh)
            for kind in KINDS:
                out[f"optim/{stem}/{kind}/{dcp_optim.global_offset(buf.params[i], info) + lo}"] = \
                    state[kind][start:start + hi - lo].clone()
    return out


def _worker(rank, world_size, root):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.checkpoint import dcp_optim
    from megatron_fp4.training.trainer import Trainer

    tp2, etp2 = ParallelMesh.build(1, 1, 1, tp=2), ParallelMesh.build(1, 1, 1, tp=2, etp=2)
    out = {}
    for name, spec, mesh in (("tp2", TP2, tp2), ("etp2", ETP2, etp2)):
        trainer = Trainer(layout_cfg(spec), mesh)
        for _ in range(2):
            trainer.train_step()
        trainer.save_checkpoint(f"{root}/{name}")
    for name, spec, mesh, source in (("tp1_to_tp2", TP2, tp2, "tp1"), ("etp2_to_etp1", ETP1, tp2, "etp2")):
        trainer = Trainer(layout_cfg(spec), mesh)
        trainer.load_checkpoint(f"{root}/{source}")
        loss = trainer.train_step()["loss"]
        out[name] = dict(loss=loss, states=local_states(trainer))
    new_writer = dcp_optim.optim_entries
    dcp_optim.optim_entries = _legacy_optim_entries
    try:
        trainer = Trainer(layout_cfg(TP2), tp2)
        for _ in range(2):
            trainer.train_step()
        trainer.save_checkpoint(f"{root}/legacy")
    finally:
        dcp_optim.optim_entries = new_writer
    after = trainer.train_step()["loss"]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    resumed = Trainer(layout_cfg(TP2), tp2)
    resumed.load_checkpoint(f"{root}/legacy")
    again = resumed.train_step()["loss"]
    out["legacy"] = dict(after=after, again=again,
                         unequal=[n for n, p in resumed.model.named_parameters() if not torch.equal(p.detach(), params[n])])
    return out


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    from megatron_fp4.training.trainer import Trainer

    root = tmp_path_factory.mktemp("optim_reshard")
    cfg, _, _ = single_process(SPEC, 0)
    trainer = Trainer(cfg)
    for _ in range(2):
        trainer.train_step()
    trainer.save_checkpoint(str(root / "tp1"))
    results = run_distributed(_worker, 2, (str(root),), timeout_s=600)
    _, ref, steps = single_process(SPEC, 3)
    return root, results, ref, steps[-1]["loss"]


def assert_matches_reference(loss, states, ref, ref_loss, what):
    assert abs(loss - ref_loss) <= FP64_REL * abs(ref_loss), (what, loss, ref_loss)
    want = local_states(ref)
    assert set(states) == set(want), what
    for name, (weight, state, step, cut) in states.items():
        w_weight, w_state, w_step, _ = want[name]
        pick = (lambda t: t) if cut is None else (lambda t: t.index_select(cut[0], cut[1]))
        assert step == w_step == 3.0, (what, name, step)
        assert rel(weight, pick(w_weight)) <= FP64_REL, (what, name)
        for kind in KINDS:
            assert not state[kind].isnan().any(), (what, name, kind)
            assert rel(state[kind], pick(w_state[kind])) <= FP64_REL, (what, name, kind)


@pytest.mark.parametrize("source", ["tp2", "etp2"])
def test_cut_state_resumes_at_tp1(ran, source):
    from megatron_fp4.training.trainer import Trainer

    root, _, ref, ref_loss = ran
    cfg, _, _ = single_process(SPEC, 0)
    trainer = Trainer(cfg)
    trainer.load_checkpoint(str(root / source))
    loss = trainer.train_step()["loss"]
    assert_matches_reference(loss, local_states(trainer), ref, ref_loss, f"{source} -> tp1")


@pytest.mark.parametrize("name", ["tp1_to_tp2", "etp2_to_etp1"])
def test_cut_state_resumes_at_another_tp_or_etp(ran, name):
    _, results, ref, ref_loss = ran
    for rank, r in enumerate(results):
        assert_matches_reference(r[name]["loss"], r[name]["states"], ref, ref_loss, (name, rank))


def test_legacy_checkpoint_resumes_at_its_tp_and_is_refused_at_another(ran):
    from megatron_fp4.training.trainer import Trainer

    root, results, _, _ = ran
    for r in results:
        assert not r["legacy"]["unequal"] and r["legacy"]["again"].hex() == r["legacy"]["after"].hex(), r["legacy"]
    cfg, _, _ = single_process(SPEC, 0)
    with pytest.raises(CheckpointError, match=r"saved at parallel.tp=2 with optimizer state.*resume with parallel.tp=2"):
        Trainer(cfg).load_checkpoint(str(root / "legacy"))


def test_state_of_another_global_shape_is_refused(ran, tmp_path):
    from megatron_fp4.training.checkpoint import directory as ckpt
    from megatron_fp4.training.checkpoint import files
    from megatron_fp4.training.checkpoint.dcp_metadata import METADATA_FILE, load_metadata_file
    from megatron_fp4.training.trainer import Trainer

    root = ran[0]
    step_dir = tmp_path / "step_00000002"
    shutil.copytree(next((root / "tp2").glob("step_*")), step_dir)
    metadata = load_metadata_file(step_dir / METADATA_FILE)
    key = next(k for k, md in metadata.state_dict_metadata.items()
               if k.startswith("optim/") and k.endswith("/exp_avg") and len(md.size) == 2 and md.size[0] > 1)
    md = metadata.state_dict_metadata[key]
    md.size = torch.Size([md.size.numel(), 1])  # the same bytes, another global shape
    with open(step_dir / METADATA_FILE, "wb") as f:
        pickle.dump(metadata, f)
    meta = ckpt.read_meta(step_dir)
    sums = {**meta.pop("files"), METADATA_FILE: files.file_digest(step_dir / METADATA_FILE)}
    meta.pop("meta_sha256")
    ckpt.write_meta(step_dir, meta, sums)
    cfg, _, _ = single_process(SPEC, 0)
    with pytest.raises(CheckpointError, match=rf"{key} has the global shape \({md.size[0]}, 1\), the weight's "
                                              r"optimizer state has"):
        Trainer(cfg).load_checkpoint(str(step_dir))
