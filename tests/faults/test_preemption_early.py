"""Issue 36: a preemption in the first steps resumes to the uninterrupted run's weights and
optimizer state, bit for bit (one process, standard numerics, compile off: the same ops in the same
order). SIGTERM lands before the first step (right after the banner), or after step 1, 2 or 3."""
import os
import signal

import pytest
import torch

from megatron_fp4.config import load_config
from megatron_fp4.train import run
from megatron_fp4.training.preemption import Preempted
from megatron_fp4.training.trainer import Trainer

pytestmark = pytest.mark.faults
STEPS = 4


def cfg_for(root, *extra):
    return load_config(None, [
        "model.num_layers=2", "schedule.seq_len=16", "schedule.global_batch_size=4", "schedule.micro_batch_size=2",
        f"schedule.train_steps={STEPS}", "schedule.warmup_steps=1", "data.num_samples=64", "logging.progress=false",
        "logging.tensorboard_dir=null", "logging.log_interval=2", "numerics.invariance=standard", "fp4.compile=off",
        f"checkpoint.dir={root}", "checkpoint.save_interval=0", "checkpoint.keep_last=0", "checkpoint.load=auto",
        *extra])


def final_state(root) -> dict:
    """Model weights (buffers too) and AdamW state of the newest checkpoint under `root`."""
    trainer = Trainer(cfg_for(root), build_data=False)
    assert trainer.load_checkpoint(str(root)) == STEPS
    state = {f"model/{n}": t.clone() for n, t in trainer.model.state_dict().items()}
    for k in range(len(trainer.optimizer.buffers)):
        for key, value in trainer.optimizer.adam_state(k).items():
            state[f"adam/{k}/{key}"] = value.clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
    return state


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref") / "ckpt"
    assert len(run(cfg_for(root))) == STEPS
    return final_state(root)


@pytest.mark.parametrize("at", [None, 0, 1, 2])  # None: before the first step, right after the banner
def test_a_preemption_in_the_first_steps_resumes_bitwise(tmp_path, monkeypatch, reference, at):
    original_step, original_train = Trainer.train_step, Trainer.train

    def train(self, *args, **kwargs):
        if at is None:
            os.kill(os.getpid(), signal.SIGTERM)
        return original_train(self, *args, **kwargs)

    def step(self):
        result = original_step(self)
        if self.step - 1 == at:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(Trainer, "train", train)
    monkeypatch.setattr(Trainer, "train_step", step)
    stop = 1 if at is None else at + 1
    with pytest.raises(Preempted, match=f"stopped after step {stop}"):
        run(cfg_for(tmp_path / "ckpt"))
    monkeypatch.setattr(Trainer, "train", original_train)
    monkeypatch.setattr(Trainer, "train_step", original_step)
    assert len(run(cfg_for(tmp_path / "ckpt"))) == STEPS - stop
    resumed = final_state(tmp_path / "ckpt")
    assert resumed.keys() == reference.keys()
    differ = [name for name, t in reference.items() if not torch.equal(t, resumed[name])]
    assert not differ, differ
