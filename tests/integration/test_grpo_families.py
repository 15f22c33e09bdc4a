"""GRPO through the example (`examples/grpo_moeresq.py`) on the families beside Qwen3-MoE, chosen
by ``--set model.family=...``: DeepSeek-V3 (latent attention, a dense first layer, a shared expert,
group-limited sigmoid routing, aux-loss-free bias updates) and GPT-OSS (sinks, a sliding-window and
a full layer, biases); tiny models, FP4 MoEResQ (NVFP4) experts on both sides (the default config).

At the default numerics level (``batch``) with the own rollout engine (``--check-sync``), the rollout's log-probs of
every sampled token are the trainer's recomputed old log-probs bit for bit at every step (the
engine decodes with its KV cache in its own batches, the trainer scores full sequences), the same
experts chosen (agreement 1), including the step after the policy moved; the rewards are
`check_answer` of the decoded completions.
"""
import pytest
import torch

from megatron_fp4.training.data import check_answer
from tests.integration.test_grpo_example import load_example

FAMILY_SETS = {
    "deepseek_v3": ["model.family=deepseek_v3", "model.num_kv_heads=4", "model.q_lora_rank=16", "model.kv_lora_rank=16",
                    "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=12",
                    "model.moe_n_group=4", "model.moe_topk_group=2", "model.moe_routed_scaling_factor=2.5",
                    "model.num_shared_experts=1", "model.shared_expert_ffn_hidden_size=64", "model.dense_layers=[0]",
                    "model.moe_router_bias_update_rate=0.001"],
    "gpt_oss": ["model.family=gpt_oss", "model.layer_types=[sliding_attention,full_attention]",
                "model.sliding_window=3"],
}
LAYERS = {"deepseek_v3": {"MLAttention", "DeepseekV3Router"}, "gpt_oss": {"GptOssAttention", "GptOssExperts"}}


@pytest.mark.parametrize("family", list(FAMILY_SETS))
def test_grpo_example_runs_family_with_bitwise_rollout_parity(family, monkeypatch):
    ex = load_example()
    built = []
    real_make = ex.make_rollout

    def make_rollout(kind, trainer, *a, **k):
        rollout = real_make(kind, trainer, *a, **k)
        built.append((trainer, rollout))
        return rollout
    monkeypatch.setattr(ex, "make_rollout", make_rollout)
    sets = [x for s in FAMILY_SETS[family] + ["model.num_layers=2"] for x in ("--set", s)]
    args = ex.parse_args(["--task", "arithmetic", "--steps", "3", "--sft-steps", "2", "--num-prompts", "3",
                          "--group-size", "3", "--max-new-tokens", "4", "--eval-size", "6", "--eval-every", "0",
                          "--logdir", "", "--seed", "1", "--check-sync", *sets])
    history = ex.run(args)
    (trainer, rollout), = built
    assert trainer.cfg.model.family == family and trainer.cfg.numerics.invariance == "batch"
    for model in (trainer.model, rollout.engine.model):  # both sides really are the family's layers
        assert {type(m).__name__ for m in model.modules()} >= LAYERS[family]
    assert [h["rollout_version"] for h in history] == [0, 1, 2] and history[-1]["final_rollout_version"] == 3
    for h in history:
        assert h["lp_diffs"].numel() > 0 and torch.equal(h["lp_diffs"], torch.zeros_like(h["lp_diffs"]))
        assert (h["consistency/max_abs_diff"], h["consistency/expert_agreement"], h["consistency/kl"]) == (0, 1, 0)
        assert h["rewards"] == [float(check_answer(t, c)) for t, c in zip(h["texts"], h["completions"])]
    # the policy moved before the last step's rollout (a batch with a reward signal), so the last
    # parity is of published trained weights, not of the SFT ones
    signal = [any(len(set(h["rewards"][i:i + 3])) > 1 for i in range(0, 9, 3)) for h in history]  # groups of 3
    assert any(signal[:-1]), [h["rewards"] for h in history]
