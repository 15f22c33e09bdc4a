"""The multi-process trainer: pipeline (pp, virtual stages), expert (ep) and data parallel (dp + ZeRO).

    trainer = build_trainer(cfg)   # under torchrun; the mesh comes from WORLD_SIZE and cfg.parallel
    trainer.train()

`ParallelTrainer` subclasses the single-process `Trainer` and reuses its loop, logging, NaN guard
and LR schedule; it only changes how the model and optimizer are built and what one
forward/backward is. Every rank builds the full model from the same seed, then keeps its pipeline
chunks (global parameter names kept) and its experts, so every layout starts from the weights of
the single-process run. The sampler gets (dp_rank, dp_size): each dp rank reads its contiguous part
of the same global batch, and the reported loss is the mean over all micro-batches of all dp ranks,
identical on every rank. The NaN guard's decision does not rely on that: it is a vote over the
whole mesh (see `training/nonfinite.py`), and the gate keeps every rank's collectives in step.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_fp4.config import Config
from megatron_fp4.config_validate import resolve_dp
from megatron_fp4.model import lm_loss
from megatron_fp4.parallel.mesh import ParallelMesh, resolve_device
from megatron_fp4.parallel.pipeline import PipelineRunner
from megatron_fp4.parallel.zero import ZeroAdamW
from megatron_fp4.training import dist_checkpoint as dcp_ckpt
from megatron_fp4.training.trainer import LossFn, Trainer, lm_loss_fn


def _apply_expert_parallel(model, cfg: Config, mesh: ParallelMesh):
    try:
        from megatron_fp4.parallel.expert_parallel import apply_expert_parallel
    except ImportError as err:  # pragma: no cover - only while EP is not in the tree
        raise NotImplementedError("parallel.ep > 1 needs megatron_fp4.parallel.expert_parallel, which is not "
                                  "available in this checkout; set parallel.ep=1") from err
    p = cfg.parallel
    return apply_expert_parallel(model, mesh, dispatcher=p.expert_dispatcher, chunk_tokens=p.gcmoe_chunk_tokens,
                                 transfer_sms=p.gcmoe_transfer_sms, ring_slots=p.gcmoe_ring_slots)


class ParallelTrainer(Trainer):
    def __init__(self, cfg: Config, mesh: ParallelMesh, build_data: bool = True):
        # Not Trainer.__init__: the model is cut and the optimizer sharded before anything uses them.
        cfg.validate(world_size=mesh.world_size)
        self.cfg, self.mesh, self.device = cfg, mesh, mesh.device
        p, s = cfg.parallel, cfg.schedule
        torch.manual_seed(s.seed)
        model = self._build_model()
        if p.ep > 1:
            _apply_expert_parallel(model, cfg, mesh)
        self.num_microbatches = s.global_batch_size // (s.micro_batch_size * mesh.dp)
        self.pipeline = None
        if mesh.pp > 1:
            self.pipeline = PipelineRunner(model, mesh, p.schedule, p.virtual_stages, self.num_microbatches,
                                           lm_loss, (s.micro_batch_size, s.seq_len))
        self.model = model
        self.optimizer = ZeroAdamW(model.named_parameters(), cfg.optimizer, mesh, p.zero_stage, p.bucket_size_mb)
        self.step = 0
        self._build_data(build_data)
        self._init_guard()

    def forward_backward(self, micro_batches: list[dict], loss_fn: LossFn) -> tuple[float, dict]:
        n = len(micro_batches)
        self.model.set_aux_loss_scale(1.0 / n)
        self.optimizer.prepare_grad_sync(n)
        if self.pipeline is not None:
            if loss_fn is not lm_loss_fn:
                raise NotImplementedError("with parallel.pp > 1 the trainer runs the LM objective (lm_loss_fn); "
                                          "custom loss functions need parallel.pp=1")
            if n != self.num_microbatches:
                raise ValueError(f"got {n} micro-batches but the pipeline schedule was built for "
                                 f"{self.num_microbatches} (schedule.global_batch_size / (micro_batch_size × dp))")
            loss, metrics = self.pipeline.run(micro_batches), {}
        else:
            loss, metrics = super().forward_backward(micro_batches, loss_fn)
        if self.mesh.dp > 1:  # the global mean: every dp rank ran the same number of micro-batches
            values = torch.tensor([loss] + list(metrics.values()), dtype=torch.float64, device=self.device)
            dist.all_reduce(values, group=self.mesh.group("dp"))
            values /= self.mesh.dp
            loss, metrics = float(values[0]), dict(zip(metrics, values[1:].tolist()))
        return loss, metrics

    # -- checkpoints: sharded (DCP), reshardable across dp and pp -------------------------------------
    def save_checkpoint(self, root: str):
        self.refuse_nonfinite_save(root)
        return dcp_ckpt.save(root, self)

    def load_checkpoint(self, path: str) -> int:
        dcp_ckpt.load(path, self)
        self.refuse_nonfinite_load(path)
        return self.step


def build_trainer(cfg: Config) -> ParallelTrainer:
    """Create the mesh of `cfg` for this torchrun process and the parallel trainer on it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.validate(world)
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = ParallelMesh.build(cfg.parallel.pp, resolve_dp(cfg, world), cfg.parallel.ep, device=device,
                              timeout_s=cfg.parallel.timeout_s)
    return ParallelTrainer(cfg, mesh)
