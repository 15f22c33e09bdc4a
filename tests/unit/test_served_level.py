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


@pytest.mark.parametrize("level", ["standard", "batch", "exact"])
def test_the_actor_computes_at_the_level_the_plugin_serves(tmp_path, level):
    cfg = Config()
    cfg.numerics.invariance = level
    block = quant_sidecar(cfg)
    assert block["numerics_level"] == level and served_level(block) == level  # the plugin serves every level
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "quantization_config": block}))
    assert checkpoint_numerics_level(tmp_path, "qwen3_moe") == level


@pytest.mark.parametrize("flag,served", [(True, "exact"), (False, "standard")])
def test_a_block_written_before_the_levels_is_served_as_it_was(flag, served):
    """Older exports record only `batch_invariant`: true was served at `exact`, false at `standard`."""
    block = quant_sidecar(Config())
    del block["numerics_level"]
    assert served_level({**block, "batch_invariant": flag}) == served


def test_an_unknown_level_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="numerics_level='fast' is not one of .*re-export"):
        served_level({**quant_sidecar(Config()), "numerics_level": "fast"})


def test_a_checkpoint_without_the_plugins_block_gets_the_project_default(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe",
                                                      "quantization_config": {"quant_method": "fp8"}}))
    assert checkpoint_numerics_level(tmp_path, "qwen3_moe") == Config().numerics.invariance
