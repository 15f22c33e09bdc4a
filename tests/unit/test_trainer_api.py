"""The Trainer's API for callers that change what it trains on or with (RL after SFT, verl after a
weight load): `set_dataset` and `reset_optimizer`, instead of assigning its attributes."""
import torch

from megatron_fp4.config import Config
from megatron_fp4.parallel.mesh import ParallelMesh
from megatron_fp4.training.data import ArithmeticDataset, ResumableSampler, get_batch
from megatron_fp4.training.trainer import Trainer


def tiny():
    cfg = Config()
    cfg.model.num_layers = 2
    cfg.schedule.global_batch_size, cfg.schedule.micro_batch_size, cfg.schedule.seq_len = 4, 2, 16
    cfg.data.num_samples = 40
    cfg.numerics.invariance, cfg.fp4.compile = "standard", "off"
    cfg.logging.tensorboard_dir, cfg.logging.progress = None, False
    return cfg


def test_set_dataset_reads_the_new_dataset_from_its_start():
    cfg = tiny()
    trainer = Trainer(cfg, ParallelMesh.single())
    data = ArithmeticDataset(24, cfg.schedule.seq_len, seed=5)
    trainer.set_dataset(data)
    assert trainer.dataset is data and trainer.sampler.state_dict()["consumed"] == 0
    got = trainer.next_micro_batches()
    want, _ = get_batch(data, ResumableSampler(len(data), 4, cfg.schedule.seed).next_batch())
    assert torch.equal(torch.cat([m["tokens"] for m in got]), want)


def test_reset_optimizer_starts_fresh_and_keeps_one_set_of_hooks():
    """After a step the moments are nonzero; a reset gives step-0 state, the old optimizer's gradient
    hooks are removed (under ZeRO they would otherwise reduce every gradient into its buffers too),
    and the next step equals a fresh trainer's step from the same weights."""
    cfg = tiny()
    trainer = Trainer(cfg, ParallelMesh.single())
    trainer.train_step()
    old = trainer.optimizer
    trainer.reset_optimizer()
    assert old._hooks == [] and trainer.optimizer is not old and trainer.optimizer._hooks
    for k in range(len(trainer.optimizer.buffers)):
        state = trainer.optimizer.adam_state(k)
        assert state["step"] == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    twin = Trainer(cfg, ParallelMesh.single())
    twin.model.load_state_dict(trainer.model.state_dict())
    twin.reset_optimizer()  # masters from the loaded weights
    twin.sampler.load_state_dict(trainer.sampler.state_dict())
    twin.step = trainer.step
    a, b = trainer.train_step()["loss"], twin.train_step()["loss"]
    assert float(a).hex() == float(b).hex()
    for (name, p), (_, q) in zip(trainer.model.named_parameters(), twin.model.named_parameters()):
        assert torch.equal(p, q), name


def test_close_frees_the_optimizer_and_its_mesh():
    """`Trainer.close` removes ZeRO's gradient hooks: they sit on the parameters and hold the
    optimizer, and through it the mesh (the process groups), from the tensors' C++ side, so without
    it the optimizer outlives the trainer for as long as anyone keeps the parameters. The control
    (not closed) shows the hooks really do keep it alive, so the first half can fail."""
    import gc
    import weakref

    from megatron_fp4.config import Config
    from megatron_fp4.training.trainer import Trainer

    cfg = Config()
    cfg.model.num_layers, cfg.model.vocab_size = 1, 32
    cfg.parallel.zero_stage = 2  # ZeRO-2: gradient hooks on every parameter

    def build():
        trainer = Trainer(cfg, build_data=False)
        return trainer, weakref.ref(trainer.optimizer), list(trainer.model.parameters())

    trainer, optimizer, kept = build()  # the caller keeps the parameters
    with trainer:
        pass
    del trainer
    gc.collect()
    assert optimizer() is None

    trainer, optimizer, kept = build()
    del trainer
    gc.collect()
    alive = optimizer() is not None
    if alive:
        optimizer().remove_hooks()
    assert alive, "the control's optimizer was freed without close(): the test no longer shows what close() does"
