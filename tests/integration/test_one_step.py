"""One step for every caller: verl's engine, driven through verl's `BaseEngine.train_batch` (what verl's
`TrainingWorker.train_batch` calls: optimizer_zero_grad, forward_backward_batch, optimizer_step, then
lr_scheduler_step) with a verl-style loss function, takes the same step as the Trainer's own
`train_step_with_loss` (the CLI's step) on the same batch and loss: the same bits of loss, grad norm
and every parameter, with FP4 MoEResQ and stochastic gradient rounding on, over 2 steps (the SR
streams are keyed by step and micro-batch: a verl step without the trainer's FP4 step context draws
step 0 / micro-batch 0 for everything). The MoE auxiliary loss is on, so its scale counts too.

Bitwise by construction of the one step: both paths run the same ops in the same order (the
trainer's forward_backward and apply_update); the engine's padded micro-batch weight rows/B = 2/4
and the trainer's 1/n = 1/2 scale a loss exactly (powers of two). A non-finite value on the verl
path meets the same mesh-wide vote as on the CLI's: the same refusal, weights unchanged.
"""
import copy
import math

import pytest
import torch

import verl  # noqa: F401 - the test extra installs it: a missing package fails, never skips
from tensordict import TensorDict

from megatron_fp4.config import Config
from megatron_fp4.verl import MegatronFP4Engine
from megatron_fp4.rollout.scoring import compute_log_probs
from megatron_fp4.training.nonfinite import NonFiniteError
from megatron_fp4.training.trainer import Trainer

B, MICRO, T, R = 4, 2, 12, 5


def sr_cfg() -> Config:
    cfg = Config()
    cfg.model.num_layers = 2
    cfg.fp4.train_mode, cfg.fp4.grad_rounding = "fp4_resq", "stochastic"
    cfg.optimizer.warmup_steps, cfg.optimizer.lr = 0, 1e-2
    s = cfg.schedule
    s.global_batch_size, s.micro_batch_size, s.seq_len = B, MICRO, T
    cfg.logging.tensorboard_dir, cfg.logging.progress = None, False
    assert cfg.model.router_aux_loss_coef > 0  # the aux-loss scale is part of what is compared
    return cfg


