"""Router replay for GRPO (R2/R3, arXiv 2510.11370; Megatron-Core's `RouterReplay`, verl's
``actor.router_replay.mode``): the trainer's MoE layers use recorded expert ids instead of their
own top-k, with combine weights from the live router at those ids (`model.moe.Router.forward`), so
gradients still reach the router.

- ``off``: every forward routes live.
- ``r2``: the trainer's own old-log-prob pass routes live and is recorded; the update passes replay
  it (the reference policy routes live, as in verl, whose reference pass records its own).
- ``r3``: the rollout's routes (`GenerationOutput.routing`) are replayed in the old-log-prob pass,
  the reference pass and the update passes.

Routes travel in the batch as ``replay_routing`` [B, T, num_moe_layers, k], aligned with the
*positions* (the model's ``routing_in``), not with the log-probs: the route behind log_probs[t] is
that of position t-1. R3 covers the positions that produced a response token — the last prompt
position (the engine's prefill route for it) and every response position but the last; the other
prompt positions route live (the engine records no prefill routes for them), and so do padding
and the last response position (it produces no scored token). Rows with -1 route live. Routes are
integer tensors (any integer dtype); float routes are refused, not rounded or truncated.

Auxiliary losses under replay (when their coefficients are set; RL usually runs with them off) are
computed as Megatron-Core does: the load-balancing fractions f_e from the experts actually used
(the replayed ones) and P_e and the z-loss from the live router, so they still shape the router.
The routes pass through every layout unchanged: the pipeline hands each stage the micro-batch's
``routing_in`` (`parallel/pipeline.py`), and the expert-parallel dispatchers (all-to-all, GC-MoE)
receive the replayed ids from the router like any others.
"""
from __future__ import annotations

import torch

from megatron_fp4.model.router import check_route_dtype

MODES = ("off", "r2", "r3")


def check_mode(mode: str, where: str = "rl.router_replay") -> str:
    """`mode` if it is one of `MODES`, else a ValueError naming `where`."""
    if mode not in MODES:
        raise ValueError(f"{where}={mode!r} must be one of {list(MODES)} (router replay: off, the trainer's own "
                         "old-log-prob routes in the update (r2), or the rollout's routes everywhere (r3))")
    return mode


def rollout_routes(gen, batch: dict) -> torch.Tensor:
    """R3: `gen.routing` (per request [L, num_moe_layers, k], the route behind log_probs[t]) placed at
    the positions of `batch` (`pad_prompt_response`'s layout, prompt length ``prompt_len``): response
    token t of row i was produced by position P-1+t. -1 everywhere else (route live)."""
    if gen.routing is None:
        raise ValueError("rl.router_replay=r3 needs the rollout's routes: generate with return_routing=True")
    B, T = batch["input_ids"].shape
    P = batch["prompt_len"]
    first = gen.routing[0]
    out = torch.full((B, T, *first.shape[1:]), -1, dtype=torch.long)
    for i, (routes, resp) in enumerate(zip(gen.routing, gen.response_ids)):
        if routes.shape[0] != len(resp) or routes.shape[1:] != first.shape[1:]:
            raise ValueError(f"rollout routes of request {i} have shape {tuple(routes.shape)} for {len(resp)} "
                             f"generated tokens; expected [{len(resp)}, {first.shape[1]}, {first.shape[2]}]")
        check_route_dtype(routes, f"rollout routes of request {i}")
        out[i, P - 1:P - 1 + len(resp)] = routes.to(torch.long)
    return out


def from_log_prob_alignment(routing: torch.Tensor) -> torch.Tensor:
    """R2: the scorer's routing [B, T, M, k] (row t: position t-1's route, behind log_probs[t]) at the
    positions: position t's route is row t+1; the last position (it predicts nothing) routes live."""
    return torch.cat([routing[:, 1:], torch.full_like(routing[:, :1], -1)], dim=1)
