"""verl's own `TrainingWorker` drives the megatron_fp4 engine on CPU, at world size 1 and 2 (gloo).

What verl needs to run its worker without a GPU or Ray (see docs/verl.md):
  * `VERL_PLATFORM=cpu` selects the platform this package registers (verl falls back to "nvidia"
    otherwise and calls torch.cuda);
  * torch.distributed already initialised with gloo (verl's `initialize_global_process_group_ray`
    is skipped then; it would ask for "cpu:gloo,cpu:gloo", which torch rejects);
  * RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the environment (verl's `Worker` reads them), as
    torchrun sets them.
Ray's part, the dispatch of a batch to dp ranks, is verl's own splitting
(`_split_args_kwargs_data_proto`) indexed by the dp rank the worker registered.

Checked against the single-process run of the same batch (this test's process: the engine from
verl's EngineRegistry on the whole batch) (float64, so every layout difference is a
reduction-order effect of ~1e-16 relative; FP64_REL in tests/numerics.py says why 1e-10 holds): the
log-probs and entropies of `infer_batch` (verl's no-padding layout), then one `train_mini_batch`
with verl's `ppo_loss` (global-token normalisation over dp): loss, grad norm and updated weights.
"""
import os

import pytest
import torch

from tests.distributed.launch import run_distributed
from tests.numerics import FP64_REL, rel

import verl  # noqa: F401,E402 - the test extra installs it: a missing package fails, never skips
pytestmark = pytest.mark.distributed

B, MICRO = 4, 2


def _hf_checkpoint(tmp_path):
    from megatron_fp4.config import Config
    from megatron_fp4.integrations.hf import save_hf_checkpoint
    from megatron_fp4.model import build_model

    cfg = Config()
    cfg.model.vocab_size, cfg.model.num_layers = 18, 2
    return str(save_hf_checkpoint(build_model(cfg, seed=5), cfg, tmp_path / "hf"))


def _padded_batch():
    """verl's padded rollout layout: left-padded prompts, right-padded responses of other lengths."""
    g = torch.Generator().manual_seed(0)
    P, R = 5, 6
    prompt_len, response_len = [5, 3, 4, 2], [6, 2, 4, 5]
    prompts, responses = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, R, dtype=torch.long)
    prompt_mask, response_mask = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, R, dtype=torch.long)
    for i in range(B):
        prompts[i, P - prompt_len[i]:] = torch.randint(1, 18, (prompt_len[i],), generator=g)
        prompt_mask[i, P - prompt_len[i]:] = 1
        responses[i, :response_len[i]] = torch.randint(1, 18, (response_len[i],), generator=g)
        response_mask[i, :response_len[i]] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(1) - 1).clamp_min(0),
            "response_mask": response_mask,
            "advantages": torch.tensor([1.0, -1.0, 0.5, -0.25], dtype=torch.float64)[:, None].expand(B, R).clone()}


def _training_worker(path):
    """A TrainingWorker exactly as verl's ActorRolloutRefWorker.init_model builds the actor's."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, OptimizerConfig, TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    from megatron_fp4.verl.construct import MegatronFP4EngineConfig

    engine = MegatronFP4EngineConfig(dtype="float64", use_dynamic_bsz=False, micro_batch_size_per_gpu=MICRO,
                                     infer_micro_batch_size_per_gpu=MICRO)
    return TrainingWorker(TrainingWorkerConfig(
        model_type="language_model", model_config=HFModelConfig(path=path, load_tokenizer=False),
        engine_config=engine, optimizer_config=OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0),
        checkpoint_config=CheckpointConfig()))


def _dispatch(worker, td, world_size):
    """verl's dispatcher: split into dp chunks, hand this rank the one of its registered dp rank."""
    from verl.single_controller.base.decorator import _split_args_kwargs_data_proto

    (chunks,), _ = _split_args_kwargs_data_proto(world_size, td)
    return chunks[worker._query_dispatch_info("train")].clone()  # what crosses Ray is a copy (unlocked)