def batch(vocab: int, seed: int) -> dict:
    """A padded verl batch: left-padded prompts + responses, response mask, per-token advantages."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :3] = mask[3, :2] = 0  # left padding
    response_mask = torch.ones(B, R, dtype=torch.long)
    response_mask[2, 3:] = 0
    adv = torch.randn(B, generator=g)[:, None].expand(B, R).clone()
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, -R:].clone(), "response_mask": response_mask,
            "advantages": adv}


def verl_loss(model_output, data, dp_group):
    """verl's loss-function signature: the micro-batch's token-mean policy-gradient loss."""
    mask = data["response_mask"].to(model_output["log_probs"].dtype)
    loss = -(model_output["log_probs"] * data["advantages"] * mask).sum() / mask.sum()
    return loss, {"actor/pg_loss": loss.detach()}


def cli_loss(model, mb):
    """The same loss as a plain trainer loss, from the rollout's scoring function (not the engine's)."""
    lp = compute_log_probs(model, mb["input_ids"], mb["attention_mask"]).log_probs[:, -R:]
    mask = mb["response_mask"].to(lp.dtype)
    lp = lp * mask
    return -(lp * mb["advantages"] * mask).sum() / mask.sum(), {}


def params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def verl_step(engine, b: dict) -> dict:
    with engine.train_mode():
        out = engine.train_batch(TensorDict(b, batch_size=[B]), verl_loss)
    engine.lr_scheduler_step()
    total = 0.0
    for loss in out["loss"]:  # the trainer's sum: Σ loss_i / n in micro-batch order
        total += loss / 2
    return {"loss": total, "grad_norm": out["metrics"]["grad_norm"]}


def cli_step(trainer, b: dict) -> dict:
    micro = [{k: v[s:s + MICRO] for k, v in b.items()} for s in range(0, B, MICRO)]
    return trainer.train_step_with_loss(micro, cli_loss)


def test_a_verl_step_and_a_cli_step_give_the_same_bits():
    cfg = sr_cfg()
    engine = MegatronFP4Engine(cfg=copy.deepcopy(cfg), micro_batch_size=MICRO).initialize()
    trainer = Trainer(copy.deepcopy(cfg), build_data=False)
    start = params(trainer.model)
    assert all(torch.equal(start[n], p) for n, p in params(engine.model).items())
    for step in range(2):
        b = batch(cfg.model.vocab_size, seed=step)
        v, c = verl_step(engine, b), cli_step(trainer, b)
        assert not c["skipped"] and c["grad_norm"] > 0
        assert float.hex(v["loss"]) == float.hex(c["loss"]), step
        assert float.hex(v["grad_norm"]) == float.hex(c["grad_norm"]), step
        for name, p in params(trainer.model).items():
            assert torch.equal(params(engine.model)[name], p), (step, name)
    assert engine.trainer.step == trainer.step == 2
    assert any(not torch.equal(start[n], p) for n, p in params(trainer.model).items())


def test_the_sr_streams_key_decides_the_bits():
    """What makes the test above able to fail: the same verl step with the FP4 step context keyed by
    another optimizer step (the lr schedule, which follows verl's position, unchanged) rounds the
    gradients differently, so a verl path without the trainer's step context would not match."""
    cfg = sr_cfg()
    engine = MegatronFP4Engine(cfg=copy.deepcopy(cfg), micro_batch_size=MICRO).initialize()
    trainer = Trainer(copy.deepcopy(cfg), build_data=False)
    engine.trainer.step = 1  # the SR streams' step; lr_at reads engine.lr_steps (still 0)
    b = batch(cfg.model.vocab_size, seed=0)
    v, c = verl_step(engine, b), cli_step(trainer, b)
    assert float.hex(v["loss"]) == float.hex(c["loss"])  # forward: nearest rounding, no SR draws
    assert float.hex(v["grad_norm"]) != float.hex(c["grad_norm"])


def poisoned(cfg: Config) -> dict:
    b = batch(cfg.model.vocab_size, seed=0)
    b["advantages"][3, 0] = math.nan  # one token of the second micro-batch
    return b


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_nan_on_the_verl_path_meets_the_trainers_vote(policy):
    cfg = sr_cfg()
    cfg.schedule.nan_policy = policy
    engine = MegatronFP4Engine(cfg=copy.deepcopy(cfg), micro_batch_size=MICRO).initialize()
    trainer = Trainer(copy.deepcopy(cfg), build_data=False)
    before = params(engine.model)
    if policy == "stop":
        with pytest.raises(NonFiniteError) as verl_err:
            verl_step(engine, poisoned(cfg))
        with pytest.raises(NonFiniteError) as cli_err:
            cli_step(trainer, poisoned(cfg))
        assert str(verl_err.value) == str(cli_err.value)
        assert "step 0: non-finite values" in str(verl_err.value) and "weights are unchanged" in str(verl_err.value)
    else:
        v, c = verl_step(engine, poisoned(cfg)), cli_step(trainer, poisoned(cfg))
        assert math.isnan(v["grad_norm"]) and c["skipped"] and engine.last_update["skipped"]
        assert engine.last_update["message"] == c["message"]
        assert engine.trainer.consecutive_skips == trainer.consecutive_skips == 1
    for name, p in params(engine.model).items():
        assert torch.equal(before[name], p), name


def test_verls_lr_schedule_position_is_kept_apart_from_the_step_and_resumed(tmp_path):
    """verl steps its lr schedule once per worker `train_batch` (which may hold several optimizer steps):
    the trainer counts optimizer steps (the SR streams' step), the engine the schedule's position,
    and a checkpoint brings both back."""
    cfg = sr_cfg()
    cfg.optimizer.warmup_steps = 10  # a schedule whose position shows in the lr
    engine = MegatronFP4Engine(cfg=copy.deepcopy(cfg), micro_batch_size=MICRO).initialize()
    for seed in range(2):  # two optimizer steps (mini-batches), one lr-schedule step
        with engine.train_mode():
            engine.train_batch(TensorDict(batch(cfg.model.vocab_size, seed), batch_size=[B]), verl_loss)
    lr = engine.lr_scheduler_step()
    assert (engine.trainer.step, engine.lr_steps) == (2, 1) and engine.last_update["lr"] < lr
    engine.save_checkpoint(str(tmp_path))
    resumed = MegatronFP4Engine(cfg=copy.deepcopy(cfg), micro_batch_size=MICRO).initialize()
    resumed.load_checkpoint(str(tmp_path))
    assert (resumed.trainer.step, resumed.lr_steps) == (2, 1)
    (tmp_path / "verl_lr_steps.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="verl_lr_steps.json: expected"):
        resumed.load_checkpoint(str(tmp_path))


def test_several_forward_backward_batch_calls_of_one_step_draw_their_own_micro_batch_streams():
    """verl may call forward_backward_batch several times before one optimizer_step: the FP4 context
    (what keys the SR streams) continues the step's micro-batch count, and the next step counts anew."""
    seen = []

    def loss(model_output, data, dp_group):
        now = engine.model.numerics.position  # the model's fp4.Numerics, advanced by the trainer
        seen.append((now.step, now.micro_batch))
        return verl_loss(model_output, data, dp_group)

    cfg = sr_cfg()
    engine = MegatronFP4Engine(cfg=copy.deepcopy(cfg), micro_batch_size=MICRO).initialize()
    b = TensorDict(batch(cfg.model.vocab_size, 0), batch_size=[B])
    for _ in range(2):
        engine.optimizer_zero_grad()
        with engine.train_mode():
            engine.forward_backward_batch(b[:MICRO], loss)
            engine.forward_backward_batch(b[MICRO:], loss)
        engine.optimizer_step()
    assert seen == [(0, 0), (0, 1), (1, 0), (1, 1)]
