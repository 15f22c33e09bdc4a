"""The rollout process's entry point (`rl.rollouts.worker`: what it does):

    python -m megatron_fp4.rl.rollouts.worker_main '<JSON spec>'     # MEGATRON_FP4_SYNC_TOKEN in the env

A module of its own that nothing in the package imports: ``python -m`` of a module the package
already imported (``worker``, imported by ``client``) runs it a second time beside the imported copy,
which Python warns about (RuntimeWarning: found in sys.modules ... prior to execution).
"""
from __future__ import annotations

import sys
import time

from megatron_fp4.rl.rollouts.worker import parse_spec, serve
from megatron_fp4.rollout.weight_sync.peer_group import sync_token_from_env


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m megatron_fp4.rl.rollouts.worker_main '<JSON spec>' (started by "
                         "RemoteRollout)")
    token = sync_token_from_env()
    if token is None:
        raise SystemExit("the rollout worker needs MEGATRON_FP4_SYNC_TOKEN in its environment (its trainer sets it)")
    start = time.perf_counter()
    serve(parse_spec(argv[0]), token)
    print(f"rollout worker: done after {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
