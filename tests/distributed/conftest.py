"""Shared fixtures of the distributed tests.

`layout_results(worker, world_size, layouts, timeout_s)` makes the module-scoped fixture that the
layout tests share: one spawn of `world_size` gloo processes running ``worker(rank, world_size,
layouts)`` for every layout of the dict, whose per-rank results the parametrized tests then check
one layout at a time::

    results_2 = layout_results(_train, 2, LAYOUTS_2, timeout_s=900)

    @pytest.mark.parametrize("name", list(LAYOUTS_2))
    def test_layout_matches_single_process(results_2, name): ...
"""
from __future__ import annotations

import pytest

from tests.distributed.launch import run_distributed


def layout_results(worker, world_size: int, layouts: dict, timeout_s: float = 600):
    """A module-scoped fixture: `run_distributed(worker, world_size, (layouts,), timeout_s)`, run once
    for the module (assign it to the fixture's name at module level)."""
    @pytest.fixture(scope="module")
    def results():
        return run_distributed(worker, world_size, (layouts,), timeout_s=timeout_s)

    return results
