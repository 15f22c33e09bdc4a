"""The one training step of `Trainer`, for every caller (the CLI, GRPO, verl's engine):

    trainer.forward_backward(micro_batches, loss_fn)   # once or several times (gradient accumulation)
    result = trainer.apply_update()                    # vote, clip, AdamW, lr schedule, step counter

`forward_backward` owns everything numerics-related around the micro-batches: it advances the
model's `fp4.Numerics` (`model.numerics`, built from the config at build time) explicitly, its step
position (stochastic-rounding streams keyed by the optimizer step and the global micro-batch index, also
across several calls of one step; deferred NaN/Inf flags), the `LayerGate`, the MoE auxiliary-loss
scale (1/micro-batches of the call, as Megatron's schedules set it), the per-step Q(W) cache and the
pipeline branch. `apply_update` takes the mesh-wide non-finite vote and then clips and steps, or
refuses the step on every rank (`schedule.nan_policy`). `train_step_with_loss` is the two in a row.

A micro-batch's gradient weight is 1/len(micro_batches) unless the caller passes `weights` (verl's
losses are normalised by the caller: by global token count, or by rows of the batch).
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_fp4.fp4 import NonFiniteInputError
from megatron_fp4.fp4.fused import adopt_ready as adopt_compiled_fp4
from megatron_fp4.model.moe import update_expert_bias
from megatron_fp4.training.forward_only import forward_rows
from megatron_fp4.training.nonfinite import NonFiniteError, all_finite
from megatron_fp4.training.optim import clip_coefficient, lr_at
from megatron_fp4.training.step_loss import (LossFn, context_parallel_loss, lm_loss_fn, require_step_loss,
                                             tensor_parallel_loss)


class TrainingStep:
    """The step methods of `Trainer` (which provides model, optimizer, mesh, gate, pipeline, cfg, step)."""

    _open_step: Optional[dict] = None  # what the forward_backward calls of the open step accumulated
    tp_plan = None  # the model's `TPPlan` under tensor parallelism (parallel/tensor_parallel.py)
    cp_plan = None  # its `ContextParallelPlan` under context parallelism (parallel/context.py)

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

    def forward_rows(self, batch: dict, row_loss, micro_batch_size: int, capture_routing: bool = False):
        """Forward-only per-row outputs of `batch` on any layout, the same on every rank: (rows [B, T],
        routes [B, T, num_moe_layers, k] or None); `training/forward_only.py`."""
        return forward_rows(self, batch, row_loss, micro_batch_size, capture_routing)

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
        """The model's `Numerics.cached_weights` around one step's forward/backward, unless
        `cache_weights_per_step` is off or a weight rounds stochastically: its draws are keyed by
        micro-batch, so the cache would only hold every micro-batch's Q(W) until the step ends."""
        if not self.cache_weights_per_step or any(
                getattr(getattr(m, "recipe", None), "weight", None) is not None
                and m.recipe.weight.rounding == "stochastic" for m in self.model.modules()):
            return nullcontext()
        return self.model.numerics.cached_weights()

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


def finite_checked_state(model) -> dict:
    """name -> tensor of what the NaN guard checks: every parameter and every floating-point buffer
    that is saved (the router's expert_bias moves outside the optimizer and is checkpointed too)."""
    return {name: t.detach() for name, t in model.state_dict(keep_vars=True).items() if t.is_floating_point()}


def finite_checked_buffers(model) -> dict:
    """The floating-point buffers of `finite_checked_state` (what the optimizer does not write)."""
    params = {id(p) for p in model.parameters()}
    return {n: t for n, t in finite_checked_state(model).items() if id(t) not in params}
