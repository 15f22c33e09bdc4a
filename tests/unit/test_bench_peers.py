"""The benchmarks' HF peer holds our model's function (so their ratios compare like with like),
and the sweep writes its table and plot."""
import os
import sys

import torch
import transformers  # noqa: F401 - the test extra installs it: a missing package fails, never skips

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import hf_peer  # noqa: E402
import sweep  # noqa: E402
from megatron_fp4.config import Config  # noqa: E402
from megatron_fp4.model import build_model  # noqa: E402
from megatron_fp4.rollout import RolloutEngine, SamplingParams  # noqa: E402


def test_hf_peer_computes_our_function_and_generates_our_greedy_tokens():
    cfg = Config()
    cfg.model.vocab_size, cfg.model.num_layers, cfg.model.init_std = 64, 2, 0.1
    cfg.fp4.scope = "none"
    model = build_model(cfg, seed=0).eval()
    hf = hf_peer.hf_model_like(model).eval()
    tokens = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens).logits, hf(input_ids=tokens).logits
    # fp32 summation-order differences only (tests/integration/test_hf_parity.py's 1e-5 argument)
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() <= 1e-5
    out = RolloutEngine(model, mode="bf16", invariance="standard").generate(
        tokens.tolist(), SamplingParams(temperature=0.0, max_new_tokens=6))
    step = hf_peer.HFTrainStep(hf, cfg.optimizer)
    step([{"tokens": tokens, "labels": tokens}])  # one AdamW step moves HF's weights away from ours
    step.load_from(model)  # ... and load_from brings ours back in
    with torch.no_grad():
        assert ((hf.eval()(input_ids=tokens).logits - ours).abs().max() / ours.abs().max()).item() <= 1e-5
    ref = hf_peer.hf_generate(hf, tokens, 6)
    assert ref.shape == (3, 6)
    # a greedy token can differ only at a near tie of the two largest logits (within fp32 noise)
    assert sum(a == b for r, h in zip(out.response_ids, ref.tolist()) for a, b in zip(r, h)) >= 16


def test_sweep_writes_table_and_plot(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "OUT_DIR", str(tmp_path))
    axes = {"batch": [1, 2]}
    results = [{"axis": "batch", "batch": 1, "runner": "bf16", "tokens_per_s": 10.0, "peak_mib": 5.0},
               {"axis": "batch", "batch": 2, "runner": "bf16", "tokens_per_s": 18.0, "peak_mib": 9.0}]
    sweep._write("unit", {"batch": 1}, axes, ["bf16", "hf"], results)
    md = (tmp_path / "bench_unit_sweep.md").read_text()
    assert "| 2 | 18.0 | 9 | — | — |" in md
    assert (tmp_path / "bench_unit_sweep.png").stat().st_size > 1000
