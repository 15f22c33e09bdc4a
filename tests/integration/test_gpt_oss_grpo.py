"""GRPO runs on GPT-OSS: two steps of the one loop (`rl.loop.run_grpo`) with the in-process rollout
(KV-cache generation, FP4 MoEResQ experts on both sides, weights published under GPT-OSS's HF
names), every record finite, and a second run of the same seeds gives the same records bit for bit."""
import math

from tests.unit.test_packed_rl import tiny_grpo

GPT_OSS = ["logging.tensorboard_dir=null", "checkpoint.dir=null", "model.family=gpt_oss", "model.num_layers=2",
           "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=1", "model.moe_ffn_hidden_size=32",
           "model.num_experts=4", "model.layer_types=[sliding_attention,full_attention]", "model.sliding_window=4",
           "numerics.invariance=standard", "fp4.compile=off"]


def run_once():
    run, _ = tiny_grpo(GPT_OSS, 4)
    # every float record but the wall-clock ones (``*_s``)
    return [{k: v for k, v in h.items() if isinstance(v, float) and not k.endswith("_s")} for h in run.history]


def test_grpo_runs_and_is_deterministic():
    first, second = run_once(), run_once()
    assert len(first) == 2 and first[0]
    assert all(math.isfinite(v) for h in first for v in h.values())
    assert [{k: v.hex() for k, v in h.items()} for h in first] == [{k: v.hex() for k, v in h.items()} for h in second]
