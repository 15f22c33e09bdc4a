"""Where the "megatron_fp4" checkpoint engine's weights flow, and the process group that carries them.

Topology (the same in both modes; `assign_ranks` is pure):
  * actor worker 0 is the only sender (rank 0). It broadcasts one full snapshot to every rollout.
    The other actor workers get rank -1: their `send_weights` walks the generator (producing each
    weight may itself be collective over the actor group) and returns. A full snapshot already
    sits on actor rank 0 (`get_per_tensor_param` gathers it), so extra senders would only add
    copies of the same bytes.
  * rollout workers get ranks 1..N.
  * mode "inprocess" when every worker reported the same process (colocated engines, tests, the
    CPU example); mode "dist" otherwise (verl's deployment: actor and rollout workers are separate
    Ray actors).

`PeerGroup` is the "dist" mode's group: a token-authenticated rendezvous store served by rank 0 on
the port it reserved in `prepare()`, and a ProcessGroupGloo (CPU) or ProcessGroupNCCL (CUDA) built on it. It is never
registered with torch.distributed, needs no default group and cannot collide with one (verl's
workers run their own default groups for training). Ranks are group ranks.

Exposure (see SECURITY.md): rank 0's store listens on exactly the address it advertises (the
socket `reserve_port` binds is the one the store serves), and gloo's connections bind that address
(rank 0) or this host's address (`host_address`, the other ranks). A connection to the store is
served only after it proved, and rank 0 proved back, that it holds the shared token
(`MEGATRON_FP4_SYNC_TOKEN` from the launcher's environment, else one the publisher generated in
`prepare()` and verl's controller handed over with the master's metadata): an HMAC-SHA256 over
fresh nonces (`rollout.weight_sync.peer_store`); the group's connections are confirmed the same way before it
is used (`rollout.weight_sync.peer_group`). The messages that follow are JSON (`rollout.weight_sync.distributed`),
never pickle.
"""
from __future__ import annotations

import os
import socket

# The group itself is not verl's: it lives in rollout/weight_sync/peer_group.py (the GRPO rollout process uses
# it too); its names stay importable from here.
from megatron_fp4.rollout.weight_sync.peer_group import (TOKEN_ENV, PeerGroup, host_address, new_sync_token,  # noqa: F401
                                                         reserve_port, sync_token_from_env)


def process_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def assign_ranks(actor_wg_world_size: int, rollout_world_size: int, metadata: list) -> tuple:
    """Pure: (actor kwargs lists, rollout kwargs lists) for `init_process_group`; see the module doc."""
    if actor_wg_world_size < 1 or rollout_world_size < 1:
        raise ValueError(f"need at least one actor and one rollout worker, got actor_wg_world_size="
                         f"{actor_wg_world_size}, rollout_world_size={rollout_world_size}")
    if len(metadata) != actor_wg_world_size + rollout_world_size:
        raise ValueError(f"got {len(metadata)} prepare() results for {actor_wg_world_size} actor + "
                         f"{rollout_world_size} rollout workers; pass every worker's, actor workers first")
    master = metadata[0]
    mode = "inprocess" if len({m["process"] for m in metadata}) == 1 else "dist"
    world_size = 1 + rollout_world_size

    def kwargs(ranks):
        n = len(ranks)
        return {"rank": ranks, "world_size": [world_size] * n, "master_metadata": [master] * n,
                "mode": [mode] * n, "channel": [master["channel"]] * n}
    return kwargs([0] + [-1] * (actor_wg_world_size - 1)), kwargs(list(range(1, world_size)))


