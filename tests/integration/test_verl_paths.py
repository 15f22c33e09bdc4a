"""The engine driven through verl 0.9's own paths (no Ray, CPU): `EngineRegistry.new` with the four
configs verl's `TrainingWorker` passes, the no-padding batch layout of verl's trainer
(`left_right_2_no_padding` / `no_padding_2_padding`), verl's own `ppo_loss` and its `Metric`s."""
import asyncio
import copy
from functools import partial
from types import SimpleNamespace

import pytest
import torch

import verl  # the test extra installs it: a missing package fails, never skips

from tensordict import TensorDict  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.metric import Metric  # noqa: E402
from verl.workers.config import FSDPActorConfig, HFModelConfig, OptimizerConfig  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from megatron_fp4.config import Config  # noqa: E402
from megatron_fp4.integrations.hf import save_hf_checkpoint, to_hf_state_dict  # noqa: E402
from megatron_fp4.verl import MegatronFP4Engine, MegatronFP4Rollout  # noqa: E402
from megatron_fp4.verl.construct import MegatronFP4EngineConfig  # noqa: E402
from megatron_fp4.model import build_model  # noqa: E402
from megatron_fp4.rollout import RolloutEngine  # noqa: E402
from megatron_fp4.rollout.engine import left_pad  # noqa: E402
from megatron_fp4.training.data import ArithmeticTokenizer  # noqa: E402

TOK = ArithmeticTokenizer()


def tiny_cfg():
    c = Config()
    c.model.vocab_size = TOK.vocab_size
    c.model.num_layers = 2
    c.logging.tensorboard_dir = None
    return c


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Qwen3-MoE saved HF-style with this project's exporter (nothing downloaded)."""
    c = tiny_cfg()
    model = build_model(c, seed=7)
    return save_hf_checkpoint(model, c, tmp_path_factory.mktemp("hf") / "qwen3_moe_tiny"), model


def verl_engine(path, **engine_kw):
    """What verl's TrainingWorker does: EngineRegistry.new with the four configs, then initialize()."""
    engine = EngineRegistry.new(model_type="language_model", backend="megatron_fp4",
                                model_config=HFModelConfig(path=str(path), load_tokenizer=False),
                                engine_config=MegatronFP4EngineConfig(**engine_kw),
                                optimizer_config=OptimizerConfig(lr=2e-3, weight_decay=0.0, clip_grad=0.5),
                                checkpoint_config=CheckpointConfig())
    return engine.initialize()


def rollout_batch(engine, texts):
    rollout = MegatronFP4Rollout(engine=RolloutEngine(copy.deepcopy(engine.model)), stop_token_ids=(TOK.eos_id,))
    asyncio.run(rollout.resume(["weights"]))
    ids, mask = left_pad([TOK.encode(t, add_eos=False) for t in texts], TOK.pad_id)
    from verl import DataProto
    proto = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask},
                                meta_info={"response_length": 5, "seeds": list(range(len(texts)))})
    return rollout.generate_sequences(proto).batch


def test_registry_new_builds_the_hf_model_and_loads_its_weights(hf_dir):
    path, source = hf_dir
    engine = verl_engine(path, fp4={"train_mode": "fp4"}, micro_batch_size_per_gpu=2)
    assert isinstance(engine, MegatronFP4Engine)
    assert engine.cfg.model.num_layers == 2 and engine.cfg.fp4.train_mode == "fp4"
    assert engine.cfg.optimizer.lr == 2e-3 and engine.cfg.optimizer.clip_grad == 0.5
    assert engine.micro_batch_size == 2 and engine.get_data_parallel_size() == 1
    ours, ref = to_hf_state_dict(engine.model), to_hf_state_dict(source)
    assert ours.keys() == ref.keys()
    assert all(torch.equal(ours[k], ref[k]) for k in ref)
    with pytest.raises(ValueError, match="model_config.path"):
        MegatronFP4Engine(model_config=SimpleNamespace(path=str(path.parent)))


