"""Worker bodies of the NaN-guard fault tests (run on 2 gloo processes by tests/distributed/launch.py)."""
from __future__ import annotations

import torch

from megatron_fp4.config import Config

NAN = float("nan")
MODES = ("act", "grad", "fp4")


def tiny_cfg(pp: int, policy: str = "skip") -> Config:
    cfg = Config()
    cfg.model.num_layers = 2
    s = cfg.schedule
    s.global_batch_size, s.micro_batch_size, s.seq_len, s.train_steps, s.warmup_steps = 8, 2, 16, 20, 0
    s.nan_policy = policy
    cfg.data.num_samples = 200
    cfg.logging.tensorboard_dir, cfg.logging.progress, cfg.logging.log_interval = None, False, 0
    cfg.parallel.pp, cfg.parallel.timeout_s = pp, 60.0  # experts stay in FP4 (the quantizers' checks)
    return cfg


def local_layers(trainer) -> list:
    return [layer for layer in trainer.model.layers if hasattr(layer, "mlp")]  # not pipeline placeholders


def inject(trainer, mode: str):
    """Poison this rank only. 'act': NaN activations entering its first local layer (forward);
    'grad': NaN gradient leaving its last local layer towards the layers/stage before (backward);
    'fp4': NaN entering the FP4 experts inside its first local layer, past the layer gate: a
    non-finite FP4 operand, flagged by the quantizer mid-schedule."""
    if mode == "fp4":
        def pre_fp4(module, args):
            return (args[0] * NAN,) + tuple(args[1:])
        return local_layers(trainer)[0].mlp.experts.register_forward_pre_hook(pre_fp4)
    if mode == "act":
        def pre(module, args):
            return (args[0] * NAN,) + tuple(args[1:])
        return local_layers(trainer)[0].register_forward_pre_hook(pre)

    def pre_grad(module, args):
        x = args[0].view_as(args[0])  # a fresh tensor: the stage's receive buffer is reused across steps
        x.register_hook(lambda g: g * NAN)
        return (x,) + tuple(args[1:])
    return local_layers(trainer)[-1].register_forward_pre_hook(pre_grad)


def snapshot(trainer) -> dict:
    opt = trainer.optimizer
    return {"params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
            "adam": [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.adam_state(i).items()}
                     for i in range(len(opt.buffers))],
            "sampler": trainer.sampler.state_dict(), "step": trainer.step}


def same_state(a: dict, b: dict) -> bool:
    if a["params"].keys() != b["params"].keys():
        return False
    params = all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
    adam = all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k]
               for x, y in zip(a["adam"], b["adam"]) for k in x)
    return params and adam


def one_step(trainer, victim: int, mode: str) -> dict:
    """One step with `mode` injected on rank `victim`; what this rank saw and whether its state moved."""
    from megatron_fp4.training.trainer import NonFiniteError

    before = snapshot(trainer)
    handle = inject(trainer, mode) if trainer.mesh.rank == victim else None
    try:
        result = trainer.train_step()
        outcome = {"decision": "skipped" if result["skipped"] else "stepped", "message": result.get("message", "")}
    except NonFiniteError as err:
        outcome = {"decision": "stopped", "message": str(err)}
    finally:
        if handle is not None:
            handle.remove()
    after = snapshot(trainer)
    outcome.update(unchanged=same_state(before, after), sampler_before=before["sampler"],
                   sampler_after=after["sampler"], tripped_here=getattr(getattr(trainer, "gate", None), "tripped", None))
    return outcome


def nan_guard_worker(rank, world_size, pp, victim, max_skips, parallel=None):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    cfg = tiny_cfg(pp)
    for key, value in (parallel or {}).items():
        setattr(cfg.parallel, key, value)
    cfg.model.num_layers = max(2, cfg.parallel.pp * cfg.parallel.virtual_stages)  # a layer per chunk
    cfg.schedule.max_consecutive_skips = max_skips
    mesh = ParallelMesh.build(pp, world_size // pp, 1, timeout_s=cfg.parallel.timeout_s)
    trainer = Trainer(cfg, mesh)
    out = {"first": trainer.train_step()["loss"], "cases": {}}
    for policy in ("skip", "stop"):
        cfg.schedule.nan_policy = policy
        for mode in MODES:
            out["cases"][(policy, mode)] = one_step(trainer, victim, mode)
            clean = trainer.train_step()  # the collectives are still in step
            out["cases"][(policy, mode, "after")] = (clean["loss"], clean["skipped"])
    # The cap: max_skips skipped steps in a row, then every rank stops.
    cfg.schedule.nan_policy = "skip"
    out["cap"] = [one_step(trainer, victim, "act")["decision"] for _ in range(max_skips + 1)]
    trainer.optimizer.remove_hooks()
    return out
