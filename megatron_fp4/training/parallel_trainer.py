"""Building the trainer of a torchrun process: `build_trainer(cfg)` makes the mesh of `cfg` for this
process and the one `Trainer` on it (every layout is `training.trainer.Trainer`; `ParallelTrainer`
is kept as another name for it, for callers written before there was only one trainer).

    trainer = build_trainer(cfg)   # under torchrun; the mesh comes from WORLD_SIZE and cfg.parallel
    trainer.train()
"""
from __future__ import annotations

import os

import torch

from megatron_fp4.config import Config
from megatron_fp4.config_validate import resolve_dp
from megatron_fp4.parallel.mesh import ParallelMesh, resolve_device
from megatron_fp4.training.trainer import Trainer

ParallelTrainer = Trainer


def build_mesh(cfg: Config) -> ParallelMesh:
    """The mesh of `cfg` for this process (torchrun's WORLD_SIZE; a mesh of size 1 without it)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return ParallelMesh.build(cfg.parallel.pp, resolve_dp(cfg, world), cfg.parallel.ep, device=device,
                              timeout_s=cfg.parallel.timeout_s)


def build_trainer(cfg: Config, build_data: bool = True) -> Trainer:
    """Create the mesh of `cfg` for this torchrun process and the trainer on it (the trainer
    validates the config against the mesh)."""
    return Trainer(cfg, build_mesh(cfg), build_data=build_data)
