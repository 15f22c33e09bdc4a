"""Weight names on the wire: the in-process rollout's copy keeps the model's own names (nothing
crosses a process boundary), and everything that does cross one (`hf_publisher`: the rollout
process, vLLM, vllm-serve) sends the model family's HF names (Qwen3-MoE, GPT-OSS), mapped back by
the receiver. Either way the engine ends up with the trainer's weights, bitwise."""
import types

import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.integrations.hf import to_hf_state_dict
from megatron_fp4.model import build_model
from megatron_fp4.rl.rollouts.client import InProcessRollout, hf_publisher
from megatron_fp4.rl.rollouts.worker import HFWeightReceiver
from megatron_fp4.rollout import InProcessTransport, RolloutEngine


def _trainer(family):
    cfg = Config()
    cfg.model.num_layers, cfg.model.vocab_size = 2, 32
    if family == "qwen3_moe":
        cfg.model.dense_layers = [0]
    else:
        cfg.model.family, cfg.numerics.invariance = "gpt_oss", "standard"
    return types.SimpleNamespace(cfg=cfg, model=build_model(cfg, seed=1),
                                 mesh=types.SimpleNamespace(is_distributed=False))


def _record(receiver) -> list:
    manifests, load = [], receiver.load
    receiver.load = lambda version, manifest, buckets: (manifests.append(manifest), load(version, manifest, buckets))
    return manifests


def _perturb(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)  # the engine's copy differs until the publish


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_in_process_rollout_sends_the_models_own_names(family):
    trainer = _trainer(family)
    rollout = InProcessRollout(trainer, pad_id=0, bucket_bytes=1 << 12)
    manifests = _record(rollout.publisher.transports[0].receiver)
    _perturb(trainer.model)
    rollout.publish(3).wait_loaded(60)
    (manifest,) = manifests
    assert list(manifest) == list(trainer.model.state_dict())
    assert rollout.served_version() == 3
    ours = rollout.engine.model.state_dict()
    for name, t in trainer.model.state_dict().items():
        assert torch.equal(ours[name], t), name
    assert rollout.digests()["version"] == 3


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_across_a_process_boundary_weights_go_under_hf_names(family):
    trainer = _trainer(family)
    engine = RolloutEngine(build_model(trainer.cfg, seed=2), pad_id=0, invariance="standard")
    receiver = HFWeightReceiver(engine)
    manifests = _record(receiver)
    publisher = hf_publisher(trainer, trainer.mesh, [InProcessTransport(receiver)], 1 << 12, 60.0)
    _perturb(trainer.model)
    publisher.publish(5).wait_loaded(60)
    hf = to_hf_state_dict(trainer.model)
    (manifest,) = manifests
    assert list(manifest) == list(hf)  # HF names, in to_hf_state_dict's order
    assert set(manifest) & set(dict(trainer.model.named_parameters())) == {"lm_head.weight"}  # the one name in common
    assert engine.version == 5
    for name, t in to_hf_state_dict(engine.model).items():
        assert torch.equal(t, hf[name]), name