def test_no_padding_batches_give_verl_layout_log_probs_and_entropy(hf_dir):
    engine = verl_engine(hf_dir[0], micro_batch_size_per_gpu=2)
    b = rollout_batch(engine, ["12+7=", "3*4=", "100-99=", "5+5="])
    with engine.eval_mode():
        padded = engine.infer_batch(b)["model_output"]["log_probs"]
    td = left_right_2_no_padding(TensorDict(dict(b.items()), batch_size=b.batch_size))
    tu.assign_non_tensor(td, calculate_entropy=True)
    with engine.eval_mode():
        out = engine.infer_batch(td)["model_output"]
    assert out["log_probs"].is_nested and out["entropy"].is_nested
    lp, ent = no_padding_2_padding(out["log_probs"], td), no_padding_2_padding(out["entropy"], td)
    mask = b["response_mask"].bool()
    assert lp.shape == padded.shape
    # same tokens, same weights; the batches differ only in where the padding sits, and the no-grad
    # scoring is batch-invariant (numerics.invariance: batch): the same bits
    assert mask.any() and torch.equal(lp[mask], padded[mask])
    assert torch.all(ent[mask] > 0) and torch.all(ent[mask] <= torch.log(torch.tensor(float(TOK.vocab_size))) + 1e-5)


def test_verl_ppo_loss_and_metrics_through_train_batch(hf_dir):
    engine = verl_engine(hf_dir[0], micro_batch_size_per_gpu=2)
    b = rollout_batch(engine, ["12+7=", "3*4=", "5+5=", "9*9="])
    with engine.eval_mode():
        b["old_log_probs"] = engine.infer_batch(b)["model_output"]["log_probs"]
    b["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand_as(b["old_log_probs"]).clone()
    td = left_right_2_no_padding(TensorDict(dict(b.items()), batch_size=b.batch_size))
    tu.assign_non_tensor(td, calculate_entropy=True, global_batch_size=4)
    actor = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                            use_dynamic_bsz=False, entropy_coeff=0.01, rollout_n=1)
    before = [p.detach().clone() for p in engine.model.parameters()]
    with engine.train_mode():
        out = engine.train_batch(td, partial(ppo_loss, actor))
    m = out["metrics"]
    assert isinstance(m["actor/pg_loss"], Metric) and len(m["actor/pg_loss"].values) == 2
    assert m["grad_norm"] > 0 and len(out["loss"]) == 2
    assert any(not torch.equal(a, p) for a, p in zip(before, engine.model.parameters()))


def test_get_per_tensor_param_yields_the_hf_exporters_names_and_the_rollout_loads_them(hf_dir):
    path, source = hf_dir
    engine = verl_engine(path)
    named, peft = engine.get_per_tensor_param()
    named = dict(named)
    assert peft is None
    ref = to_hf_state_dict(source)  # the HF exporter's names: model.layers.0.mlp.experts.0.gate_proj.weight, ...
    assert named.keys() == ref.keys() and all(torch.equal(named[k], ref[k]) for k in ref)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in named
    rollout = MegatronFP4Rollout(engine=RolloutEngine(build_model(tiny_cfg(), seed=1), name="r0"))
    asyncio.run(rollout.update_weights(iter(named.items()), global_steps=5))
    assert rollout.engine.version == 5
    for a, b in zip(engine.model.state_dict().values(), rollout.engine.model.state_dict().values()):
        assert torch.equal(a, b)
    bad = {k: v for k, v in named.items() if "experts.0." not in k}
    with pytest.raises(ValueError, match="rejects the weights.*missing keys"):
        asyncio.run(rollout.update_weights(iter(bad.items()), global_steps=6))
    assert rollout.engine.version == 5


def test_rollout_from_verls_registry_and_constructor_honours_eos_and_pad(hf_dir):
    from verl import DataProto
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.base import get_rollout_class

    path, source = hf_dir
    cls = get_rollout_class("megatron_fp4", "async")
    assert cls is MegatronFP4Rollout
    rollout = cls(config=RolloutConfig(name="megatron_fp4", response_length=4, do_sample=False),
                  model_config=HFModelConfig(path=str(path), load_tokenizer=False), device_mesh=None)
    for a, b in zip(rollout.engine.model.state_dict().values(), source.state_dict().values()):
        assert torch.equal(a, b)
    ids, mask = left_pad([TOK.encode(t, add_eos=False) for t in ["12+7=", "3*4="]], TOK.pad_id)

    def generate(**meta):
        return rollout.generate_sequences(DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask},
                                                              meta_info=meta)).batch
    free = generate(eos_token_id=[], pad_token_id=TOK.pad_id)  # greedy (config do_sample=False), 4 tokens
    assert free["responses"].shape == (2, 4) and free["response_mask"].sum() == 8
    eos = int(free["responses"][0, 0])
    out = generate(eos_token_id=eos, pad_token_id=TOK.vocab_size - 1)
    assert out["response_mask"][0].tolist() == [1, 0, 0, 0] and out["responses"][0, 0] == eos
    assert torch.all(out["responses"][0, 1:] == TOK.vocab_size - 1)


