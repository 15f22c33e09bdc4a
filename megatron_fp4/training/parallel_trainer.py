"""Building the trainer of a torchrun process: `build_trainer(cfg)` is `Trainer(cfg)`, whose mesh
comes from `ParallelMesh.from_env(cfg)` (every layout is `training.trainer.Trainer`;
`ParallelTrainer` is kept as another name for it, for callers written before there was only one
trainer).

    trainer = build_trainer(cfg)   # under torchrun; the mesh comes from WORLD_SIZE and cfg.parallel
    trainer.train()
"""
from __future__ import annotations

from megatron_fp4.config import Config
from megatron_fp4.training.trainer import Trainer

ParallelTrainer = Trainer


def build_trainer(cfg: Config, build_data: bool = True) -> Trainer:
    """The trainer of `cfg` on this process's mesh (`ParallelMesh.from_env`)."""
    return Trainer(cfg, build_data=build_data)
