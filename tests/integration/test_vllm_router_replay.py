"""R3 router replay with vLLM rollouts (issue 25): the routes the plugin records in vLLM for every
response token and MoE layer are what the trainer's MoE layers replay in the old-log-prob pass,
the reference pass and the update, at the positions that produced those tokens.

One `examples/grpo_moeresq.py --rollout vllm` run of two GRPO steps on the tiny model, with the
trainer in plain FP4 and vLLM in MoEResQ (``fp4.train_mode=fp4``, ``fp4.rollout_mode=fp4_resq``,
scope experts+attention, ``model.init_std=0.08``: the control of test_vllm_rollout, whose live
routes disagree with vLLM's on some tokens, so replay has something to fix; measured 89.3-90.1 % expert
agreement without replay, 99.2-99.6 % in the experts-only scope, 100 % with a bf16 trainer).
Step 0 runs ``rl.router_replay=r3``, step 1 ``off`` (the config is read every step; the same vLLM
process serves both). Forward hooks on the trainer's MoE layers record the
``routing_in`` each forward receives and the experts it used.

Runs where vllm imports or with MEGATRON_FP4_VLLM_PYTHON set (test_vllm_rollout's pattern; CI:
tools/vllm_env.sh); skips with the reason otherwise.
"""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.rl import loop
from tests.integration.test_vllm_rollout import MODEL, PYTHON_ARGS, _grpo, needs_vllm


def _expected_routes(gen, batch) -> torch.Tensor:
    """[B, T, num_moe_layers, k]: response token t of row i sits at position P + t and was produced by
    position P + t - 1, so vLLM's route for it belongs there; -1 (route live) everywhere else."""
    B, T = batch["input_ids"].shape
    P = batch["prompt_len"]
    M, k = gen.routing[0].shape[1:]
    out = torch.full((B, T, M, k), -1, dtype=torch.long)
    for i, (resp, routes) in enumerate(zip(gen.response_ids, gen.routing)):
        assert batch["input_ids"][i, P:P + len(resp)].tolist() == list(resp)
        assert routes.shape == (len(resp), M, k) and bool((routes >= 0).all())
        out[i, P - 1:P - 1 + len(resp)] = routes.long()
    return out


@needs_vllm
@pytest.mark.slow
def test_r3_replays_vllm_routes_in_every_trainer_forward(monkeypatch):
    grpo = _grpo()
    steps, run_grpo, build_rl_batch = [], grpo.run_grpo, loop.build_rl_batch
    held = {}

    def router_hook(module, args, output):  # the experts the router's caller uses (replayed or live)
        held["used"] = output[2].detach().clone()

    def hook(slot):
        def record(module, args, kwargs, output):
            routing_in = args[2] if len(args) > 2 else kwargs.get("routing_in")
            used = held.pop("used")
            steps[-1]["forwards"].append({"slot": slot, "grad": torch.is_grad_enabled(),
                                          "routing_in": None if routing_in is None else routing_in.detach().clone(),
                                          "used": used.view(*args[0].shape[:-1], -1)})
        return record

    def capturing_run_grpo(trainer, task, rollout, settings, *a, **k):
        held["trainer"] = trainer
        for slot, moe in enumerate(trainer.model.moe_layers()):
            moe.register_forward_hook(hook(slot), with_kwargs=True)
            moe.router.register_forward_hook(router_hook)
        return run_grpo(trainer, task, rollout, settings, *a, **k)

    def capturing_build_rl_batch(gen, *a, **k):
        steps.append({"mode": k["router_replay"], "gen": gen, "forwards": []})
        batch = build_rl_batch(gen, *a, **k)
        steps[-1]["batch"] = batch
        held["trainer"].cfg.rl.router_replay = "off"  # step 1: the control without replay
        return batch

    monkeypatch.setattr(grpo, "run_grpo", capturing_run_grpo)
    monkeypatch.setattr(loop, "build_rl_batch", capturing_build_rl_batch)
    # padded micro-batches (the example packs by default): the routes compared per [row, position]
    overrides = MODEL + ["rl.router_replay=r3", "fp4.train_mode=fp4", "fp4.rollout_mode=fp4_resq",
                         "fp4.scope=experts+attention", "model.init_std=0.08", "rl.max_tokens_per_micro_batch=0"]
    args = grpo.parse_args(["--rollout", "vllm", *PYTHON_ARGS, "--task", "arithmetic", "--steps", "2",
                            "--sft-steps", "2", "--eval-size", "4", "--num-prompts", "4", "--group-size", "4",
                            "--ppo-epochs", "1", "--minibatches", "1", "--kl-coef", "0.1", "--micro-batch-size", "16",
                            "--logdir", "", *[a for o in overrides for a in ("--set", o)]])
    history = grpo.run(args)
    assert [s["mode"] for s in steps] == ["r3", "off"]

    r3, off = steps
    expected = _expected_routes(r3["gen"], r3["batch"])
    slots = expected.shape[2]
    # Per MoE layer: the old-log-prob pass and the reference pass (no grad), the update (grad).
    assert len(r3["forwards"]) == 3 * slots and sum(f["grad"] for f in r3["forwards"]) == slots, \
        [(f["slot"], f["grad"]) for f in r3["forwards"]]
    for f in r3["forwards"]:
        assert f["routing_in"] is not None, f"MoE layer {f['slot']} routed live under r3"
        assert torch.equal(f["routing_in"], expected[:, :, f["slot"]]), f"MoE layer {f['slot']}: replayed routes " \
            "differ from vLLM's at the positions that produced the response tokens"
    assert torch.equal(r3["batch"]["replay_routing"], expected), "the batch's replay_routing (what the update " \
        "micro-batches carry) is not vLLM's routes at the producing positions"
    # The trainer's expert choice in the old-log-prob pass at the response positions, against vLLM's.
    agree = {}
    for name, step in (("r3", r3), ("off", off)):
        gen, P = step["gen"], step["batch"]["prompt_len"]
        # the old-log-prob pass: the first no-grad forward of each MoE layer
        first = {}
        for f in step["forwards"]:
            if not f["grad"]:
                first.setdefault(f["slot"], f["used"])
        used = torch.stack([first[slot] for slot in sorted(first)], dim=2)  # [B, T, M, k]
        trainer_routes = torch.cat([used[i, P - 1:P - 1 + len(r)] for i, r in enumerate(gen.response_ids)])
        vllm_routes = torch.cat(gen.routing).long()
        same = trainer_routes.sort(-1).values == vllm_routes.sort(-1).values
        agree[name] = same.all(-1).double().mean().item()  # per (token, layer): the same set of k experts
        print(f"{name}: {vllm_routes.shape[0]} response tokens x {vllm_routes.shape[1]} MoE layers, trainer/vLLM "
              f"expert agreement {agree[name]:.4f} (the loop's consistency/expert_agreement "
              f"{history[step is off]['consistency/expert_agreement']:.4f})")
    assert agree["r3"] == 1.0 and history[0]["consistency/expert_agreement"] == 1.0
    assert all(f["routing_in"] is None for f in off["forwards"])  # off: every forward routes live
    # The control: live FP4 routes differ from vLLM's MoEResQ routes on some tokens, so the 100 % above
    # is the replay's doing (routes dropped would leave it here).
    assert agree["off"] < 1.0, agree
