"""Command-line entry: ``python -m megatron_fp4.train [--config FILE] [--set section.field=value ...]``.

Without --config it trains the embedded default (`megatron_fp4/configs/tiny_moe.yaml`). Under
torchrun the same command runs every rank of the configured parallel layout.

A mistake in what the user pointed us at (config field, YAML syntax, checkpoint, data file) is one
line on stderr and exit code 2; a run the NaN guard stopped is one line and exit code 3; a run
stopped by SIGTERM or SIGUSR1 (preemption, `scancel`, torchrun's agent) saves the step it finished
on every rank, prints one line and exits with code 4 (`training/preemption.py`).
"""
from __future__ import annotations

import argparse
import os
import sys

import yaml

from megatron_fp4.config import ConfigError, default_config_path, load_config

from megatron_fp4.training.preemption import EXIT_PREEMPTED, Preempted, PreemptionHandler

EXIT_USER_ERROR, EXIT_NON_FINITE = 2, 3


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="megatron-fp4-train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML config (default: the embedded tiny_moe.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override, e.g. --set model.num_layers=2 (repeatable)")
    parser.add_argument("--steps", type=int, default=None, help="shorthand for --set schedule.train_steps=N")
    return parser.parse_args(argv)


def run(cfg) -> list[dict]:
    """Build the layout of `cfg` for this process (torchrun or single) and train; SIGTERM/SIGUSR1
    stop it after a step with a checkpoint (`Preempted`). The process groups this run created are
    destroyed when it ends with every rank agreeing (trained, or preempted): `shutdown_process_groups`
    says why an exit must not leave that to the interpreter's teardown."""
    import torch.distributed as dist

    from megatron_fp4.parallel.mesh import shutdown_process_groups

    owns_groups = not dist.is_initialized()  # a caller's own groups stay theirs
    preempted = None
    with PreemptionHandler() as handler:
        try:
            history = _run(cfg, handler)
        except Preempted as err:  # every rank raises it after the same step
            preempted = err.with_traceback(None)  # its frames held the trainer, and so its groups
        if owns_groups:
            shutdown_process_groups()
    if preempted is not None:
        raise preempted
    return history


def _run(cfg, handler: PreemptionHandler) -> list[dict]:
    rank = int(os.environ.get("RANK", "0"))
    lock = lock_checkpoint_dir(cfg.checkpoint.dir) if rank == 0 and cfg.checkpoint.dir else None
    try:
        return _build_and_train(cfg, rank, handler)
    finally:
        if lock is not None:
            lock.release()


def _build_and_train(cfg, rank: int, handler: PreemptionHandler) -> list[dict]:
    from megatron_fp4.training.metrics import check_tensorboard_dir

    from megatron_fp4.training.trainer import Trainer

    check_tensorboard_dir(cfg.logging.tensorboard_dir)  # every rank, before the model is built
    with Trainer(cfg) as trainer:  # validates cfg (once) and builds this process's mesh (ParallelMesh.from_env)
        return _resume_and_train(cfg, trainer, rank, handler)


def _resume_and_train(cfg, trainer, rank: int, handler: PreemptionHandler) -> list[dict]:
    from megatron_fp4.training.metrics import outputs_pointer, start_banner

    if rank == 0:
        print(start_banner(cfg, trainer.mesh), flush=True)
    if cfg.checkpoint.load:
        path = cfg.checkpoint.dir if cfg.checkpoint.load == "auto" else cfg.checkpoint.load
        from megatron_fp4.training.checkpoint.directory import latest_step

        if cfg.checkpoint.load != "auto" or latest_step(path) is not None:
            step = trainer.load_checkpoint(path)
            if rank == 0:
                print(f"resumed from {path} at step {step}", file=sys.stderr, flush=True)
    try:
        history = trainer.train(preemption=handler)
    except Preempted:
        if rank == 0:
            print(outputs_pointer(cfg), flush=True)
        raise
    if trainer.mesh.rank == trainer.mesh.world_size - 1:
        if history:
            n = min(10, len(history))
            first, last = (sum(h["loss"] for h in part) / n for part in (history[:n], history[-n:]))
            print(f"trained {len(history)} steps: loss {first:.4f} (first {n} avg) -> {last:.4f} (last {n} avg)")
        print(outputs_pointer(cfg), flush=True)
    return history


