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

The one step, for every caller (the CLI's LM objective through `train_step_with_loss`, GRPO's policy
loss, verl's engine with verl's own loss functions):

    trainer.forward_backward(micro_batches, loss_fn)   # once or several times (gradient accumulation)
    result = trainer.apply_update()                    # vote, clip, AdamW, lr schedule, step counter

The loss is a `training.step_loss.StepLoss` (any layout) or a plain ``loss_fn(model, mb)`` (no
pipeline). `forward_backward` owns everything numerics-related around the micro-batches: it advances
the model's `fp4.Numerics` (`model.numerics`, built from the config at build time) explicitly, its
step position (stochastic-rounding streams keyed by the optimizer step and the global micro-batch
index, also across several calls of one step; deferred NaN/Inf flags), the `LayerGate`, the MoE
auxiliary-loss scale (1/micro-batches of the call, as Megatron's schedules set it), the per-step Q(W)
cache and the pipeline branch; ``forward_only=True`` is every scorer's forward (no gradients, any
layout). A micro-batch's gradient weight is 1/len(micro_batches) unless the caller passes `weights`
(verl's losses are normalised by the caller: by global token count, or by rows of the batch).
`apply_update` takes the mesh-wide non-finite vote and then clips and steps, or refuses the step on
every rank (`schedule.nan_policy`).

The NaN guard (`schedule.nan_policy`, from step 0): a `LayerGate` catches non-finite activations
and gradients at every layer boundary without breaking the step's collectives; after backward
every rank votes (one all-reduce over the whole mesh) on "anything non-finite here: gate, loss or
gradient norm", so all ranks skip or stop the same step with weights and optimizer state untouched.
After an update the new weights are checked too, and non-finite weights are never saved.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_fp4.config import Config, ConfigError
from megatron_fp4.fp4 import NonFiniteInputError
from megatron_fp4.fp4.fused import CompiledKernels
from megatron_fp4.fp4.fused import adopt_ready as adopt_compiled_fp4
from megatron_fp4.model import MoETransformer, materialize
from megatron_fp4.model.moe import update_expert_bias
from megatron_fp4.model.specs import numerics_from_config
from megatron_fp4.parallel.context import parallelize_cp
from megatron_fp4.parallel.mesh import ParallelDims, ParallelMesh, world_size_from_env
from megatron_fp4.parallel.zero import ZeroAdamW, mark_tp_replicas
from megatron_fp4.training.checkpoint import directory as ckpt
from megatron_fp4.training.checkpoint import dcp as dcp_ckpt
from megatron_fp4.training.data import ResumableSampler, build_dataset, get_batch
from megatron_fp4.training.forward_only import forward_rows
from megatron_fp4.training.metrics import MetricsLogger
from megatron_fp4.training.model_cut import cut_model, moe_tokens
from megatron_fp4.training.nonfinite import (LayerGate, NonFiniteError, all_finite, finite_checked_buffers,
                                             finite_checked_state)
from megatron_fp4.training.optim import clip_coefficient, lr_at
from megatron_fp4.training.preemption import PreemptionHandler, stop_if_requested
from megatron_fp4.training.step_loss import (LossFn, StepLoss, context_parallel_loss, lm_loss_fn, require_step_loss,
                                             tensor_parallel_loss)

__all__ = ["Trainer", "NonFiniteError", "lm_loss_fn", "LossFn", "StepLoss"]


class Trainer:
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

    # -- the step: forward_backward (once or more) + apply_update -------------------------------------
    def train_step_with_loss(self, micro_batches: list[dict], loss_fn: LossFn = lm_loss_fn) -> dict:
        """`forward_backward` over the micro-batches, then `apply_update`."""
        self.model.train()
        self.zero_grad()
        self.forward_backward(micro_batches, loss_fn)
        return self.apply_update()

    def zero_grad(self) -> None:
        """Start a fresh step: zero gradients; what `forward_backward` accumulated since the last
        `apply_update` (if anything) is dropped."""
        self.optimizer.zero_grad()
        self._open_step = None

    def train_step(self) -> dict:
        return self.train_step_with_loss(self.next_micro_batches(), lm_loss_fn)

    def forward_backward(self, micro_batches: list[dict], loss_fn: LossFn, *, weights: Optional[Sequence[float]] = None,
                         accumulate: bool = False, forward_only: bool = False) -> tuple[float, dict]:
        """Forward and backward of this rank's `micro_batches` into the gradients of the open step
        (opened by the first call after `apply_update`). Each micro-batch's loss is scaled by its
        weight (default 1/len(micro_batches)); with pp > 1 the pipeline schedule runs them (default
        weights only). `accumulate`: more calls may follow before `apply_update`, so ZeRO's bucket
        reductions wait for `apply_update` instead of starting during this backward. `forward_only`:
        no gradients, nothing counted towards the step; the FP4 context is the open step's.
        Returns (Σ weight·loss, Σ weight·metrics), averaged over the dp ranks."""
        n = len(micro_batches)
        if n == 0:
            raise ValueError("forward_backward: no micro-batches")
        loss_fn = context_parallel_loss(tensor_parallel_loss(loss_fn, self.tp_plan), self.cp_plan)
        if weights is not None and (len(weights) != n or self.pipeline is not None):
            raise ValueError(f"forward_backward: weights ({len(weights)}) need one per micro-batch ({n}) and "
                             f"parallel.pp=1 (the pipeline weights its micro-batches 1/n)")
        if self._open_step is None and not forward_only:
            self.gate.reset()
            self._open_step = {"micro_batches": 0, "calls": 0, "loss": 0.0, "metrics": {}, "tokens": 0,
                               "start": time.perf_counter()}
        done = 0 if self._open_step is None else self._open_step["micro_batches"]
        # The global index of this rank's first micro-batch: the step's earlier calls on every dp
        # rank, then the dp ranks before this one (each reads a contiguous share of the batch; the cp
        # ranks of one dp replica share its micro-batches).
        first = done * self.mesh.data_dp + self.mesh.coord("data") * n
        if forward_only:  # every layout: with pp > 1 the schedule's forward-only mode (`forward_rows`)
            with torch.no_grad(), self.model.numerics.training_step(self.step, first_micro_batch=first), \
                    self._weight_cache():
                if self.pipeline is not None:
                    return self.pipeline.run(micro_batches, require_step_loss(loss_fn), forward_only=True)
                return self._local_forward_backward(micro_batches, loss_fn, weights, backward=False)
        self.model.set_aux_loss_scale(1.0 / n)
        if not accumulate and done == 0:
            self.optimizer.prepare_grad_sync(n, self._grads_changed_after_backward())
        # Weights are constant until the optimizer step, so each Q(W) is derived once per step, not
        # once per micro-batch (`Numerics.cached_weights`; stochastic-rounding weights are keyed by micro-batch).
        # Non-finite FP4 operands are flagged on the device (deferred), never raised mid-step, with or
        # without a pipeline: every rank finishes the step's sends, receives and collectives, then
        # reads the flags once here, and the vote in `apply_update` refuses the step everywhere.
        with self.model.numerics.training_step(self.step, first_micro_batch=first, defer_nonfinite=True) as fp4_step, \
                self.gate.watching(self.model.layers), self._weight_cache():
            try:
                if self.pipeline is not None:
                    loss, metrics = self.pipeline.run(micro_batches, require_step_loss(loss_fn))
                else:
                    loss, metrics = self._local_forward_backward(micro_batches, loss_fn, weights)
            except NonFiniteInputError as err:  # raised outside the deferred flags: same policy as a NaN loss
                self.gate.trip(f"an FP4 operand ({err})")
                loss, metrics = math.nan, {}
            deferred = fp4_step.nonfinite_error()  # the call's deferred FP4 NaN/Inf flags: one sync
        if deferred is not None:  # read after the call: name the tensor also when the gate tripped first
            where = self.gate.where
            self.gate.reset()
            self.gate.trip(f"an FP4 operand ({deferred})" + (f"; and the {where}" if where else ""))
            loss, metrics = math.nan, {}
        if self.mesh.dp > 1:  # the global mean: every dp rank ran the same number of micro-batches
            values = torch.tensor([loss] + list(metrics.values()), dtype=torch.float64, device=self.device)
            dist.all_reduce(values, group=self.mesh.group("dp"))
            values /= self.mesh.dp
            loss, metrics = float(values[0]), dict(zip(metrics, values[1:].tolist()))
        step = self._open_step
        step["micro_batches"] += n
        step["calls"] += 1
        step["loss"] += loss
        for key, value in metrics.items():
            step["metrics"][key] = step["metrics"].get(key, 0.0) + value
        step["tokens"] += sum(mb["tokens"].numel() for mb in micro_batches if "tokens" in mb)
        return loss, metrics

    def forward_rows(self, batch: dict, row_loss, micro_batch_size: int, capture_routing: bool = False,
                     max_tokens: int = 0):
        """Forward-only per-row outputs of `batch` on any layout, the same on every rank: (rows [B, T],
        routes [B, T, num_moe_layers, k] or None); `training/forward_only.py` (`max_tokens` > 0: packed
        micro-batches of at most that many tokens)."""
        return forward_rows(self, batch, row_loss, micro_batch_size, capture_routing, max_tokens)

    def _local_forward_backward(self, micro_batches: list[dict], loss_fn: LossFn,
                                weights: Optional[Sequence[float]], backward: bool = True) -> tuple[float, dict]:
        n = len(micro_batches)

        def weighted(i, x):  # x / n by default (the bits the trainer has always computed), else x · weight
            return x / n if weights is None else x * weights[i]

        total, metrics = 0.0, {}
        for i, mb in enumerate(micro_batches):
            with self.model.numerics.micro_batch(i):  # FP4 SR streams keyed by the global micro-batch index
                with self.autocast():
                    loss, extra = loss_fn(self.model, mb)
                if backward:
                    weighted(i, loss).backward()
            total += weighted(i, loss.detach().item())
            for key, value in extra.items():
                metrics[key] = metrics.get(key, 0.0) + weighted(i, float(value))
        return total, metrics

    def apply_update(self, schedule_step: Optional[int] = None) -> dict:
        """End the open step: clip and step unless anything was non-finite on any rank (one vote over
        the whole mesh; `schedule.nan_policy`: stop raises `NonFiniteError` on every rank, skip drops
        the step on every rank, up to `schedule.max_consecutive_skips` in a row), then count it.
        `schedule_step`: the position in the lr schedule (default: the step counter; verl's engine
        advances its own with `lr_scheduler_step`). Returns loss, grad_norm, lr, skipped (and message),
        tokens_per_s and the loss metrics (means over the step's forward_backward calls)."""
        step = self._open_step
        if step is None:
            raise ValueError("apply_update: no forward_backward since the last update (nothing to apply)")
        self._open_step = None
        loss = step["loss"] / step["calls"]
        metrics = {k: v / step["calls"] for k, v in step["metrics"].items()}
        if self.tp_plan is not None:
            self.tp_plan.finish_grads()  # partial grads summed over tp, before dp/edp reduce them
            if self.mesh.ep > 1:
                self._agree_whole_grads_over_tp()
        self.optimizer.finish_grad_sync()  # always: the same collectives on every rank
        grad_norm = self.optimizer.grad_norm()
        lr = lr_at(self.step if schedule_step is None else schedule_step, self.cfg.optimizer, self.cfg.schedule)
        result = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "skipped": False, **metrics}
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            self.gate.trip("loss" if not math.isfinite(loss) else "gradient norm")
        bad_ranks = self.mesh.ranks_with(self.gate.tripped)
        if bad_ranks:
            self.optimizer.zero_grad()
            result.update(skipped=True, message=self._refuse_step(bad_ranks, loss, grad_norm))
        else:
            finite = self.optimizer.step(lr, clip_coefficient(grad_norm, self.cfg.optimizer.clip_grad))
            self.consecutive_skips = 0
        # aux-loss-free MoE balancing: the router biases move outside the gradient (model/moe.py)
        update_expert_bias(self.model, applied=not bad_ranks, group=self.mesh.group("dp") if self.mesh.dp > 1 else None)
        if not bad_ranks:  # after the bias update: the check covers the buffers it moves too
            self.require_finite_weights(f"step {self.step}: the optimizer update (lr={lr:g}) or the router "
                                        f"bias update made weights non-finite",
                                        "the run stops; nothing was saved and the last checkpoint is intact. Lower "
                                        "optimizer.lr or raise optimizer.eps (an expert_bias: lower "
                                        "model.moe_router_bias_update_rate)", params_finite=finite)
        self.step += 1
        elapsed = time.perf_counter() - step["start"]
        result["tokens_per_s"] = step["tokens"] / elapsed if elapsed > 0 else float("nan")
        # Between steps, nothing else running: the one point where compiled fake-quant kernels whose
        # warm-up finished (fp4.compile=auto) are switched in (same bits; fp4/fused.py).
        adopt_compiled_fp4(self.model.numerics.kernels)
        return result

    def _grads_changed_after_backward(self) -> list:
        """Params whose grads `apply_update` changes before ZeRO may reduce them (their buckets wait):
        tensor parallel's partial sums and shared kv heads, and (tp × ep) the weights held whole."""
        if self.tp_plan is None:
            return []
        if self.mesh.ep > 1:
            return [p for p in self.model.parameters()
                    if getattr(p, "tp_shard", None) is None and not getattr(p, "is_expert", False)] + \
                [p for p, _, _ in self.tp_plan.kv_slots]
        return list(self.tp_plan.partial_grads) + [p for p, _, _ in self.tp_plan.kv_slots]

    def _agree_whole_grads_over_tp(self) -> None:
        """Under tp × ep the tp peers dispatch the same tokens to experts in batches of another
        composition, so the gradients of weights every tp rank holds whole (routers, norms, shared
        experts) can differ in the last bits: their mean over tp keeps the replicas the same bits."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None
                 and getattr(p, "tp_shard", None) is None and not getattr(p, "is_expert", False)]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.mesh.group("tp"))
            flat /= self.mesh.tp
            for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(piece.view_as(g))

    def _weight_cache(self):
        """The model's `Numerics.cached_weights` around one step's forward/backward (weights are
        constant until the optimizer step), unless a weight rounds stochastically: its draws are keyed
        by micro-batch, so the cache would only hold every micro-batch's Q(W) until the step ends.

        The store belongs to the open step (every `forward_backward` call of one step, and the
        `forward_only` calls inside it, share it: a step of several calls, as GRPO's and verl's
        mini-batches make, derives each Q(W) once, not once per call) and goes with it at
        `apply_update` / `zero_grad`. It must: the optimizer writes the weights through its flat
        master, which does not bump the parameters' version counters that guard the entries."""
        if any(
                getattr(getattr(m, "recipe", None), "weight", None) is not None
                and m.recipe.weight.rounding == "stochastic" for m in self.model.modules()):
            return nullcontext()
        store = None if self._open_step is None else self._open_step.setdefault("weight_cache", {})
        return self.model.numerics.cached_weights(store)

    def _refuse_step(self, bad_ranks: list[int], loss: float, grad_norm: float) -> str:
        """The message of a refused step; raises `NonFiniteError` when the policy says stop."""
        s = self.cfg.schedule
        where = f" (here: {self.gate.where})" if self.gate.where else ""
        ranks = f" on rank(s) {bad_ranks}" if self.mesh.world_size > 1 else ""
        message = (f"step {self.step}: non-finite values{ranks}{where}, loss={loss}, grad_norm={grad_norm}; the "
                   f"optimizer step was refused on every rank and the weights are unchanged. Lower optimizer.lr, "
                   f"check the data, or set schedule.nan_policy=skip to drop such steps")
        if s.nan_policy == "stop":
            raise NonFiniteError(message)
        self.consecutive_skips += 1
        if self.consecutive_skips > s.max_consecutive_skips:
            raise NonFiniteError(f"{self.consecutive_skips} steps in a row were non-finite, more than "
                                 f"schedule.max_consecutive_skips={s.max_consecutive_skips}: stopping. The weights "
                                 f"are those before the skipped steps. Last one: {message}")
        return message

    def require_finite_weights(self, what: str, consequence: str, error=NonFiniteError,
                               params_finite: Optional[bool] = None) -> None:
        """Raise `error` on every rank unless every rank's weights are finite (a mesh-wide vote): the
        parameters and every saved floating-point buffer. `params_finite`: this rank's answer for the
        parameters when already known (the update checks what it wrote, `ZeroAdamW.step`; the weights
        it did not touch were checked when loaded or before); the buffers are always checked."""
        if params_finite is None:
            local_finite = all_finite(finite_checked_state(self.model).values())
        else:
            local_finite = params_finite and all_finite(finite_checked_buffers(self.model).values())
        bad = self.mesh.ranks_with(not local_finite)
        if bad:
            ranks = f" on rank(s) {bad}" if self.mesh.world_size > 1 else ""
            tensors = finite_checked_state(self.model)
            first = next((n for n, t in tensors.items() if not all_finite([t])), None)
            here = f" (here: {first})" if first else ""
            raise error(f"{what}{ranks}{here}; {consequence}")

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
        if self._open_step is not None:  # new weights: the open step's Q(W) store no longer holds
            self._open_step.pop("weight_cache", None)
        dcp_ckpt.load(path, self)
        self.refuse_nonfinite_load(path)
        return self.step

    def refuse_nonfinite_load(self, path: str) -> None:
        self.require_finite_weights(f"checkpoint {path} holds non-finite weights", "load an earlier step",
                                    error=ckpt.CheckpointError)
