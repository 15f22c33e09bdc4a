"""Test-wide fixtures: every test starts with its own compiled FP4 kernels; ``threads`` runs a test
at one and at two intra-op threads.

Calls that name no ``fused.CompiledKernels`` (bare ``fake_quantize_*`` calls, a model without its own
``Numerics.kernels``) use the process's store, ``fused.PROCESS``. Each test gets a fresh one, so what
one test compiled, refused or left warming cannot decide what another runs (issue 38: a file passed
alone and failed after another that had compiled kernels)."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _own_compiled_kernels(monkeypatch):
    from megatron_fp4.fp4 import fused

    store = fused.CompiledKernels()
    monkeypatch.setattr(fused, "PROCESS", store)
    yield store
    store.stop_warmups()


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """The test at one and at two intra-op threads (the bitwise kernels' claims hold at each;
    ``torch``'s thread count restored after)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
