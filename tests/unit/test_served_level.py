"""The numerics level a checkpoint's rollout is served at decides the verl actor's level.

`integrations.vllm.sidecar.served_level` reads the export's quantization_config block (what the vLLM
plugin computes at); `verl.construct.checkpoint_numerics_level` gives the actor and verl's own-engine
rollout that level, so the actor's old log-probs are scored with the same logits bits vLLM sampled
from (tests/integration/test_verl_ppo_vllm.py measures it end to end)."""
from __future__ import annotations

import json

import pytest

from megatron_fp4.config import Config
from megatron_fp4.integrations.vllm import quant_sidecar
from megatron_fp4.integrations.vllm.sidecar import served_level

pytest.importorskip("verl", reason="verl is not installed: pip install -e '.[verl]'")
from megatron_fp4.verl.construct import checkpoint_numerics_level  # noqa: E402


@pytest.mark.parametrize("level,served", [("standard", "standard"), ("batch", "exact"), ("exact", "exact")])
def test_the_actor_computes_at_the_level_the_plugin_serves(tmp_path, level, served):
    cfg = Config()
    cfg.numerics.invariance = level
    block = quant_sidecar(cfg)
    assert served_level(block) == served
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "quantization_config": block}))
    assert checkpoint_numerics_level(tmp_path, "qwen3_moe") == served


def test_a_checkpoint_without_the_plugins_block_gets_the_project_default(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe",
                                                      "quantization_config": {"quant_method": "fp8"}}))
    assert checkpoint_numerics_level(tmp_path, "qwen3_moe") == Config().numerics.invariance
