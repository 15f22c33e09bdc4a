"""`training/checkpoint/dcp_etp.py`'s pure pieces: w13's gate / up halves merged back (and a lone half refused),
their declared shapes, and the etp refusal of optimizer state."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_fp4.training.checkpoint.directory import CheckpointError
from megatron_fp4.training.checkpoint.dcp_etp import check_etp_layout, key_shapes, merge_halves


def test_halves_merge_back_into_w13_rows_gate_then_up():
    gate, up, w2 = torch.randn(2, 3, 4), torch.randn(2, 3, 4), torch.randn(2, 4, 3)
    out = merge_halves({"l.experts.w13/gate": gate, "l.experts.w13/up": up, "l.experts.w2": w2})
    assert set(out) == {"l.experts.w13", "l.experts.w2"}
    assert torch.equal(out["l.experts.w13"], torch.cat([gate, up], 1)) and out["l.experts.w2"] is w2


@pytest.mark.parametrize("half,other", [("gate", "up"), ("up", "gate")])
def test_a_lone_half_is_an_incomplete_checkpoint(half, other):
    with pytest.raises(CheckpointError, match=f"holds w13/{half} without w13/{other}"):
        merge_halves({f"w13/{half}": torch.zeros(1, 2, 2)})


def test_declared_shapes_of_halves():
    full = {"e.w13": (4, 6, 5), "e.w2": (4, 5, 3)}
    got = key_shapes(["model/e.w13/gate", "model/e.w13/expert1/up", "model/e.w2/expert3", "model/x/gate"], full)
    assert got == {"model/e.w13/gate": (4, 3, 5), "model/e.w13/expert1/up": (3, 5), "model/e.w2/expert3": (5, 3),
                   "model/x/gate": None}


def test_optimizer_state_does_not_reshard_across_etp():
    mesh = SimpleNamespace(etp=1)
    check_etp_layout({"layout": {"etp": 2}}, mesh, False, "/c")  # weights alone: fine
    check_etp_layout({"layout": {}}, SimpleNamespace(etp=1), True, "/c")  # older checkpoints: etp 1
    with pytest.raises(CheckpointError, match=r"saved at parallel\.etp=2 with optimizer state.*parallel\.etp=1"):
        check_etp_layout({"layout": {"etp": 2}}, mesh, True, "/c")
