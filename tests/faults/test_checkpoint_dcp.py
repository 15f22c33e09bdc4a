"""Sharded (DCP) checkpoints under faults, on 2 gloo ranks: a shard that only rank 1 checks is
damaged, yet both ranks skip that step and resume the previous one together (the verdict is
all-reduced); saving a step that is already intact writes nothing on any rank; keep_last holds."""
from pathlib import Path

from tests.distributed.launch import run_distributed


def _save_damage_resume(rank, world_size, root):
    import warnings

    import torch
    import torch.distributed as dist

    from tests.distributed.test_parallel_training_checkpoint import _params, _trainer
    from tests.unit.test_checkpoint_safety import flip_bytes

    t = _trainer(world_size, zero_stage=1)
    t.cfg.checkpoint.keep_last = 2
    saved = {}
    for _ in range(3):
        t.train_step()
        t.save_checkpoint(root)
        saved[t.step] = _params(t)
    names = sorted(p.name for p in Path(root).iterdir())
    inode = (Path(root) / "step_00000003" / ".metadata").stat().st_ino
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.save_checkpoint(root)  # step 3 again: intact, so kept
    kept = (Path(root) / "step_00000003" / ".metadata").stat().st_ino == inode
    t.optimizer.remove_hooks()
    dist.barrier()
    if rank == 0:
        flip_bytes(Path(root) / "step_00000003" / "__0_0.distcp")  # files are checked round-robin: rank 1's share
    dist.barrier()
    r = _trainer(world_size, zero_stage=1)
    with warnings.catch_warnings(record=True) as skipped:
        warnings.simplefilter("always")
        step = r.load_checkpoint(root)
    same = all(torch.equal(torch.from_numpy(v), torch.from_numpy(saved[2][n])) for n, v in _params(r).items())
    r.optimizer.remove_hooks()
    return {"names": names, "kept": kept, "kept_warned": any("already holds" in str(w.message) for w in caught),
            "step": step, "skipped_warned": any("skipping damaged" in str(w.message) for w in skipped),
            "params_of_step_2": same}


def test_damaged_shard_on_one_rank_is_skipped_by_all(tmp_path):
    root = str(tmp_path / "ckpt")
    for rank, out in enumerate(run_distributed(_save_damage_resume, 2, (root,), timeout_s=300)):
        assert out["names"] == ["latest", "step_00000002", "step_00000003"], (rank, out["names"])
        assert out["kept"] and (out["kept_warned"] or rank != 0), (rank, out)
        assert out["step"] == 2 and out["params_of_step_2"], (rank, out)
        assert out["skipped_warned"], (rank, out)
