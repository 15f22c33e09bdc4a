"""DCP checkpoints of the families beside Qwen3-MoE reshard across layouts (float64, tiny models of
`test_family_layouts`: DeepSeek-V3's latent attention low-rank weights and norms, dense first
layer, shared expert, router bias; GPT-OSS's sinks, attention / router / expert biases).

Reference: the single-process run of 4 AdamW steps. Saved at pp2 × dp2 × ep2 (4 processes) after
2 steps, then 2 more steps:

- resumed at the same layout: the losses and every weight the same bits as the uninterrupted
  sharded run (the same kernels on the same shards, the same optimizer state);
- resumed at dp4 × ep4, at cp2 × dp2 × ep2 and in one process (weights *and* AdamW state
  resharded over pp, ep, dp and cp): losses and weights within ``FP64_REL`` (1e-10) of the
  single-process reference, every tensor held by some rank checked against its slice.

Tensor parallel (2 processes, tp2): the tp-cut tensors (MLA's q_b / kv_b / o projections, the
sinks, the attention and expert biases) are stored as chunks of the global tensors, so the trained
tp2 checkpoint read in one process (`load_full_model_state`) equals the single process after the
same steps (1e-10), a weights-only tp2 checkpoint (step 0) loads into a tp1 trainer as the single
process's init bit for bit, and resuming at tp2 is bitwise. AdamW state of tp-cut weights loads
only at the tp it was saved with (`checkpoint/dcp_tp.py`; one clear error otherwise, not retested
here). Expert parallel from one process: the single process's checkpoint (ep 1, every expert in
one tensor) resumes at dp2 × ep2 within 1e-10 of the uninterrupted run.
"""
import pytest
import torch

from tests.distributed.launch import run_distributed
from tests.distributed.test_family_layouts import FAMILIES, family_cfg, held_params, held_slices, slice_of
from tests.numerics import FP64_REL, rel, single_thread

pytestmark = pytest.mark.distributed
SAVE = dict(pp=2, ep=2)
RESUME = {"pp2_dp2_ep2": SAVE, "dp4_ep4": dict(ep=4), "cp2_dp2_ep2": dict(cp=2, ep=2)}
# each family's own tensors the checkpoint must carry (a name part of some parameter)
OWN = {"deepseek_v3": ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                       "shared_expert", "router.expert_bias"),
       "gpt_oss": ("sinks", "q_proj.bias", "o_proj.bias", "router.bias", "experts.b13", "experts.b2")}


def _cfg(family: str, spec: dict):
    cfg = family_cfg(family, spec)
    cfg.schedule.train_steps = 4
    return cfg


def _trainer(world_size: int, cfg):
    from megatron_fp4.parallel.dims import ParallelDims
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    return Trainer(cfg, ParallelMesh.from_dims(ParallelDims.from_config(cfg, world_size)))


def _state(t, losses) -> dict:
    out = dict(losses=losses, params=held_params(t), shards=held_slices(t))
    t.optimizer.remove_hooks()
    return out


def _save_then_resume(rank, world_size, root):
    out = {}
    for family in FAMILIES:
        t = _trainer(world_size, _cfg(family, SAVE))
        losses = [t.train_step()["loss"] for _ in range(2)]
        t.save_checkpoint(f"{root}/{family}")
        losses += [t.train_step()["loss"] for _ in range(2)]
        out[family, "full"] = _state(t, losses)
        for name, spec in RESUME.items():
            r = _trainer(world_size, _cfg(family, spec))
            assert r.load_checkpoint(f"{root}/{family}") == 2
            out[family, name] = _state(r, [r.train_step()["loss"] for _ in range(2)])
    return out


def _resume_single(rank, world_size, root):
    out = {}
    for family in FAMILIES:
        r = _trainer(world_size, _cfg(family, {}))
        assert r.load_checkpoint(f"{root}/{family}") == 2
        out[family] = _state(r, [r.train_step()["loss"] for _ in range(2)])
    return out


def _reference(family: str, steps: int = 4):
    from megatron_fp4.training.trainer import Trainer

    with single_thread():
        t = Trainer(_cfg(family, {}))
        losses = [t.train_step()["loss"] for _ in range(steps)]
        return losses, held_params(t), t


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("family_ckpt"))
    sharded = run_distributed(_save_then_resume, 4, (root,), timeout_s=900)
    single = run_distributed(_resume_single, 1, (root,), timeout_s=600)[0]
    return sharded, single


