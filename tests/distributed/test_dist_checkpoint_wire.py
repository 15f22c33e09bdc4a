"""A sharded checkpoint's messages between ranks (temp dir name, file list, verdict) go through
`parallel.wire` on the mesh's own world group, as uint8 bytes behind an int64 length: never on the
default group by accident, never one int32 per byte (as they did before)."""
from tests.distributed.launch import run_distributed


def _save_and_load(rank, world_size, root):
    import torch
    import torch.distributed as dist

    from tests.distributed.test_parallel_training_checkpoint import _trainer

    t = _trainer(world_size, zero_stage=1)
    t.train_step()
    seen, original = [], dist.broadcast

    def recording(tensor, src=None, group=None, **kwargs):
        seen.append((tensor.dtype, group is t.mesh.group("world")))
        return original(tensor, src=src, group=group, **kwargs)

    dist.broadcast = recording
    try:
        t.save_checkpoint(root)
        r = _trainer(world_size, zero_stage=1)
        step = r.load_checkpoint(root)
    finally:
        dist.broadcast = original
    t.optimizer.remove_hooks()
    r.optimizer.remove_hooks()
    return {"step": step, "seen": [(str(d), on_world) for d, on_world in seen],
            "allowed": [str(torch.int64), str(torch.uint8)]}


def test_checkpoint_messages_are_uint8_on_the_mesh_group(tmp_path):
    for rank, out in enumerate(run_distributed(_save_and_load, 2, (str(tmp_path / "ckpt"),), timeout_s=300)):
        assert out["step"] == 1, (rank, out)
        assert out["seen"], "the checkpoint sent no messages between ranks"
        assert all(dtype in out["allowed"] and on_world for dtype, on_world in out["seen"]), (rank, out["seen"])