def _run(rank, world_size, path, batch):
    # before anything imports verl's engine modules: they resolve the platform when imported
    os.environ["VERL_PLATFORM"] = "cpu"
    import megatron_fp4.verl  # noqa: F401  registers the platform, engine and rollout

    from functools import partial

    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    from megatron_fp4.verl import MegatronFP4Engine

    worker = _training_worker(path)
    assert isinstance(worker.engine, MegatronFP4Engine)
    # dp size and rank come from torch.distributed, already at construction (verl registers them there)
    dp_rank = worker._query_dispatch_info("train")
    assert (dp_rank, worker.engine.get_data_parallel_size()) == (rank, world_size)
    worker.reset()
    assert worker.engine.trainer.mesh.dp == world_size

    full = left_right_2_no_padding(TensorDict(batch, batch_size=[B]))
    td = _dispatch(worker, full, world_size)
    tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False)
    out = worker.infer_batch(td)  # verl's compute_log_prob path
    log_probs, entropy = no_padding_2_padding(tu.get(out, "log_probs"), td), no_padding_2_padding(tu.get(out, "entropy"), td)

    # verl's _update_actor: old_log_probs from the pass above, one mini-batch of the whole batch
    td = _dispatch(worker, full, world_size)
    td["old_log_probs"] = log_probs  # padded [b, R], as the trainer stores them
    actor = FSDPActorConfig(strategy="megatron_fp4", ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=MICRO,
                            use_dynamic_bsz=False, rollout_n=1)
    worker.set_loss_fn(partial(ppo_loss, actor))
    tu.assign_non_tensor(td, calculate_entropy=False, global_batch_size=B, mini_batch_size=B, epochs=1, seed=1,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True)
    metrics = tu.get(worker.train_mini_batch(td), "metrics")
    params = {n: p.detach().clone() for n, p in worker.engine.model.named_parameters()}
    return {"dp_rank": dp_rank, "log_probs": log_probs, "entropy": entropy, "response_mask": td["response_mask"],
            "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "pg_loss": metrics["actor/pg_loss"],
            "params": params, "optimizer": type(worker.engine.trainer.optimizer).__name__}


def _reference(path, batch):
    """The single-process run: the same engine from verl's EngineRegistry, driven by verl's batch
    helpers and `ppo_loss` on the whole batch (this process; no worker, no process group)."""
    from functools import partial

    from tensordict import TensorDict
    from verl.trainer.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig, HFModelConfig, OptimizerConfig
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    from megatron_fp4.verl.construct import MegatronFP4EngineConfig

    engine = EngineRegistry.new(model_type="language_model", backend="megatron_fp4",
                                model_config=HFModelConfig(path=path, load_tokenizer=False),
                                engine_config=MegatronFP4EngineConfig(dtype="float64", micro_batch_size_per_gpu=MICRO),
                                optimizer_config=OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0),
                                checkpoint_config=CheckpointConfig()).initialize()
    initial = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    td = left_right_2_no_padding(TensorDict(batch, batch_size=[B]))
    tu.assign_non_tensor(td, calculate_entropy=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=MICRO)
    with engine.eval_mode():
        out = engine.infer_batch(td)["model_output"]
    log_probs, entropy = no_padding_2_padding(out["log_probs"], td), no_padding_2_padding(out["entropy"], td)
    td = left_right_2_no_padding(TensorDict(batch, batch_size=[B]))
    td["old_log_probs"] = log_probs
    tu.assign_non_tensor(td, global_batch_size=B, use_dynamic_bsz=False, micro_batch_size_per_gpu=MICRO)
    actor = FSDPActorConfig(strategy="megatron_fp4", ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=MICRO,
                            use_dynamic_bsz=False, rollout_n=1)
    with engine.train_mode():
        result = engine.train_batch(td, partial(ppo_loss, actor))
    return {"log_probs": log_probs, "entropy": entropy, "response_mask": batch["response_mask"],
            "loss": sum(result["loss"]), "grad_norm": result["metrics"]["grad_norm"], "initial": initial,
            "params": {n: p.detach().clone() for n, p in engine.model.named_parameters()}}


def test_training_worker_at_world_size_2_matches_one_process(tmp_path):
    path, batch = _hf_checkpoint(tmp_path), _padded_batch()
    dp = sorted(run_distributed(_run, world_size=2, args=(path, batch)), key=lambda r: r["dp_rank"])
    ref = _reference(path, batch)
    assert [r["optimizer"] for r in dp] == ["ZeroAdamW"] * 2

    mask = ref["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        got = torch.cat([r[key] for r in dp])
        assert got.shape == ref[key].shape and torch.all(got[~mask] == 0)
        assert rel(got[mask], ref[key][mask]) <= FP64_REL, key
    assert torch.all(ref["entropy"][mask] > 0) and ref["grad_norm"] > 0 and ref["loss"] != 0

    for r in dp:
        # verl averages the loss over dp (each rank's term scaled by dp / global token count) in a
        # float32 tensor (`torch.tensor(list of floats)`): equal up to one float32 rounding
        assert abs(r["loss"][0] - ref["loss"]) <= torch.finfo(torch.float32).eps * abs(ref["loss"])
        assert abs(r["grad_norm"][0] - ref["grad_norm"]) <= FP64_REL * ref["grad_norm"]
        for name, p0 in ref["initial"].items():  # the update itself, not only the (shared) start
            assert rel(r["params"][name] - p0, ref["params"][name] - p0) <= FP64_REL ** 0.5, name
