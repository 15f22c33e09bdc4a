"""Issue 36, rows on outputs: no tool deletes or writes into its own input (`to-hf RUN/checkpoints RUN
--overwrite` used to leave RUN holding only the export), an overwrite replaces only a former export
(never a directory with subdirectories or checkpoint files), and an output path that is a file is
one line, exit 2 (from-hf used to end in a FileExistsError traceback).
"""
import shutil

import pytest

from megatron_fp4.integrations.hf import save_hf_checkpoint
from megatron_fp4.training.checkpoint import directory as ckpt
from tests.faults.test_bad_input_checkpoint import _convert, _tiny_cfg, saved_root  # noqa: F401 (fixture)
from tests.faults.test_bad_input_config import _assert_one_line

pytestmark = pytest.mark.faults


@pytest.fixture
def run_dir(saved_root, tmp_path):  # noqa: F811
    """RUN/checkpoints/step_00000000 plus another file of the run."""
    run = tmp_path / "run"
    shutil.copytree(saved_root, run / "checkpoints")
    (run / "notes.txt").write_text("keep me")
    return run


def _tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("out", ["run", "run/checkpoints", "run/checkpoints/step_00000000", "run/checkpoints/hf"])
def test_to_hf_never_writes_over_or_into_its_input(run_dir, out):
    before = _tree(run_dir)
    proc = _convert("to-hf", run_dir / "checkpoints", run_dir.parent / out, "--overwrite")
    _assert_one_line(proc, repr(str(run_dir.parent / out)), "the input", "choose an output directory outside it")
    assert _tree(run_dir) == before


def test_overwrite_replaces_only_a_former_export(run_dir, tmp_path):
    """The shared `replace_dir` refuses, whoever calls it (the Python API here, no inputs named)."""
    from megatron_fp4.model import build_model

    cfg = _tiny_cfg()
    model = build_model(cfg)
    before = _tree(run_dir)
    for target, needle in ((run_dir, "'checkpoints' (a subdirectory or link)"),
                           (run_dir / "checkpoints" / "step_00000000", "(a checkpoint file)")):
        with pytest.raises(ValueError, match=rf"holds .*{needle.replace('(', '[(]').replace(')', '[)]')}"):
            save_hf_checkpoint(model, cfg, target, overwrite=True)
    assert _tree(run_dir) == before
    with pytest.raises(ValueError, match="is inside the input"):
        ckpt.replace_dir(tmp_path / "x", run_dir / "checkpoints" / "hf", inputs=(run_dir / "checkpoints",))
    out = save_hf_checkpoint(model, cfg, tmp_path / "hf")  # a former export is still replaced
    assert save_hf_checkpoint(model, cfg, out, overwrite=True) == out and _tree(out) == ["config.json",
                                                                                         "model.safetensors"]


def test_from_hf_and_upgrade_refuse_a_file_or_their_input_as_output(tmp_path):
    from megatron_fp4.model import build_model

    cfg = _tiny_cfg()
    hf = save_hf_checkpoint(build_model(cfg), cfg, tmp_path / "hf")
    (tmp_path / "afile").write_text("x")
    _assert_one_line(_convert("from-hf", hf, tmp_path / "afile"), "afile' exists and is not a directory")
    _assert_one_line(_convert("from-hf", hf, tmp_path / "afile" / "sub"), "Not a directory")
    _assert_one_line(_convert("from-hf", hf, hf), "is the input", "outside it")
    _assert_one_line(_convert("upgrade", hf, hf / "new"), "is inside the input")
    assert (tmp_path / "afile").read_text() == "x" and _tree(hf) == ["config.json", "model.safetensors"]
