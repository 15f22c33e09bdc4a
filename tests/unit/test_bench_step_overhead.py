"""benchmarks/bench_step_overhead.py: both sides load the same random HF checkpoint (so its ratios
compare like with like), and its --quick run prints every runner's row (no times asserted)."""
import argparse
import os
import sys
import tempfile

import torch
import transformers  # noqa: F401 - the test extra installs it: a missing package fails, never skips

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import bench_step_overhead as bench  # noqa: E402
from megatron_fp4.config import default_config_path, load_config  # noqa: E402


def test_trainer_and_hf_hold_the_checkpoints_weights():
    args = argparse.Namespace(config=str(default_config_path()), overrides=[], modes=["off"], profile=False)
    with tempfile.TemporaryDirectory() as ckpt:
        cfg = load_config(args.config, bench.SHAPES["quick"] + bench.QUIET)
        bench.write_random_hf_checkpoint(cfg.model, ckpt, seed=0)
        runners, trainers = bench.build_runners(args, bench.SHAPES["quick"], ckpt)
    model, hf = trainers["off"].model.eval(), runners["hf"].hf.eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens).logits, hf(input_ids=tokens).logits
    # fp32 summation-order differences only (tests/integration/test_hf_parity.py's 1e-5 argument)
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() <= 1e-5
    # the Trainer's parameters are still views of its optimizer's flat buffer (loaded in place)
    buf = trainers["off"].optimizer.buffers[0]
    assert buf.params[0].data_ptr() == buf.data.data_ptr() + buf.offsets[0] * buf.data.element_size()


def test_quick_run_prints_every_runner(capsys):
    results = bench.main(["--quick"])
    rows = {"hf", "trainer off", "bare off", "trainer fp4_resq", "bare fp4_resq"}
    assert set(results["quick"]) == rows and all(t > 0 for t in results["quick"].values())
    out = capsys.readouterr().out
    assert all(row in out for row in rows) and "Trainer step / bare model step, off" in out


def test_quick_experts_table_prints_a_row_per_count(capsys):
    """--experts: per expert count HF and each Trainer mode, tokens/s and the ratio to HF (top-k
    capped at the count), in one table; --clock cpu times in process CPU time."""
    results = bench.main(["--quick", "--experts", "2,4", "--modes", "off", "--clock", "cpu"])
    assert set(results["experts"]) == {2, 4}
    assert all(set(r) == {"hf", "trainer off"} and all(v > 0 for v in r.values()) for r in results["experts"].values())
    out = capsys.readouterr().out
    assert "[experts]" in out and "[2 experts] tokens/s, trainer off vs HF" in out
