"""SIGTERM/SIGUSR1 stop the run after the current step with a checkpoint of it (issue 17 row 3);
resuming that checkpoint ends with the uninterrupted run's losses, bit for bit (single process:
the same ops in the same order)."""
import os
import signal

import pytest

from megatron_fp4.train import main, run
from megatron_fp4.training import preemption
from megatron_fp4.training.preemption import EXIT_PREEMPTED, Preempted, PreemptionHandler
from megatron_fp4.training.trainer import Trainer
from tests.integration.test_train import small_cfg


def cfg_for(tmp_path, name, *extra):
    return small_cfg(tmp_path, "schedule.train_steps=5", "schedule.warmup_steps=0", "checkpoint.save_interval=4",
                     f"checkpoint.dir={tmp_path / name}", "checkpoint.keep_last=0", "logging.tensorboard_dir=null",
                     "fp4.scope=none", "fp4.train_mode=bf16", *extra)  # the FP4 path is not what is tested here


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return [h["loss"] for h in run(cfg_for(tmp_path_factory.mktemp("ref"), "ref"))]


@pytest.fixture
def signal_after_step(monkeypatch):
    """Send `sig` to this process right after step `at` (0-based) finished: deterministic, untimed."""
    def arm(at: int, sig=signal.SIGUSR1):
        original = Trainer.train_step

        def step(self):
            result = original(self)
            if self.step - 1 == at:
                os.kill(os.getpid(), sig)
            return result
        monkeypatch.setattr(Trainer, "train_step", step)
    return arm


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_signal_saves_the_finished_step_and_resume_matches(tmp_path, signal_after_step, sig, reference):
    signal_after_step(1, sig)
    before = signal.getsignal(sig)
    with pytest.raises(Preempted, match=f"preempted by {sig.name}: stopped after step 2") as info:
        run(cfg_for(tmp_path, "pre"))
    assert info.value.step == 2 and (tmp_path / "pre" / "step_00000002" / "meta.json").exists()
    assert signal.getsignal(sig) is before  # handlers restored
    tail = run(cfg_for(tmp_path, "pre", "checkpoint.load=auto"))
    assert [h["loss"] for h in tail] == reference[2:]


def test_cli_prints_one_line_and_exits_with_the_preemption_code(tmp_path, signal_after_step, capsys):
    signal_after_step(3)  # step 4 is also a periodic save: written once, not twice
    args = [f"--set={kv}" for kv in ["model.num_layers=2", "schedule.seq_len=32", "schedule.global_batch_size=8",
                                     "schedule.micro_batch_size=4", "schedule.warmup_steps=0", "logging.progress=false",
                                     "logging.tensorboard_dir=null", f"checkpoint.dir={tmp_path / 'c'}",
                                     "checkpoint.save_interval=4", "fp4.scope=none", "fp4.train_mode=bf16"]]
    assert main([*args, "--steps", "5"]) == EXIT_PREEMPTED
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if "preempted" in line] == [
        f"preempted by SIGUSR1: stopped after step 4; saved checkpoint step 4 in {tmp_path / 'c'}; resume with "
        f"--set checkpoint.load=auto (the launchers' default)"]
    assert sorted(p.name for p in (tmp_path / "c").glob("step_*")) == ["step_00000004"]


def test_without_a_handler_nothing_votes():
    class NoVote:
        def ranks_with(self, flag):
            raise AssertionError("voted without a handler")

    class FakeTrainer:
        mesh = NoVote()

    preemption.stop_if_requested(FakeTrainer(), None, saved=False)  # a library user's loop: no collective
    handler = PreemptionHandler()
    handler.received = "SIGTERM"  # recorded, but not installed (outside its `with`): still no vote
    preemption.stop_if_requested(FakeTrainer(), handler, saved=False)


def test_train_reads_the_signal_only_from_the_handler_it_is_given(tmp_path, signal_after_step):
    """The flag is read at the check point between steps, from the handler passed to `train`: a
    handler installed elsewhere (the signal still lands in it) does not stop this trainer."""
    signal_after_step(0)
    with PreemptionHandler() as handler:
        trainer = Trainer(cfg_for(tmp_path, "given"))
        with pytest.raises(Preempted, match="stopped after step 1"):
            trainer.train(num_steps=3, preemption=handler)
        assert trainer.step == 1
        handler.received = None
        assert len(Trainer(cfg_for(tmp_path, "other", "checkpoint.dir=null")).train(num_steps=2)) == 2


def test_handler_is_a_no_op_outside_the_main_thread():
    import threading

    before = signal.getsignal(signal.SIGUSR1)
    thread = threading.Thread(target=lambda: PreemptionHandler().__enter__())
    thread.start()
    thread.join()
    assert signal.getsignal(signal.SIGUSR1) is before
