"""verl adapters against the installed verl package (no Ray): registries, the checkpoint engine's
two completion points and faults, the rollout's DataProto contract, the training engine's
log-probs and update, and the truncated-IS loss option."""
import asyncio
import copy

import pytest
import torch

import verl  # the test extra installs it: a missing package fails, never skips

from verl import DataProto  # noqa: E402
from verl.checkpoint_engine.base import CheckpointEngineRegistry  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402

from megatron_fp4.config import Config  # noqa: E402
from megatron_fp4.verl import (MegatronFP4CheckpointEngine, MegatronFP4Engine,  # noqa: E402
                               MegatronFP4Rollout, make_policy_loss_fn, truncated_is_weights)
from megatron_fp4.model import build_model  # noqa: E402
from megatron_fp4.rollout import RolloutEngine, WeightSyncError  # noqa: E402
from megatron_fp4.rollout.engine import left_pad  # noqa: E402
from megatron_fp4.training.data import ArithmeticTokenizer  # noqa: E402

TOK = ArithmeticTokenizer()


def cfg():
    c = Config()
    c.model.vocab_size = TOK.vocab_size
    c.logging.tensorboard_dir = None
    return c


def prompts_proto(texts, seeds=None, **meta):
    ids, mask = left_pad([TOK.encode(t, add_eos=False) for t in texts], TOK.pad_id)
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask},
                               meta_info={"response_length": 6, "seeds": seeds or list(range(len(texts))), **meta})


def test_registered_under_our_name():
    assert CheckpointEngineRegistry.get("megatron_fp4") is MegatronFP4CheckpointEngine
    assert EngineRegistry.get_engine_cls("language_model", "megatron_fp4") is MegatronFP4Engine


def _sync(actor_ce, rollout_ce, rollout, weights, version):
    async def rollout_side():
        stream = await asyncio.to_thread(rollout_ce.receive_weights, version)
        try:
            await rollout.update_weights(stream, global_steps=version)
        except ValueError:
            pass  # the failure reaches the actor through the ack

    async def both():
        return (await asyncio.gather(actor_ce.send_weights(weights, global_steps=version), rollout_side()))[0]
    return asyncio.run(both())


def _engines(channel):
    actor_ce = MegatronFP4CheckpointEngine(bucket_size=4096, channel=channel, timeout_s=30)
    rollout_ce = MegatronFP4CheckpointEngine(bucket_size=4096, channel=channel, timeout_s=30)
    actor_kw, rollout_kw = MegatronFP4CheckpointEngine.build_topology(1, 1, [actor_ce.prepare(), rollout_ce.prepare()])
    actor_ce.init_process_group(**{k: v[0] for k, v in actor_kw.items()})
    rollout_ce.init_process_group(**{k: v[0] for k, v in rollout_kw.items()})
    return actor_ce, rollout_ce


def test_checkpoint_engine_delivers_whole_versions_and_reports_failures():
    trainer = MegatronFP4Engine(cfg=cfg()).initialize()
    rollout = MegatronFP4Rollout(engine=RolloutEngine(build_model(cfg(), seed=99), name="r0"))
    actor_ce, rollout_ce = _engines("test-ok")
    metrics = _sync(actor_ce, rollout_ce, rollout, trainer.get_per_tensor_param()[0], 3)
    assert rollout.engine.version == 3 and metrics["weight_sync/snapshot_s"] > 0 and metrics["weight_sync/load_s"] > 0
    for a, b in zip(trainer.model.state_dict().values(), rollout.engine.model.state_dict().values()):
        assert torch.equal(a, b)
    # a rollout built for another config rejects the manifest: error at the actor, version kept
    other = cfg()
    other.model.hidden_size = 32
    bad = MegatronFP4Rollout(engine=RolloutEngine(build_model(other, seed=1), name="r-small"))
    actor_ce, rollout_ce = _engines("test-bad")
    with pytest.raises(WeightSyncError, match="version 4.*rejects the weights"):
        _sync(actor_ce, rollout_ce, bad, trainer.get_per_tensor_param()[0], 4)
    assert bad.engine.version == 0
    for ce in (actor_ce, rollout_ce):
        ce.finalize()


def test_rollout_generate_sequences_and_engine_log_probs_agree():
    c = cfg()
    trainer = MegatronFP4Engine(cfg=c, micro_batch_size=2).initialize()
    rollout = MegatronFP4Rollout(engine=RolloutEngine(copy.deepcopy(trainer.model), mode=c.fp4.rollout_mode),
                                 stop_token_ids=(TOK.eos_id,))
    asyncio.run(rollout.resume(["weights", "kv_cache"]))
    out = rollout.generate_sequences(prompts_proto(["12+7=", "3*4=", "100-99="], return_routing=True))
    b = out.batch
    assert b["responses"].shape == (3, 6) and b["input_ids"].shape == (3, b["prompts"].shape[1] + 6)
    P = b["prompts"].shape[1]
    assert b["routed_experts"].shape[:2] == (3, P + 6) and out.meta_info["weight_version"] == 0
    replayed = (b["routed_experts"] >= 0).all(-1).all(-1)  # verl's layout: at the producing positions
    assert torch.equal(replayed[:, P - 1:P + 5], b["response_mask"].bool()) and not replayed[:, :P - 1].any()
    assert torch.all(b["rollout_log_probs"][b["response_mask"] == 0] == 0)
    with trainer.eval_mode():
        old = trainer.infer_batch(b)["model_output"]["log_probs"]
    # same weights, train_mode == rollout_mode == fp4_resq, and both sides batch-invariant (the
    # engine's default; the trainer's no-grad scoring): the same bits on every response token
    keep = b["response_mask"] == 1
    assert keep.any() and torch.equal(old[keep], b["rollout_log_probs"][keep])
    asyncio.run(rollout.release())
    with pytest.raises(RuntimeError, match="resume"):
        rollout.generate_sequences(prompts_proto(["1+1="]))


def test_training_engine_update_with_truncated_is():
    c = cfg()
    trainer = MegatronFP4Engine(cfg=c, micro_batch_size=2).initialize()
    rollout = MegatronFP4Rollout(engine=RolloutEngine(copy.deepcopy(trainer.model)))
    b = rollout.generate_sequences(prompts_proto(["12+7=", "3*4=", "5+5=", "9*9="])).batch
    with trainer.eval_mode():
        b["old_log_probs"] = trainer.infer_batch(b)["model_output"]["log_probs"]
    b["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with trainer.train_mode():
        out = trainer.train_batch(b, make_policy_loss_fn(clip_eps=0.2, tis_cap=2.0))
    assert out["metrics"]["grad_norm"] > 0 and 0 < out["metrics"]["actor/tis_weight_mean"] <= 2.0
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))


def test_truncated_is_weights_reference():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    roll = torch.tensor([[-1.5, -1.0, -3.0]])
    w = truncated_is_weights(old, roll, cap=2.0)
    ref = torch.tensor([[min(2.0, torch.e ** 0.5), torch.e ** -1.0, 2.0]])
    torch.testing.assert_close(w, ref, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(old, roll, cap=0)
