"""Meta-device construction: each rank materialises only its pipeline chunks and its experts, and
those equal the corresponding slices of the single-process model bit for bit; tied embeddings
across pipeline stages train like the single process.

- **bitwise by construction**: every parameter (and every expert of a stacked expert weight) is
  drawn from its own generator seeded from (seed, global name, global expert id) by the same
  `torch.randn` on the same shape, whichever rank builds it (pp2, ep2, pp2 × ep2, fp32 and fp64).
- **nothing foreign allocated**: before `materialize` every parameter is on the meta device, and
  while it runs no tensor larger than this rank's largest owned parameter is allocated (a full
  stacked expert weight or another stage's embedding would be); the bytes of real parameter storage
  are exactly the owned parameters' bytes.
- **tied embeddings, pp2 (and pp2 × dp2, ZeRO-1)**, float64: losses of 3 AdamW steps and every
  parameter within ``FP64_REL`` of the single process (the bound of tests/numerics.py), and the
  first and the last stage's copies of the embedding identical after the updates.
"""
import functools

import pytest
import torch

from tests.distributed.launch import run_distributed
from tests.distributed.test_parallel_training import STEPS, tiny_cfg
from tests.numerics import FP64_REL, rel, single_thread

BUILDS_2 = {"pp2": dict(pp=2), "ep2": dict(ep=2), "pp2_fp32": dict(pp=2, dtype="fp32"),
            "ep2_fp32_fp4": dict(ep=2, dtype="fp32", fp4=True)}
BUILDS_4 = {"pp2_ep2": dict(pp=2, ep=2)}


def _cfg(spec: dict):
    spec = dict(spec)
    cfg = tiny_cfg(spec.pop("fp4", False), spec.pop("dtype", "fp64"), **spec)
    return cfg