def test_receive_weights_returns_at_once_and_the_stream_awaits_the_version(hf_dir):
    """verl's rollout worker calls `receive_weights` without awaiting and hands the stream to the
    rollout's async `update_weights`, on the same event loop as everything else: the call must not
    block until the actor publishes."""
    from megatron_fp4.verl import MegatronFP4CheckpointEngine

    engine = verl_engine(hf_dir[0])
    actor_ce = MegatronFP4CheckpointEngine(bucket_size=4096, channel="test-async", timeout_s=5)
    rollout_ce = MegatronFP4CheckpointEngine(bucket_size=4096, channel="test-async", timeout_s=5)
    kw_a, kw_r = MegatronFP4CheckpointEngine.build_topology(1, 1, [actor_ce.prepare(), rollout_ce.prepare()])
    actor_ce.init_process_group(**{k: v[0] for k, v in kw_a.items()})
    rollout_ce.init_process_group(**{k: v[0] for k, v in kw_r.items()})
    rollout = MegatronFP4Rollout(engine=RolloutEngine(build_model(tiny_cfg(), seed=3), name="r-async"))

    async def step():
        stream = rollout_ce.receive_weights(global_steps=2)  # before anything is published, on the loop
        return await asyncio.gather(actor_ce.send_weights(engine.get_per_tensor_param()[0], global_steps=2),
                                    rollout.update_weights(stream, global_steps=2))
    metrics, _ = asyncio.run(step())
    assert rollout.engine.version == 2 and metrics["weight_sync/bytes"] > 0
    for a, b in zip(engine.model.state_dict().values(), rollout.engine.model.state_dict().values()):
        assert torch.equal(a, b)
    for ce in (actor_ce, rollout_ce):
        ce.finalize()


def test_verls_default_actor_tree_configures_the_engine(hf_dir):
    """What `actor.strategy=megatron_fp4` hands the engine with verl's default actor config: an
    FSDPEngineConfig (dtype named as torch names it) and FSDPOptimizerConfig. The lr follows verl's
    own schedulers (the reference: verl's LambdaLRs over a dummy optimizer)."""
    from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig

    from megatron_fp4.verl import config_from_verl
    from megatron_fp4.training.optim import lr_at

    def actor(dtype="bfloat16", **optim):
        optim.setdefault("lr", 1e-3)  # verl's path: the actor config's engine is its fsdp_config
        a = FSDPActorConfig(strategy="megatron_fp4", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2,
                            rollout_n=1, fsdp_config=FSDPEngineConfig(dtype=dtype), optim=FSDPOptimizerConfig(**optim))
        assert a.engine.strategy == "megatron_fp4"
        return a.engine, a.optim

    model_config = HFModelConfig(path=str(hf_dir[0]), load_tokenizer=False)
    total = 6
    for kind, ratio, make in (("constant", 0.0, lambda o: get_constant_schedule_with_warmup(o, 0)),
                              ("cosine", 0.1, lambda o: get_cosine_schedule_with_warmup(o, 0, total, min_lr_ratio=0.1))):
        cfg = config_from_verl(model_config, *actor(lr=1e-3, lr_scheduler_type=kind, min_lr_ratio=ratio,
                                                    total_training_steps=total))
        assert cfg.dtype == "bf16" and cfg.model.router_aux_loss_coef == cfg.model.router_z_loss_coef == 0.0
        dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
        sched = make(dummy)
        for step in range(total + 1):
            assert lr_at(step, cfg.optimizer, cfg.schedule) == pytest.approx(dummy.param_groups[0]["lr"], rel=1e-12), (kind, step)
            dummy.step()
            sched.step()
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        # verl's own optimizer configs allow only constant|cosine; another config class may carry more
        config_from_verl(model_config, actor()[0], SimpleNamespace(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999),
                                                                  clip_grad=1.0, lr_scheduler_type="linear"))
    with pytest.raises(ValueError, match="dtype='float16'"):
        config_from_verl(model_config, actor(dtype="float16")[0])
