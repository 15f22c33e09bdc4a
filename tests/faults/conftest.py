import pytest


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory):
    """{step: loss hex} of the launcher tests' tiny job run through train.sh without a fault (once
    per session: the elastic-restart and preemption tests compare against it)."""
    from tests.faults._launchers import reference_losses

    return reference_losses(tmp_path_factory.mktemp("launch_reference"))
