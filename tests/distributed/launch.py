"""Run a function on N gloo processes on CPU and collect what each rank returns.

    results = run_distributed(fn, world_size=2, args=(cfg_dict,))   # fn(rank, world_size, *args)

Each child gets MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK set, one intra-op thread (the CI
machine has 2 cores), and the default process group initialised on gloo. A child's exception is
re-raised in the parent with the child's traceback.

The children are forked from multiprocessing's fork server, started once per test process with torch
and the trainer's modules imported (``_PRELOAD``; a single-threaded process: nothing there has run a
kernel): a fresh interpreter per child spent ~4.5 s of CPU importing them, ~6 s of wall time for a
4-process launch on a 2-core machine against ~0.4 s forked (the suite outside tests/unit went from
31 to 22 min on one). A child takes the caller's environment as it is at the launch, not
the server's. What a fork shares that separate interpreters would not: the string hash seed (the
ranks iterate a set of strings in one order; the torchrun tests, a process per rank as in
production, keep covering different seeds) and NumPy's global RNG state (unseeded, it differed per
child before: nothing here may read it).
"""
from __future__ import annotations

import os
import pickle
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# imported once in the fork server: what nearly every child imports (torch with them)
_PRELOAD = ["megatron_fp4.training.trainer", "tests.distributed.launch", "tests.numerics"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world_size, port, fn, args, queue, environ):
    os.environ.clear()  # the caller's environment now, not the one the fork server started with
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Plain pickle (bytes), not the queue's shared-memory tensor sharing: a child's tensors must
        # outlive the child.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report everything, including assertion failures
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, args: tuple = (), timeout_s: float = 300.0,
                    may_die: frozenset = frozenset()) -> list:
    """Spawn `world_size` processes running fn(rank, world_size, *args); return results by rank.

    Fails (instead of hanging) when a child raises, dies without reporting (e.g. killed), or the
    whole run exceeds `timeout_s`. Ranks in `may_die` are fault-injection victims: their death is
    expected and their result is None."""
    import queue as queue_mod
    import time

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    results_q = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_child, args=(r, world_size, port, fn, args, results_q, environ), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors, reported = [None] * world_size, [], set()
    deadline = time.monotonic() + timeout_s
    while len(reported) < world_size and not errors:
        try:
            rank, status, payload = results_q.get(timeout=0.5)
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode not in (None, 0)]
            reported.update(r for r in dead if r in may_die)
            dead = [r for r in dead if r not in may_die]
            if dead:
                errors.append(f"rank(s) {dead} died without reporting (exit codes "
                              f"{[procs[r].exitcode for r in dead]})")
            elif time.monotonic() > deadline:
                errors.append(f"timed out after {timeout_s:.0f}s waiting for ranks "
                              f"{sorted(set(range(world_size)) - reported)}")
            continue
        reported.add(rank)
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors.append(f"--- rank {rank} ---\n{payload}")
    for p in procs:
        p.join(timeout=5 if errors else 30)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise RuntimeError("distributed test failed:\n" + "\n".join(errors))
    return results
