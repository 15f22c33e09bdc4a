"""GRPO runs on GPT-OSS: two steps of the one loop (`rl.loop.run_grpo`) with the in-process rollout
(KV-cache generation, FP4 MoEResQ experts on both sides, weights published under GPT-OSS's HF
names), every record finite, and a second run of the same seeds gives the same records bit for bit."""
import math

from megatron_fp4.config import default_config_path, load_config
from megatron_fp4.rl import loop, make_rollout, switch_to_rl
from megatron_fp4.rl.tasks.catalog import ArithmeticTask
from megatron_fp4.training.trainer import Trainer

GPT_OSS = ["logging.tensorboard_dir=null", "checkpoint.dir=null", "model.family=gpt_oss", "model.num_layers=2",
           "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=1", "model.moe_ffn_hidden_size=32",
           "model.num_experts=4", "model.layer_types=[sliding_attention,full_attention]", "model.sliding_window=4",
           "numerics.invariance=standard", "fp4.compile=off"]


class LengthTask(ArithmeticTask):
    """Rewards that vary inside every group (the completion's length), so advantages are not 0."""

    def reward(self, item, completion: str) -> float:
        return float(len(completion))


def run_once():
    task = LengthTask(eval_size=4, max_operand=9, ops="+", seed=0)
    cfg = load_config(str(default_config_path()), GPT_OSS + [f"model.vocab_size={task.tok.vocab_size}"])
    trainer = Trainer(cfg, build_data=False)
    switch_to_rl(trainer, 1e-2, 0.0, 0.0)
    settings = loop.GRPOSettings(steps=2, num_prompts=2, group_size=4, max_new_tokens=4, micro_batch_size=8,
                                 eval_every=0)
    rollout = make_rollout("engine", trainer, task.tok.pad_id, 1 << 20)
    try:
        run = loop.run_grpo(trainer, task, rollout, settings)
    finally:
        rollout.close()
    # every float record but the wall-clock ones (``*_s``)
    return [{k: v for k, v in h.items() if isinstance(v, float) and not k.endswith("_s")} for h in run.history]


def test_grpo_runs_and_is_deterministic():
    first, second = run_once(), run_once()
    assert len(first) == 2 and first[0]
    assert all(math.isfinite(v) for h in first for v in h.values())
    assert [{k: v.hex() for k, v in h.items()} for h in first] == [{k: v.hex() for k, v in h.items()} for h in second]