def lock_checkpoint_dir(root: str):
    """Rank 0 holds an exclusive flock on the checkpoint directory itself for the whole run, so two
    jobs never write the same checkpoint.dir (their saves would interleave and their resumes would
    cross); nothing is written into the directory. The kernel drops the lock when the process ends,
    even by SIGKILL: a restarted, requeued or resubmitted job takes it over, nothing stale remains.
    Where the filesystem cannot lock a directory (some NFS setups) the run warns and goes on."""
    import errno
    import fcntl
    import warnings

    from megatron_fp4.training.checkpoint.directory import CheckpointError

    try:
        os.makedirs(root, exist_ok=True)
        fd = os.open(root, os.O_RDONLY)
    except OSError as err:
        raise CheckpointError(f"cannot open checkpoint.dir={root!r} ({err.strerror}); it must be a writable "
                              f"directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
            raise CheckpointError(f"checkpoint.dir={root!r} is in use by another run (it holds the directory's "
                                  f"lock); give this run its own checkpoint.dir, or wait for that run to end") from None
        warnings.warn(f"cannot lock checkpoint.dir={root!r} ({err.strerror}): two runs sharing it would not be "
                      f"detected", stacklevel=2)
        return None
    return _DirLock(fd)


class _DirLock:
    def __init__(self, fd: int):
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor (or this process ending) drops the lock
            self.fd = None

    __del__ = release


MAX_ERROR_CHARS = 2000  # a user error is one readable line, whatever value it quotes


def _squash(err: BaseException) -> str:
    """The message on one line (YAML errors span several), cut to MAX_ERROR_CHARS."""
    text = " ".join(str(err).split())
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS] + f"... ({len(text) - MAX_ERROR_CHARS} more characters)"
    return text


def _one_line(kind: str, err: BaseException) -> str:
    text = _squash(err)
    rank = f"rank {os.environ['RANK']}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    return f"{rank}{kind} error: {text}"


def _config_error(err) -> int:
    """One line on rank 0 (every rank sees the same config): the field, the fix, and under a
    multi-process launch a hint that the process count is part of the layout."""
    if int(os.environ.get("RANK", "0")) == 0:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        launched = (f" (this job started {world} processes: the launcher's process count, torchrun "
                    f"--nproc-per-node × nodes or the sbatch's NPROC_PER_NODE, is part of the layout and may be "
                    f"what to change)") if world > 1 else ""
        print(f"config error: {_squash(err)}{launched}", file=sys.stderr)
    return EXIT_USER_ERROR


def main(argv=None) -> int:
    args = parse_args(argv)
    overrides = list(args.overrides) + ([f"schedule.train_steps={args.steps}"] if args.steps is not None else [])
    try:
        cfg = load_config(args.config or default_config_path(), overrides)
        if args.steps is not None and cfg.schedule.warmup_steps > args.steps:
            # --steps is a quick-run shorthand: shrink the warmup with it rather than refuse.
            cfg.schedule.warmup_steps = args.steps // 10
    except ConfigError as err:
        return _config_error(err)
    except yaml.YAMLError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            where = args.config or "a --set value"
            print(_one_line("YAML", err) + f" (in {where}; fix the syntax there)", file=sys.stderr)
        return EXIT_USER_ERROR
    import torch.distributed as dist

    from megatron_fp4.parallel.mesh import shutdown_process_groups

    owns_groups = not dist.is_initialized()
    code = _train_to_exit_code(cfg)
    if owns_groups:  # a run that stopped on an error (the error's frames are gone by now): no
        shutdown_process_groups(barrier=False)  # barrier, the ranks need not have stopped together
    return code


def _train_to_exit_code(cfg) -> int:
    from megatron_fp4.training.checkpoint.directory import CheckpointError
    from megatron_fp4.training.data import DataError
    from megatron_fp4.training.trainer import NonFiniteError

    try:
        run(cfg)
    except ConfigError as err:  # the Trainer validates the config against this job's world size
        return _config_error(err)
    except (CheckpointError, DataError) as err:
        kind = "checkpoint" if isinstance(err, CheckpointError) else "data"
        print(_one_line(kind, err), file=sys.stderr)
        return EXIT_USER_ERROR
    except NonFiniteError as err:
        print(_one_line("non-finite", err), file=sys.stderr)
        return EXIT_NON_FINITE
    except Preempted as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(str(err), file=sys.stderr)
        return EXIT_PREEMPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
