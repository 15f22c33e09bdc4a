"""Weight sync publishes under the model family's HF names (Qwen3-MoE, GPT-OSS) everywhere: the in-process rollout's publisher too
(it used to publish our own parameter names while the remote, vLLM and verl ones sent HF names);
its receiver maps them back and the engine ends up with the trainer's weights, bitwise."""
import types

import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.integrations.hf import to_hf_state_dict
from megatron_fp4.model import build_model
from megatron_fp4.rl.rollouts.client import InProcessRollout


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_in_process_publisher_sends_hf_names(family):
    cfg = Config()
    cfg.model.num_layers, cfg.model.vocab_size = 2, 32
    if family == "qwen3_moe":
        cfg.model.dense_layers = [0]
    else:
        cfg.model.family, cfg.numerics.invariance = "gpt_oss", "standard"
    trainer = types.SimpleNamespace(cfg=cfg, model=build_model(cfg, seed=1))
    rollout = InProcessRollout(trainer, pad_id=0, bucket_bytes=1 << 12)
    receiver = rollout.publisher.transports[0].receiver
    manifests = []
    load = receiver.load
    receiver.load = lambda version, manifest, buckets: (manifests.append(manifest), load(version, manifest, buckets))
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.5)  # the engine's copy differs until the publish
    rollout.publish(3).wait_loaded(60)
    hf = to_hf_state_dict(trainer.model)
    (manifest,) = manifests
    assert list(manifest) == list(hf)  # HF names, in to_hf_state_dict's order
    assert set(manifest) & set(dict(trainer.model.named_parameters())) == {"lm_head.weight"}  # the one name in common
    assert rollout.served_version() == 3
    for name, t in to_hf_state_dict(rollout.engine.model).items():
        assert torch.equal(t, hf[name]), name