class _CountAllocations(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest tensor (bytes) any op allocates on a real device inside the block. Outputs that
    alias an input (views, in-place ops, safetensors' view of its memory-mapped file, whose pages
    are read only where a slice is copied) allocate nothing and are not counted."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t, ret in zip(outs, func._schema.returns):
            if isinstance(t, torch.Tensor) and not t.is_meta and ret.alias_info is None:
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def _build(rank, world_size, builds):
    import megatron_fp4.training.trainer as trainer_mod
    from megatron_fp4.parallel.mesh import ParallelMesh

    original = trainer_mod.materialize
    out = {}
    for name, spec in builds.items():
        cfg = _cfg(spec)
        seen = {}

        def counting_materialize(model, device, seed):
            seen["all_meta_before"] = all(p.is_meta for p in model.parameters())
            with _CountAllocations() as mode:
                original(model, device, seed)
            seen["largest_alloc"] = mode.largest
            return model

        trainer_mod.materialize = counting_materialize
        try:
            mesh = ParallelMesh.build(cfg.parallel.pp, world_size // cfg.parallel.pp, cfg.parallel.ep)
            t = trainer_mod.Trainer(cfg, mesh, build_data=False)
        finally:
            trainer_mod.materialize = original
        params = {}
        for n, p in t.model.named_parameters():
            offset = getattr(p, "is_expert", False) and next(
                m.experts.expert_offset for m in t.model.moe_layers() if p is m.experts.w13 or p is m.experts.w2)
            params[n] = (int(offset or 0), p.detach().clone())
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in t.model.parameters()}
        out[name] = dict(params=params, storage_bytes=sum(storages.values()), **seen)
        t.optimizer.remove_hooks()
    return out


def _check_builds(builds, results):
    from megatron_fp4.model import build_model

    for name, spec in builds.items():
        cfg = _cfg(spec)
        full = dict(build_model(cfg).named_parameters())
        dtype = {"fp64": torch.float64, "fp32": torch.float32}[cfg.dtype]
        covered = set()
        for rank, res in enumerate(results):
            r = res[name]
            assert r["all_meta_before"], (name, rank)
            owned_bytes = 0
            for pname, (offset, value) in r["params"].items():
                want = full[pname].detach().to(dtype)
                if offset or value.shape != want.shape:  # a local block of experts
                    want = want[offset:offset + value.shape[0]]
                assert value.dtype == dtype and torch.equal(value, want), (name, rank, pname)
                owned_bytes += value.numel() * value.element_size()
                covered.add(pname)
            assert r["storage_bytes"] == owned_bytes, (name, rank, r["storage_bytes"], owned_bytes)
            largest_owned = max(v.numel() for _, v in r["params"].values()) * 8  # fp64 at most
            assert r["largest_alloc"] <= largest_owned, (name, rank, r["largest_alloc"], largest_owned)
            full_bytes = sum(p.numel() for p in full.values()) * dtype.itemsize
            assert owned_bytes < full_bytes, (name, rank)
        assert set(covered) == set(full), (name, set(full) - set(covered))


def _two_processes(rank, world_size, hf_dirs, dcp_root):
    """Everything this file checks on 2 processes, in one spawn (process start-up dominates)."""
    return dict(builds=_build(rank, world_size, BUILDS_2), tied=_train_tied(rank, world_size, TIED),
                loads=_load_shards(rank, world_size, hf_dirs, dcp_root))


def _four_processes(rank, world_size):
    return dict(builds=_build(rank, world_size, BUILDS_4), tied=_train_tied(rank, world_size, TIED_4))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """The single-process model (another seed than the trainers') as HF checkpoints, per-expert
    ("checkpoint", what Hub files hold) and fused (transformers>=5 module layout) experts."""
    from safetensors.torch import save_file

    from megatron_fp4.integrations.hf import save_hf_checkpoint, to_hf_state_dict
    from megatron_fp4.model import build_model

    root = tmp_path_factory.mktemp("hf")
    cfg = _cfg(dict(dtype="fp32"))
    source = build_model(cfg, seed=cfg.schedule.seed + 7)
    dirs = {"checkpoint": str(save_hf_checkpoint(source, cfg, root / "checkpoint"))}
    (root / "fused").mkdir()
    (root / "fused" / "config.json").write_text((root / "checkpoint" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in to_hf_state_dict(source, "fused").items()},
              str(root / "fused" / "model.safetensors"))
    dirs["fused"] = str(root / "fused")
    return dirs


@pytest.fixture(scope="module")
def dcp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("dcp")


@pytest.fixture(scope="module")
def results_2(hf_dirs, dcp_root):
    return run_distributed(_two_processes, 2, (hf_dirs, str(dcp_root)), timeout_s=600)


@pytest.fixture(scope="module")
def results_4():
    return run_distributed(_four_processes, 4, timeout_s=600)


def test_two_process_builds_are_slices_of_the_single_process_model(results_2):
    _check_builds(BUILDS_2, [r["builds"] for r in results_2])


def test_pp2_ep2_build_is_a_slice_of_the_single_process_model(results_4):
    _check_builds(BUILDS_4, [r["builds"] for r in results_4])


# -- tied embeddings with pp --------------------------------------------------------------------------
TIED = {"tied_pp2": dict(pp=2), "tied_pp2_interleaved": dict(pp=2, virtual_stages=2, schedule="interleaved_1f1b")}
TIED_4 = {"tied_pp2_dp2_zero1": dict(pp=2, zero_stage=1)}


def _train_tied(rank, world_size, layouts):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    out = {}
    for name, spec in layouts.items():
        cfg = tiny_cfg(**spec)
        cfg.model.tie_embeddings = True
        t = Trainer(cfg, ParallelMesh.build(cfg.parallel.pp, world_size // cfg.parallel.pp, 1))
        losses = [t.train_step()["loss"] for _ in range(STEPS)]
        out[name] = dict(losses=losses, params={n: p.detach().clone() for n, p in t.model.named_parameters()},
                         axes={b.axis: b.names for b in t.optimizer.buffers})
        t.optimizer.remove_hooks()
    return out


@functools.lru_cache(maxsize=1)
def _tied_reference():
    """The single process (pp1) with tied embeddings: the reference of every tied layout."""
    from megatron_fp4.training.trainer import Trainer

    cfg = tiny_cfg()
    cfg.model.tie_embeddings = True
    with single_thread():
        t = Trainer(cfg)
        losses = [t.train_step()["loss"] for _ in range(STEPS)]
    return losses, dict(t.model.named_parameters())


def _check_tied(layouts, results):
    for name, spec in layouts.items():
        ref_losses, ref_params = _tied_reference()
        seen, embeds = set(), []
        for r in (res[name] for res in results):
            for got, want in zip(r["losses"], ref_losses):
                assert abs(got - want) <= FP64_REL * abs(want), (name, r["losses"], ref_losses)
            for pname, value in r["params"].items():
                assert rel(value, ref_params[pname].detach()) <= FP64_REL, (name, pname)
                seen.add(pname)
            if "embed_tokens.weight" in r["params"]:
                embeds.append(r["params"]["embed_tokens.weight"])
                assert r["axes"]["embed"] == ["embed_tokens.weight"], r["axes"]
        assert seen == set(ref_params) and "lm_head.weight" not in seen
        # Every rank of the first and of the last stage holds the embedding, the same bits.
        assert len(embeds) == len(results) and all(torch.equal(e, embeds[0]) for e in embeds)


def test_tied_embeddings_with_pp_match_single_process(results_2):
    _check_tied(TIED, [r["tied"] for r in results_2])


def test_tied_embeddings_with_pp_and_dp_match_single_process(results_4):
    _check_tied(TIED_4, [r["tied"] for r in results_4])


# -- sharded loading: HF safetensors and DCP ----------------------------------------------------------
LOADS = {"pp2": dict(pp=2), "ep2": dict(ep=2)}


def _load_shards(rank, world_size, hf_dirs, dcp_root):
    from megatron_fp4.integrations.hf import load_hf_shard
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    out = {}
    for name, spec in LOADS.items():
        cfg = _cfg(dict(spec, dtype="fp32"))
        mesh = ParallelMesh.build(cfg.parallel.pp, world_size // cfg.parallel.pp, cfg.parallel.ep)
        t = Trainer(cfg, mesh, build_data=False)
        largest_owned = max(p.numel() * p.element_size() for p in t.model.parameters())
        res = {"largest_owned": largest_owned}
        for layout, path in hf_dirs.items():
            with _CountAllocations() as mode:
                load_hf_shard(t.model, path)
            res[f"hf_{layout}"] = _local_params(t)
            res[f"hf_{layout}_largest_alloc"] = mode.largest
        t.save_checkpoint(f"{dcp_root}/{name}")
        cfg.schedule.seed += 1  # another init: what is compared below can only come from the checkpoint
        fresh = Trainer(cfg, ParallelMesh.build(cfg.parallel.pp, world_size // cfg.parallel.pp, cfg.parallel.ep),
                        build_data=False)
        fresh.load_checkpoint(f"{dcp_root}/{name}")
        res["dcp"] = _local_params(fresh)
        res["storage_bytes"] = sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                                    for p in fresh.model.parameters()}.values())
        out[name] = res
        t.optimizer.remove_hooks(), fresh.optimizer.remove_hooks()
    return out


def _local_params(trainer) -> dict:
    offsets = {id(p): m.experts.expert_offset for m in trainer.model.moe_layers()
               for p in (m.experts.w13, m.experts.w2) if hasattr(m.experts, "expert_offset")}
    return {n: (offsets.get(id(p), 0), p.detach().clone()) for n, p in trainer.model.named_parameters()}


def _slice_equal(local: dict, full: dict, where) -> int:
    nbytes = 0
    for pname, (offset, value) in local.items():
        want = full[pname].detach()
        if value.shape != want.shape:
            want = want[offset:offset + value.shape[0]]
        assert torch.equal(value, want.to(value.dtype)), (where, pname)
        nbytes += value.numel() * value.element_size()
    return nbytes


def test_ranks_load_only_their_shards_from_hf_and_dcp(results_2, hf_dirs, dcp_root):
    from megatron_fp4.integrations.hf import build_model_from_hf
    from megatron_fp4.training.checkpoint.dcp import load_full_model_state

    cfg = _cfg(dict(dtype="fp32"))
    reference = dict(build_model_from_hf(hf_dirs["checkpoint"], cfg.fp4).named_parameters())  # single process
    for name in LOADS:
        full_dcp = load_full_model_state(dcp_root / name)
        for rank, res in enumerate(results_2):
            r = res["loads"][name]
            for layout in hf_dirs:
                _slice_equal(r[f"hf_{layout}"], reference, (name, rank, layout))
                # Never a full stacked expert weight or another stage's tensor in memory at once.
                assert r[f"hf_{layout}_largest_alloc"] <= r["largest_owned"], (name, rank, layout)
            owned = _slice_equal(r["dcp"], full_dcp, (name, rank, "dcp"))
            _slice_equal(r["dcp"], reference, (name, rank, "dcp vs hf"))
            assert r["storage_bytes"] == owned, (name, rank)
