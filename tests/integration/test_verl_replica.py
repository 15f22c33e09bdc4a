"""The rollout replica through verl's `RolloutReplicaRegistry` and the server contract verl's agent
loop uses (`server.generate.remote(prompt_ids=..., sampling_params=..., request_id=...)` ->
`TokenOutput`), on CPU without Ray: Ray's `__ray_call__` (run a function on the actor instance) is
played by `LocalActor`, the worker by an object holding the rollout as verl's hybrid worker does
(`ActorRolloutRefWorker.rollout`, built by verl's `get_rollout_class` and constructor)."""
import asyncio
from types import SimpleNamespace

import pytest
import torch

import verl  # noqa: F401 - the test extra installs it: a missing package fails, never skips

from verl import DataProto  # noqa: E402
from verl.workers.config import HFModelConfig, RolloutConfig  # noqa: E402
from verl.workers.rollout.base import get_rollout_class  # noqa: E402
from verl.workers.rollout.replica import TokenOutput, get_rollout_replica_class  # noqa: E402

from megatron_fp4.config import Config  # noqa: E402
from megatron_fp4.integrations.hf import save_hf_checkpoint  # noqa: E402
from megatron_fp4.verl import MegatronFP4Replica, MegatronFP4Server  # noqa: E402
from megatron_fp4.model import build_model  # noqa: E402
from megatron_fp4.training.data import ArithmeticTokenizer  # noqa: E402

TOK = ArithmeticTokenizer()


class LocalActor:
    """Ray's actor-handle contract for `__ray_call__`: `handle.__ray_call__.remote(fn, *args)` runs
    fn(actor_instance, *args) and returns an awaitable of the result."""

    def __init__(self, instance):
        async def remote(fn, *args):
            return fn(instance, *args)
        self.__ray_call__ = SimpleNamespace(remote=remote)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    c = Config()
    c.model.vocab_size, c.model.num_layers = TOK.vocab_size, 2
    path = save_hf_checkpoint(build_model(c, seed=11), c, tmp_path_factory.mktemp("hf") / "m")
    config = RolloutConfig(name="megatron_fp4", tensor_model_parallel_size=1, response_length=5, do_sample=False)
    model_config = HFModelConfig(path=str(path), load_tokenizer=False)
    rollout = get_rollout_class("megatron_fp4", "async")(config=config, model_config=model_config, device_mesh=None)
    return config, model_config, rollout


def test_replica_is_in_verls_registry_and_constructed_as_verl_constructs_replicas(setup):
    config, model_config, _ = setup
    cls = get_rollout_replica_class("megatron_fp4")
    assert cls is MegatronFP4Replica
    replica = cls(replica_rank=0, config=config, model_config=model_config, gpus_per_node=1)
    assert replica.world_size == 1 and replica.nnodes == 1 and replica.server_address is None


def test_server_generate_is_the_rollouts_generation_with_verls_sampling_params(setup):
    config, model_config, rollout = setup
    server = MegatronFP4Server(config=config, model_config=model_config, workers=[LocalActor(SimpleNamespace(rollout=rollout))])
    prompt = TOK.encode("12+7=", add_eos=False)
    # what verl's agent loop sends for a greedy request (vLLM names; top_k -1 = off)
    greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    out = asyncio.run(server.generate(prompt_ids=prompt, sampling_params=greedy, request_id="r0"))
    assert isinstance(out, TokenOutput) and len(out.token_ids) == 5 == len(out.log_probs)

    ids = torch.tensor([prompt])
    ref = rollout.generate_sequences(DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        meta_info={"eos_token_id": [], "do_sample": False})).batch
    n = int(ref["response_mask"][0].sum())
    assert out.token_ids == ref["responses"][0, :n].tolist()
    assert out.log_probs == ref["rollout_log_probs"][0, :n].tolist()  # same request, same engine: same bits

    # verl's batch path takes the same knobs from meta_info (else the RolloutConfig): top_k=1 sampling
    # at temperature 1 keeps only the argmax, so it reproduces the greedy answer whatever the seed
    sampled = rollout.generate_sequences(DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        meta_info={"eos_token_id": [], "do_sample": True, "temperature": 1.0, "top_k": 1, "seeds": [7]})).batch
    assert torch.equal(sampled["responses"], ref["responses"])
    top1 = asyncio.run(server.generate(prompt_ids=prompt, request_id="r1",
                                       sampling_params={**greedy, "temperature": 1.0, "top_k": 1, "seed": 3}))
    assert top1.token_ids == out.token_ids
    short = asyncio.run(server.generate(prompt_ids=prompt, sampling_params={**greedy, "max_tokens": 2}, request_id="r2"))
    assert short.token_ids == out.token_ids[:2]
    with pytest.raises(ValueError, match="repetition_penalty"):
        asyncio.run(server.generate(prompt_ids=prompt, sampling_params={**greedy, "repetition_penalty": 1.3},
                                    request_id="r3"))
    with pytest.raises(ValueError, match="text-only"):
        asyncio.run(server.generate(prompt_ids=prompt, sampling_params=greedy, request_id="r4", image_data=["x"]))

    asyncio.run(server.sleep())
    with pytest.raises(RuntimeError, match="resume"):
        asyncio.run(server.generate(prompt_ids=prompt, sampling_params=greedy, request_id="r5"))
    asyncio.run(server.wake_up())
    again = asyncio.run(server.generate(prompt_ids=prompt, sampling_params=greedy, request_id="r6"))
    assert again.token_ids == out.token_ids


def test_server_needs_one_worker_holding_the_rollout(setup):
    config, model_config, _ = setup
    with pytest.raises(ValueError, match="one worker process"):
        MegatronFP4Server(config=config, model_config=model_config, workers=[])
    server = MegatronFP4Server(config=config, model_config=model_config, workers=[LocalActor(SimpleNamespace())])
    with pytest.raises(ValueError, match="rollout.name=megatron_fp4"):
        asyncio.run(server.generate(prompt_ids=[1, 2], sampling_params={}, request_id="r"))