def _check(runs: list, want_losses: list, want_params: dict, what: str) -> None:
    seen = set()
    for r, where in runs:
        for got, want in zip(r["losses"], want_losses, strict=True):
            assert abs(got - want) <= FP64_REL * abs(want), (what, where, r["losses"], want_losses)
        for name, value in r["params"].items():
            want = slice_of(want_params[name], r["shards"].get(name, ()))
            assert value.shape == want.shape and rel(value, want) <= FP64_REL, (what, where, name, rel(value, want))
            seen.add(name)
    assert seen == set(want_params), (what, set(want_params) - seen)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_checkpoint_reshards_over_pp_ep_dp_cp(resumed, family):
    sharded, single = resumed
    ref_losses, ref_params, _ = _reference(family)
    assert all(any(part in n for n in ref_params) for part in OWN[family]), OWN[family]
    _check([(res[family, "full"], rank) for rank, res in enumerate(sharded)], ref_losses, ref_params, "uninterrupted")
    for name in RESUME:
        _check([(res[family, name], rank) for rank, res in enumerate(sharded)], ref_losses[2:], ref_params, name)
    _check([(single[family], 0)], ref_losses[2:], ref_params, "single process")
    for rank, res in enumerate(sharded):  # the same layout: the same bits as the uninterrupted run
        full, again = res[family, "full"], res[family, "pp2_dp2_ep2"]
        assert [v.hex() for v in again["losses"]] == [v.hex() for v in full["losses"][2:]], (rank, again["losses"])
        assert all(torch.equal(v, full["params"][n]) for n, v in again["params"].items()), rank


# -- tensor parallel: the cut tensors as chunks of the global ones --------------------------------
def _tp2(rank, world_size, root):
    out = {}
    for family in FAMILIES:
        # an ep 1 checkpoint (the single process's, step 2) into dp2 × ep2: every expert's tensor
        # read whole, each rank keeps its experts, AdamW state by global offsets
        r = _trainer(world_size, _cfg(family, dict(ep=2)))
        assert r.load_checkpoint(f"{root}/{family}/single") == 2
        out[family, "ep2_from_single"] = _state(r, [r.train_step()["loss"] for _ in range(2)])
        t = _trainer(world_size, _cfg(family, dict(tp=2)))
        t.save_checkpoint(f"{root}/{family}/fresh")  # step 0: weights only
        for _ in range(2):
            t.train_step()
        t.save_checkpoint(f"{root}/{family}/trained")
        after = t.train_step()["loss"]
        cut = sorted(n for n, s in held_slices(t).items() if "experts" not in n or len(s) > 1)
        params = held_params(t)
        t.optimizer.remove_hooks()
        r = _trainer(world_size, _cfg(family, dict(tp=2)))
        assert r.load_checkpoint(f"{root}/{family}/trained") == 2
        again = r.train_step()["loss"]
        same = all(torch.equal(v, params[n]) for n, v in held_params(r).items())
        r.optimizer.remove_hooks()
        out[family] = dict(after=after, again=again, same=same, cut=cut)
    return out


@pytest.fixture(scope="module")
def tp2_saved(tmp_path_factory):
    from megatron_fp4.training.trainer import Trainer

    root = tmp_path_factory.mktemp("family_tp_ckpt")
    for family in FAMILIES:
        with single_thread():
            t = Trainer(_cfg(family, {}))
            for _ in range(2):
                t.train_step()
            t.save_checkpoint(str(root / family / "single"))
    return root, run_distributed(_tp2, 2, (str(root),), timeout_s=900)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_single_process_checkpoint_resumes_at_ep2(tp2_saved, family):
    _, results = tp2_saved
    ref_losses, ref_params, _ = _reference(family)
    _check([(r[family, "ep2_from_single"], rank) for rank, r in enumerate(results)], ref_losses[2:], ref_params,
           "ep2 from the single process")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_checkpoint_holds_global_tensors_and_resumes_bitwise(tp2_saved, family):
    from megatron_fp4.training.checkpoint.dcp import load_full_model_state
    from megatron_fp4.training.trainer import Trainer

    root, results = tp2_saved
    for rank, r in enumerate(results):
        assert r[family]["same"] and r[family]["again"].hex() == r[family]["after"].hex(), (rank, r[family])
    cut = results[0][family]["cut"]
    parts = {"deepseek_v3": ("q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight"),
             "gpt_oss": ("sinks", "q_proj.bias", "k_proj.bias", "o_proj.weight")}[family]
    assert all(any(part in n for n in cut) for part in parts), (parts, cut)  # really cut by tp
    _, ref_params, _ = _reference(family, steps=2)
    full = load_full_model_state(root / family / "trained")
    assert set(full) == set(ref_params)  # the parameters and DeepSeek-V3's router biases
    for name, value in full.items():
        assert value.shape == ref_params[name].shape and rel(value, ref_params[name]) <= FP64_REL, name
    with single_thread():
        init = Trainer(_cfg(family, {}))
        tp1 = Trainer(_cfg(family, {}))
        tp1.load_checkpoint(str(root / family / "fresh"))
    for name, p in tp1.model.named_parameters():
        assert torch.equal(p.detach(), dict(init.model.named_parameters())[name].detach()), name
