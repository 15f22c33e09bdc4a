"""torchrun entry point of the launcher fault tests: `megatron_fp4.train`'s CLI with test hooks.

- Every finished step's loss is appended to $LOSS_LOG as ``<step> <float.hex>`` by the rank that
  holds the loss (the last pipeline stage), so losses compare bit for bit across attempts.
- ``FAULT=kill:<rank>:<step>``: on the first attempt (TORCHELASTIC_RESTART_COUNT=0) that rank
  SIGKILLs itself before running `step`. ``FAULT=signal:<rank>:<step>:<SIG>[:agent]``: that rank
  sends SIG to itself (or, with ``agent``, to its torchrun agent, which forwards it to every
  worker, and waits for that forwarded copy) right after `step` finished.
  ``FAULT=hold:<rank>:<step>:<marker>``: after `step`, that rank creates `marker` and waits for a
  signal (once: a resubmitted or requeued job finds the marker and runs through); the Slurm test
  signals the job from outside once the marker exists. Step counts make all of them deterministic;
  nothing here is timed.
- ``EXIT_THREADS_LOG``: at exit (atexit, before the interpreter's teardown) every rank appends
  ``<rank> <n>``, n its gloo worker threads still alive (named pt_gloo_runloop, Linux): a clean exit
  has destroyed its process groups, so none.
"""
import atexit
import os
import signal
import sys
import time

from megatron_fp4.train import main
from megatron_fp4.training.trainer import Trainer

_train_step, _train = Trainer.train_step, Trainer.train
_handler = []  # the PreemptionHandler the CLI hands to Trainer.train
FAULT = os.environ.get("FAULT", "").split(":")
FIRST_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def _hooked_train_step(self):
    if FIRST_ATTEMPT and FAULT[0] == "kill" and self.mesh.rank == int(FAULT[1]) and self.step == int(FAULT[2]):
        os.kill(os.getpid(), signal.SIGKILL)
    result = _train_step(self)
    if self.mesh.rank == self.mesh.world_size - 1 and os.environ.get("LOSS_LOG"):
        with open(os.environ["LOSS_LOG"], "a") as f:
            f.write(f"{self.step - 1} {float(result['loss']).hex()}\n")
    if FIRST_ATTEMPT and FAULT[0] == "signal" and self.mesh.rank == int(FAULT[1]) and self.step - 1 == int(FAULT[2]):
        os.kill(os.getppid() if FAULT[4:] == ["agent"] else os.getpid(), getattr(signal, FAULT[3]))
        deadline = time.monotonic() + 60  # the agent's forwarded copy: wait for it (a bound, not a timing)
        while FAULT[4:] == ["agent"] and _handler[0].received is None and time.monotonic() < deadline:
            time.sleep(0.01)
    if FAULT[0] == "hold" and self.mesh.rank == int(FAULT[1]) and self.step - 1 == int(FAULT[2]):
        _hold_once(FAULT[3])
    return result


def _hold_once(marker: str) -> None:
    """Pause this rank (so the others wait in their next collective) until a signal arrives, the
    first time only: touch `marker`, then wait; a later job or attempt finds it and runs through."""
    if os.path.exists(marker):
        return
    open(marker, "w").close()
    deadline = time.monotonic() + 300  # a bound in case the signal never comes, not a timing
    while _handler[0].received is None and time.monotonic() < deadline:
        time.sleep(0.05)


def _recording_train(self, *args, **kwargs):
    _handler.append(kwargs.get("preemption"))
    return _train(self, *args, **kwargs)


def _record_exit_threads() -> None:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    with open(os.environ["EXIT_THREADS_LOG"], "a") as f:
        f.write(f"{os.environ.get('RANK', '0')} {names.count('pt_gloo_runloop')}\n")


if os.environ.get("EXIT_THREADS_LOG"):
    atexit.register(_record_exit_threads)
Trainer.train_step = _hooked_train_step
Trainer.train = _recording_train

if __name__ == "__main__":
    sys.exit(main())
