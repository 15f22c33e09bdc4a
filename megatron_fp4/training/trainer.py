"""The one trainer, for every layout: micro-batched forward/backward (or the pipeline schedule),
NaN guard, clipping, AdamW (`ZeroAdamW`, sharded over dp; one process is dp = 1), LR schedule,
logging, checkpoints (DCP at every size, `training/checkpoint/dcp.py`).

    trainer = Trainer(load_config("megatron_fp4/configs/tiny_moe.yaml"))          # one process
    trainer = Trainer(cfg, ParallelMesh.build(pp, dp, ep))                     # under torchrun
    history = trainer.train()

A single process is a mesh of size 1. The layout only changes how the model is cut (pipeline
chunks with global parameter names, local experts, tensor-parallel shards: `parallel.tp`, the LM
loss then vocab-parallel; `parallel.moe_tp_tokens` and `parallel.etp` for the MoE layers under tp)
and what one forward/backward is: with
``pp > 1`` the pipeline schedule runs the model's own forward pieces and the step's loss on the
last stage. Every rank builds only its part of the model (on the meta device, then materialised), each
parameter and expert drawn from its own seeded stream, so every layout starts from the
single-process weights. Each dp rank reads its contiguous part of the same global
batch (the ``parallel.cp`` ranks of one dp replica read the same micro-batches and split each
sequence, `parallel/context.py`), and the reported loss and metrics are the means over all
micro-batches of all dp ranks.

`forward_backward(micro_batches, loss_fn)` + `apply_update()` (`training/step.py`) is the one step
every caller goes through (the CLI's LM objective through `train_step_with_loss`, GRPO's policy loss,
verl's engine with verl's own loss functions); the loss is a `training.step_loss.StepLoss` (any
layout) or a plain ``loss_fn(model, mb)`` (no pipeline).

The NaN guard (`schedule.nan_policy`, from step 0): a `LayerGate` catches non-finite activations
and gradients at every layer boundary without breaking the step's collectives; after backward
every rank votes (one all-reduce over the whole mesh) on "anything non-finite here: gate, loss or
gradient norm", so all ranks skip or stop the same step with weights and optimizer state untouched.
After an update the new weights are checked too, and non-finite weights are never saved.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Optional

import torch

from megatron_fp4.config import Config, ConfigError
from megatron_fp4.fp4.fused import CompiledKernels
from megatron_fp4.model import MoETransformer, materialize
from megatron_fp4.model.specs import numerics_from_config
from megatron_fp4.parallel.context import parallelize_cp
from megatron_fp4.parallel.mesh import ParallelDims, ParallelMesh, world_size_from_env
from megatron_fp4.parallel.zero import ZeroAdamW, mark_tp_replicas
from megatron_fp4.training.checkpoint import directory as ckpt
from megatron_fp4.training.checkpoint import dcp as dcp_ckpt
from megatron_fp4.training.data import ResumableSampler, build_dataset, get_batch
from megatron_fp4.training.metrics import MetricsLogger
from megatron_fp4.training.model_cut import cut_model, moe_tokens
from megatron_fp4.training.nonfinite import LayerGate, NonFiniteError
from megatron_fp4.training.preemption import PreemptionHandler, stop_if_requested
from megatron_fp4.training.step import TrainingStep
from megatron_fp4.training.step_loss import LossFn, StepLoss, lm_loss_fn

__all__ = ["Trainer", "NonFiniteError", "lm_loss_fn", "LossFn", "StepLoss"]


class Trainer(TrainingStep):
    def __init__(self, cfg: Config, mesh: Optional[ParallelMesh] = None, build_data: bool = True):
        # The one place a run's config is validated: every entry point (CLI, torchrun, examples,
        # verl's engine, tests) builds this trainer; the layout (`ParallelDims`, every layout check)
        # against the world it will run on, and a mesh passed in must be that layout.
        cfg.validate()
        dims = ParallelDims.from_config(cfg, world_size_from_env() if mesh is None else mesh.world_size)
        if mesh is not None and mesh.dims != dims:
            raise ConfigError(f"the mesh passed to the Trainer has {mesh.dims}, but cfg.parallel gives {dims}; "
                              f"build the mesh from the config (ParallelMesh.from_env(cfg)) or fix cfg.parallel")
        self.cfg = cfg
        self.mesh = mesh or ParallelMesh.from_env(cfg)
        self.device = self.mesh.device
        s = cfg.schedule
        torch.manual_seed(s.seed)
        self.num_microbatches = s.global_batch_size // (s.micro_batch_size * self.mesh.data_dp)
        self.model, self.pipeline = self._build_model()
        if self.pipeline is not None:
            self.pipeline.prepare(self.num_microbatches, (s.micro_batch_size, s.seq_len // self.mesh.cp))
        self.optimizer = self.build_optimizer()
        self.step = 0
        self.cache_weights_per_step = True  # False: re-derive Q(W) every micro-batch (the benchmark's "before")
        self._build_data(build_data)
        self._init_guard()

    def build_optimizer(self) -> ZeroAdamW:
        """A fresh optimizer over this rank's parameters: `ZeroAdamW` at every size (sharded over
        dp; one process is a dp group of size 1)."""
        p = self.cfg.parallel
        return ZeroAdamW(self.model.named_parameters(), self.cfg.optimizer, self.mesh, p.zero_stage, p.bucket_size_mb,
                         expert_token_copies=self.mesh.tp // self.mesh.etp if self._moe_tokens() == "whole" else 1)

    def reset_optimizer(self) -> None:
        """Replace the optimizer by a fresh one (no moments, step 0) built from the current
        ``cfg.optimizer``; the old one's gradient hooks are removed first (ZeRO's hooks belong to it)."""
        self.optimizer.remove_hooks()
        self.optimizer = self.build_optimizer()

    def close(self) -> None:
        """Done with this trainer: its optimizer's gradient hooks are removed, so the trainer (and
        the process groups its mesh holds) can be freed — ZeRO's hooks sit on the parameters and hold
        the optimizer, which holds the mesh, a cycle through the tensors' C++ side that Python's
        collector cannot see. The groups themselves belong to whoever initialized torch.distributed
        (`megatron_fp4.train.run` destroys the ones it created). Idempotent; a closed trainer takes
        no more steps."""
        if self.optimizer is not None:
            self.optimizer.remove_hooks()
            self.optimizer = None

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _moe_tokens(self) -> str:
        """The tokens a tp rank's MoE layers route (``parallel.moe_tp_tokens``; "whole" without tp)."""
        return moe_tokens(self.cfg, self.mesh.tp)

    def _init_guard(self) -> None:
        self._sqnr = None
        self.gate = LayerGate()
        self.consecutive_skips = 0
        self._open_step = None

    def _build_model(self):
        """This rank's part of the model of the config, and its pipeline runner (None without pp).

        The model is constructed on the meta device, cut to this rank's experts and pipeline
        chunks, and only then materialised and initialised (`model.materialize`: each parameter
        and each expert from its own seeded stream), so a rank never allocates what it does not
        own and every shard equals the same slice of the single-process model bit for bit.
        Tensor parallelism (`parallelize_tp`) cuts the stage's dense weights after that: each tp
        rank briefly holds its stage's whole dense weights (not the experts, cut before), and its
        shards are the single process's slices by construction. Then the dtype of the config and
        the training-side FP4 mode."""
        cfg, mesh, p = self.cfg, self.mesh, self.cfg.parallel
        numerics = numerics_from_config(cfg, "train")
        numerics.kernels = CompiledKernels()  # this trainer's compiled FP4 kernels, adopted between its steps
        with torch.device("meta"):
            model = MoETransformer(cfg.model, cfg.fp4, numerics)
        pipeline, self.tp_plan = cut_model(model, cfg, mesh=mesh,
                                           materialize=lambda m: materialize(m, self.device, cfg.schedule.seed))
        if self.tp_plan is not None:
            mark_tp_replicas(self.tp_plan)
            if pipeline is not None:
                pipeline.set_tensor_parallel(mesh.tp, p.sequence_parallel)
        if cfg.dtype == "bf16" and self.device.type == "cpu":
            model.to(torch.bfloat16)
        elif cfg.dtype == "fp64":  # FP4 operands are still quantized from fp32, as defined
            model.to(torch.float64)
        model.set_fp4_mode(cfg.fp4.train_mode)
        # context parallel: the cp ranks of one data replica split its sequences (parallel/context.py)
        self.cp_plan = parallelize_cp(model, mesh.group("cp")) if mesh.cp > 1 else None
        return model, pipeline

    def _build_data(self, build_data: bool) -> None:
        """Dataset and this dp rank's sampler (the global batch is the same for every layout)."""
        self.dataset = self.sampler = None
        if build_data:
            s = self.cfg.schedule
            self.set_dataset(build_dataset(self.cfg.data, s.seq_len, s.seed, self.cfg.model.vocab_size))

    def set_dataset(self, dataset) -> None:
        """Train on `dataset` (``len`` and ``[i] -> (tokens, labels)``) from its start: this data
        replica's share of every global batch (``schedule.global_batch_size``, ``schedule.seed``)."""
        s = self.cfg.schedule
        self.dataset = dataset
        self.sampler = ResumableSampler(len(dataset), s.global_batch_size, s.seed,
                                        dp_rank=self.mesh.coord("data"), dp_size=self.mesh.data_dp)

    # -- data -------------------------------------------------------------------------------------
    def next_micro_batches(self) -> list[dict]:
        """This rank's share of the next global batch, cut into micro-batches."""
        tokens, labels = get_batch(self.dataset, self.sampler.next_batch())
        mbs = self.cfg.schedule.micro_batch_size
        return [{"tokens": t.to(self.device), "labels": l.to(self.device)}
                for t, l in zip(tokens.split(mbs), labels.split(mbs))]

    def autocast(self):
        if self.cfg.dtype == "bf16" and self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    # -- statistics -------------------------------------------------------------------------------
    def _moe_stats(self) -> dict:
        """Aux/z loss and expert load imbalance over the step's micro-batches (all MoE layers)."""
        aux, z, imbalance = [], [], []
        for moe in self.model.moe_layers():
            if moe.stats:
                aux += [s["aux_loss"].item() for s in moe.stats]
                z += [s["z_loss"].item() for s in moe.stats]
                counts = torch.stack([s["counts"] for s in moe.stats]).sum(0).float()
                imbalance.append((counts.max() / counts.mean()).item() if counts.mean() > 0 else math.nan)
            moe.stats.clear()
        if not aux:
            return {}
        return {"moe/aux_loss": sum(aux) / len(aux), "moe/z_loss": sum(z) / len(z),
                "moe/load_imbalance": sum(imbalance) / len(imbalance)}

    def _install_sqnr_probe(self):
        """On logging steps, measure the FP4 SQNR of the first MoE layer's expert inputs."""
        from megatron_fp4.fp4 import sqnr_db

        moes = self.model.moe_layers()
        if not moes or self.cfg.fp4.scope == "none":
            return None

        def hook(module, args):
            if self._sqnr is None and args[0].shape[0] > 0:
                self._sqnr = sqnr_db(args[0].detach(), module.recipe.input)

        return moes[0].experts.register_forward_pre_hook(hook)

    # -- the loop ---------------------------------------------------------------------------------
    def train(self, num_steps: Optional[int] = None, logger: Optional[MetricsLogger] = None,
              preemption: Optional[PreemptionHandler] = None) -> list[dict]:
        """Train to `schedule.train_steps` (or `num_steps` more). `preemption`: the run's signal
        handler (`megatron_fp4.train` passes one), read only in `between_steps`."""
        cfg = self.cfg
        end = cfg.schedule.train_steps if num_steps is None else self.step + num_steps
        is_logging_rank = self.mesh.rank == self.mesh.world_size - 1  # the last stage holds the loss
        own_logger = logger is None
        logger = logger or MetricsLogger(cfg.logging.tensorboard_dir, end, self.step, cfg.logging.progress,
                                         enabled=is_logging_rank)
        history = []
        try:
            while self.step < end:
                log_now = cfg.logging.log_interval > 0 and (self.step + 1) % cfg.logging.log_interval == 0
                self.model.set_record_stats(log_now)
                probe = self._install_sqnr_probe() if log_now else None
                self._sqnr = None
                result = self._train_step_or_peer_failure()
                if probe is not None:
                    probe.remove()
                if log_now:
                    result.update(self._moe_stats())
                    if self._sqnr is not None:
                        result["fp4/expert_input_sqnr_db"] = self._sqnr
                history.append(result)
                if result["skipped"]:
                    logger.write(result["message"])
                logger.log(self.step, {k: v for k, v in result.items() if k != "skipped"})
                logger.advance(result["loss"], {"lr": f"{result['lr']:.2e}"})
                self.between_steps(preemption)
            if cfg.checkpoint.dir and (not history or not cfg.checkpoint.save_interval
                                       or self.step % cfg.checkpoint.save_interval):
                self.save_checkpoint(cfg.checkpoint.dir)
        finally:
            self.model.set_record_stats(False)
            if own_logger:
                logger.close()
        return history

    def between_steps(self, preemption: Optional[PreemptionHandler] = None) -> None:
        """The check point after every step of `train`, before the next one (nothing else runs, every
        rank is here): the periodic checkpoint, then the preemption vote, the one place where a run
        stops early (SIGTERM/SIGUSR1 on any rank: every rank saves this step and raises `Preempted`)."""
        cfg = self.cfg
        saved = bool(cfg.checkpoint.dir and cfg.checkpoint.save_interval and self.step % cfg.checkpoint.save_interval == 0)
        if saved:
            self.save_checkpoint(cfg.checkpoint.dir)
        stop_if_requested(self, preemption, saved)

    def _train_step_or_peer_failure(self) -> dict:
        """`train_step`, with a collective that timed out or lost its peer reported as such."""
        try:
            return self.train_step()
        except RuntimeError as err:
            failure = None if isinstance(err, NonFiniteError) else self.mesh.peer_failure(err)
            if failure is None or self.mesh.world_size == 1:
                raise
            raise failure from err

    # -- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, root: str):
        """Collective: DCP at every size (one process included), reshardable across dp and pp
        (`training/checkpoint/dcp.py`). Refused, with the last checkpoint kept, when the weights
        are not finite."""
        self.refuse_nonfinite_save(root)
        return dcp_ckpt.save(root, self)

    def refuse_nonfinite_save(self, root: str) -> None:
        self.require_finite_weights(f"refusing to save step {self.step} to {root}: the weights are not finite",
                                    "the last checkpoint there is kept as it is")

    def load_checkpoint(self, path: str) -> int:
        """Resume a DCP checkpoint (a step dir, or a root: its newest intact step), written by any
        layout. One without optimizer state (`tools/convert_checkpoint.py from-hf`, or `upgrade` of
        a checkpoint of the former single-file format) starts with fresh Adam moments."""
        dcp_ckpt.load(path, self)
        self.refuse_nonfinite_load(path)
        return self.step

    def refuse_nonfinite_load(self, path: str) -> None:
        self.require_finite_weights(f"checkpoint {path} holds non-finite weights", "load an earlier step",
                                    error=ckpt.CheckpointError)
