"""Preemption: SIGTERM or SIGUSR1 end the run at a step boundary, with a checkpoint of that step.

Megatron-LM's exit-signal handler, for our mesh. The handler only records the signal; the trainer
is handed it explicitly (``trainer.train(preemption=handler)``) and reads it at one documented
check point, between steps (`Trainer.between_steps`): `stop_if_requested`, where every rank votes (one all-reduce over the whole
mesh) on "did any rank get a signal?". So all ranks stop after the same step even when the signal
reached them at different moments (or only one of them), all save that step (a collective DCP save
in a parallel run) and raise `Preempted`; the CLI turns that into one line and exit code
`EXIT_PREEMPTED`. A requeued or restarted job resumes from it with ``checkpoint.load=auto``.

    with PreemptionHandler() as handler:      # megatron_fp4.train installs it on every rank
        trainer.train(preemption=handler)

Who sends the signal: Slurm ahead of a time limit or preemption (``--signal``), ``scancel`` (SIGTERM,
then SIGKILL after the cluster's KillWait), or torchrun's agent, which forwards the signals listed
in its --signals-to-handle (PET_SIGNALS_TO_HANDLE) to every worker and gives them TORCH_ELASTIC_SHUTDOWN_TIMEOUT
seconds before SIGKILL (tools/launchers sets both). Without a handler (``train()`` without one, a
library user's own loop) `stop_if_requested` does nothing and costs no collective.
"""
from __future__ import annotations

import signal
import threading
from typing import Optional

EXIT_PREEMPTED = 4
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Raised on every rank after the step at which the ranks agreed to stop (checkpoint saved)."""

    def __init__(self, step: int, signal_name: str, saved_to: Optional[str]):
        self.step, self.signal_name, self.saved_to = step, signal_name, saved_to
        where = (f"saved checkpoint step {step} in {saved_to}; resume with --set checkpoint.load=auto (the "
                 f"launchers' default)") if saved_to else "checkpoint.dir is not set, so nothing was saved"
        super().__init__(f"preempted by {signal_name}: stopped after step {step}; {where}")


class PreemptionHandler:
    """Context manager: while active, `signals` set a flag instead of ending the process."""

    def __init__(self, signals=SIGNALS):
        self.signals = tuple(signals)
        self.received: Optional[str] = None
        self._previous: dict = {}

    def _record(self, signum, frame) -> None:
        self.received = self.received or signal.Signals(signum).name

    @property
    def installed(self) -> bool:
        """True while its signal handlers are installed (inside the `with`, on the main thread)."""
        return bool(self._previous)

    def __enter__(self) -> "PreemptionHandler":
        if threading.current_thread() is threading.main_thread():  # Python's rule for signal handlers
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


def stop_if_requested(trainer, handler: Optional[PreemptionHandler], saved: bool) -> None:
    """After a step: if any rank's `handler` got a signal, every rank saves this step (unless
    `saved`, the periodic save just wrote it) and raises `Preempted`. Collective when `handler` is
    installed; nothing (no collective) without one."""
    if handler is None or not handler.installed:
        return
    ranks = trainer.mesh.ranks_with(handler.received is not None)
    if not ranks:
        return
    root = trainer.cfg.checkpoint.dir
    if root and not saved:
        trainer.save_checkpoint(root)
    raise Preempted(trainer.step, handler.received or f"a signal to rank {ranks[0]}", root)
