"""The rollout replica under real Ray on CPU, as verl's trainer starts it in hybrid mode:
`RolloutReplicaRegistry` -> `MegatronFP4Replica(...)`, `init_hybrid(worker_group)` (verl's code:
picks this replica's workers and calls our `launch_servers`), then requests through
`server_handle.generate.remote(...)` as verl's agent loop sends them, and verl's `sleep`/`wake_up`.
The worker is a Ray actor holding the rollout built by verl's `get_rollout_class` (the attribute
verl's hybrid worker uses), async like verl's workers. Slow: a local Ray instance takes tens of seconds."""
import asyncio
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

import ray  # a verl dependency; the test extra installs it: a missing package fails, never skips
import verl  # noqa: F401
pytestmark = pytest.mark.slow

TREE = str(Path(__file__).resolve().parents[2])  # workers import this checkout, as the test does


class _RolloutWorker:
    def __init__(self, path):
        import megatron_fp4.verl  # noqa: F401
        from verl.workers.config import HFModelConfig, RolloutConfig
        from verl.workers.rollout.base import get_rollout_class

        config = RolloutConfig(name="megatron_fp4", tensor_model_parallel_size=1, response_length=4, do_sample=False)
        self.rollout = get_rollout_class("megatron_fp4", "async")(
            config=config, model_config=HFModelConfig(path=path, load_tokenizer=False), device_mesh=None)

    async def reference(self, prompt_ids):
        import torch
        from verl import DataProto

        ids = torch.tensor([prompt_ids])
        return self.rollout.generate_sequences(DataProto.from_dict(
            tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
            meta_info={"eos_token_id": []})).batch["responses"][0].tolist()


def test_replica_launches_its_server_and_serves_verls_requests(tmp_path):
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.replica import get_rollout_replica_class

    import megatron_fp4.verl  # noqa: F401  (a verl run: VERL_USE_EXTERNAL_MODULES)
    from megatron_fp4.config import Config
    from megatron_fp4.integrations.hf import save_hf_checkpoint
    from megatron_fp4.model import build_model

    c = Config()
    c.model.vocab_size, c.model.num_layers = 18, 2
    path = str(save_hf_checkpoint(build_model(c, seed=1), c, tmp_path / "hf"))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}  # ray.init replaces them
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,  # a local instance: no skip if it fails
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([TREE, os.environ.get("PYTHONPATH", "")]),
                                       "OMP_NUM_THREADS": "1"}})
    try:
        worker = ray.remote(_RolloutWorker).options(num_cpus=0).remote(path)
        config = RolloutConfig(name="megatron_fp4", tensor_model_parallel_size=1, response_length=4)
        replica = get_rollout_replica_class("megatron_fp4")(
            replica_rank=0, config=config, model_config=HFModelConfig(path=path, load_tokenizer=False), gpus_per_node=1)

        async def run():
            await replica.init_hybrid(SimpleNamespace(workers=[worker]))
            server = replica.server_handle
            greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
            out = await server.generate.remote(prompt_ids=[1, 2, 3], sampling_params=greedy, request_id="a")
            reference = await worker.reference.remote([1, 2, 3])
            await replica.sleep()
            with pytest.raises(ray.exceptions.RayTaskError, match="resume"):
                await server.generate.remote(prompt_ids=[1, 2, 3], sampling_params=greedy, request_id="b")
            await replica.wake_up()
            again = await server.generate.remote(prompt_ids=[1, 2, 3], sampling_params=greedy, request_id="c")
            return out, reference, again

        out, reference, again = asyncio.run(run())
        assert len(replica.servers) == 1 and replica.server_address is None
        assert out.token_ids == reference[:len(out.token_ids)] and len(out.token_ids) == 4 == len(out.log_probs)
        assert again.token_ids == out.token_ids and again.log_probs == out.log_probs
    finally:
        ray.shutdown()
        for sig, handler in handlers.items():  # ray.shutdown leaves ray's handlers: later tests see the defaults
            signal.signal(sig, handler)
