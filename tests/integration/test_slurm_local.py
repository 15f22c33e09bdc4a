"""Slurm for real (issue 17): tools/slurm_local_test.sh starts a single-node cluster on localhost
and checks that slurm_train.sbatch completes, survives SIGUSR1 (save, requeue, resume) and scancel
(save; resubmit resumes) with the uninterrupted job's losses. Skipped where Slurm and munge are not
installed (`apt-get install slurm-wlm munge`, ~20 s on Debian 12) or we are not root; a few
minutes on 2 cores, so not part of CI's install."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "slurm_local_test.sh"


@pytest.mark.skipif(not (shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("munged")),
                    reason="Slurm (slurm-wlm) and munge are not installed")
@pytest.mark.skipif(os.geteuid() != 0, reason="slurmd and munged need root")
@pytest.mark.timeout(900)
def test_sbatch_completes_requeues_and_resumes_under_real_slurm(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "slurm")], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "SLURM_NO_INSTALL": "1"})
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
