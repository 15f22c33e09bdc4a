"""The groups `ParallelMesh` builds on DeviceMesh (gloo, 8 processes) have the memberships and rank
order of the mesh before DeviceMesh (written out independently in `old_layout_groups`), each group
carries the mesh's timeout, and a collective over it sums exactly its members."""
from datetime import timedelta

import pytest

from tests.distributed.launch import run_distributed
from tests.unit.test_parallel_dims import old_layout_groups

LAYOUTS = [(2, 4, 2), (4, 2, 2), (1, 8, 4)]  # (pp, dp, ep): embed spans all / two of four / no stages


def _groups(rank, world_size):
    import torch
    import torch.distributed as dist

    from megatron_fp4.parallel.mesh import ParallelMesh

    out = {}
    for pp, dp, ep in LAYOUTS:
        mesh = ParallelMesh.build(pp, dp, ep, device=torch.device("cpu"), timeout_s=17.0)
        seen = {}
        for axis, group in mesh.groups.items():
            total = torch.tensor([float(rank)])
            dist.all_reduce(total, group=group)
            backend = group._get_backend(torch.device("cpu"))
            seen[axis] = dict(ranks=mesh.ranks[axis], members=dist.get_process_group_ranks(group),
                              total=total.item(), timeout=backend.options._timeout)
        second = mesh.second_group("ep")
        seen["ep#2"] = dict(members=dist.get_process_group_ranks(second))
        out[(pp, dp, ep)] = dict(groups=seen, coords={a: mesh.coord(a) for a in ("pp", "dp", "ep", "edp")})
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_groups, 8, timeout_s=300)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_mesh_groups_equal_the_old_layout(results, layout):
    pp, dp, ep = layout
    want = old_layout_groups(pp, dp, ep)
    for rank, res in enumerate(results):
        got = res[layout]["groups"]
        has_embed = any(rank in g for g in want["embed"])  # first or last stage, with pp > 1
        expected_axes = {"pp", "dp", "ep", "edp", "tp", "etp", "world", "ep#2"} | ({"embed"} if has_embed else set())
        assert set(got) == expected_axes, (rank, set(got))
        for axis, groups in want.items():
            mine = [g for g in groups if rank in g]
            if not mine:
                continue
            assert got[axis]["ranks"] == got[axis]["members"] == mine[0], (layout, rank, axis, got[axis])
            assert got[axis]["total"] == sum(mine[0]), (layout, rank, axis)
            assert got[axis]["timeout"] == timedelta(seconds=17.0), (layout, rank, axis)
        assert got["tp"]["members"] == got["etp"]["members"] == [rank]
        assert got["ep#2"]["members"] == got["ep"]["members"]
        assert res[layout]["coords"] == {"pp": rank // dp, "dp": rank % dp, "ep": rank % dp % ep,
                                         "edp": rank % dp // ep}
