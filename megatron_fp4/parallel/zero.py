"""ZeRO-sharded AdamW in the spirit of Megatron-Core's distributed optimizer.

Megatron-Core's distributed optimizer needs CUDA (its buffers, streams and NCCL calls), so it cannot
run on the CPU/gloo path this project is developed on; this is a small portable equivalent. It is
the trainer's one optimizer at every size: a single process (no process group) is a group of size 1,
where nothing is padded or reduced and the update is `torch.optim.AdamW(fused=True)`'s, bit for bit.

Layout. Parameters are grouped by (dtype, reduction axis, weight decay). Each group is one
`FlatBuffer`: the params' data and ``.grad`` are views into two contiguous flat tensors, laid out in
reverse model order (the order backward produces them) and cut into buckets of about
``bucket_size_mb``, each padded to a multiple of the group size. The reduction axis is a property of
the buffer: ``dp`` for ordinary params, ``edp`` for expert params (``param.is_expert``), or the
param's own ``grad_axis`` (``embed`` for tied embeddings split over pipeline stages), so expert
parallelism and tied embeddings are not special cases anywhere else.

Sharding. Rank r of a buffer's group *owns* the r-th slice of every bucket. ZeRO stage

- 0: buckets are all-reduced; every rank keeps fp32 masters + Adam state of the whole buffer;
  an fp32 buffer is its own master (no copy), as at any stage in a group of one (a single process);
- 1: buckets are all-reduced; masters + Adam state exist only for the owned slices (1/dp);
- 2: buckets are reduce-scattered (gloo supports ``reduce_scatter_tensor``), each rank keeps only
  its reduced grad shard (``p.grad`` outside the owned slice then holds un-reduced local values).
  As in Megatron the full-size grad buffer stays, as the accumulation target of the micro-batches.

After the step the owned master slices are all-gathered back into the param buffer. Adam itself is
`torch.optim.AdamW` with torch's fused kernel (CPU and CUDA; elsewhere its default step) on the flat
master shard (one param per buffer, uniform weight decay), so its math is the library's, element for
element. At 100M+ parameters every pass over them counts (issue 37): the step makes one pass (the
fused kernel, fed the clipped gradient piece by piece from a small buffer), the norm one (squares
summed piece by piece), and a rank's contiguous ranges are views, never copies.

Overlap. ``prepare_grad_sync(num_microbatches)`` arms post-accumulate-grad hooks: when every param of
a bucket has accumulated its last micro-batch's gradient, the bucket's collective starts
asynchronously while backward continues; `finish_grad_sync` waits for them (and reduces any bucket
the hooks did not launch, so correctness never depends on the hooks).

Gradient norm: squares of the owned slices, all-reduced over dp then pp. Owned slices are disjoint
across dp (ordinary params) and across edp×ep = dp (expert params), and stages are disjoint across
pp, so nothing is counted twice. With tensor parallelism (`_tp_sq_sum`) the tp shards are summed
over tp first and the parameters every tp rank holds whole counted once.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron_fp4.fp4.grad_fusion import FusedGrad
from megatron_fp4.model.layers import wide_dtype
from megatron_fp4.model.specs import no_weight_decay
from megatron_fp4.parallel.flat_buffer import (CHUNK_NUMEL, Bucket, FlatBuffer, all_finite_pieces, merge_ranges,
                                               owned_ranges, plan_buckets, sum_of_squares)

__all__ = ["ZeroAdamW", "mark_tp_replicas", "CHUNK_NUMEL", "merge_ranges", "owned_ranges", "plan_buckets",
           "sum_of_squares"]


def _reduce_scatter(out, inp, group, async_op):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _all_gather(out, inp, group, async_op):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _fused_adamw_on(device: torch.device) -> bool:
    """Whether torch has its fused AdamW kernel for `device` (CPU and CUDA do)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    return device.type in _get_fused_kernels_supported_devices()


def mark_tp_replicas(plan) -> None:
    """Mark the kv-head weights that `tp_replicas` tensor-parallel ranks hold as the same shard
    (fewer kv heads than ranks), so the gradient norm counts each once."""
    for p, rows, _ in plan.kv_slots:
        p.tp_replicas = plan.size * p.shape[0] // rows


class ZeroAdamW:
    """AdamW with fp32 master weights and optimizer state sharded over each buffer's group."""

    def __init__(self, named_params, opt_cfg, mesh, zero_stage: int = 1, bucket_size_mb: float = 4.0, *,
                 expert_token_copies: Optional[int] = None):
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"parallel.zero_stage={zero_stage!r} must be 0, 1 or 2")
        self.opt_cfg, self.mesh, self.zero_stage = opt_cfg, mesh, zero_stage
        # ranks of an edp group routing the same tokens (tp, MoE whole per tp rank: tp/etp; local: 1)
        self.expert_token_copies = mesh.tp // mesh.etp if expert_token_copies is None else expert_token_copies
        groups: dict[tuple, list] = {}
        for name, p in named_params:
            if not p.requires_grad:
                continue
            axis = getattr(p, "grad_axis", None) or (getattr(p, "expert_group", "edp") if getattr(p, "is_expert", False)
                                                      else "dp")
            wd = 0.0 if no_weight_decay(name, p) else opt_cfg.weight_decay
            groups.setdefault((p.dtype, axis, wd), []).append((name, p))
        self.buffers: list[FlatBuffer] = []
        for (dtype, axis, wd), items in groups.items():
            items = items[::-1]  # backward order: the last layers' grads are ready first
            bucket_numel = max(1, int(bucket_size_mb * 2**20 / torch.finfo(dtype).bits * 8))
            self.buffers.append(self._make_buffer(dtype, axis, wd, items, bucket_numel))
        self.optimizers, self.masters, self.grad_shards = [], [], []
        for buf in self.buffers:
            buf.state_ranges = [(0, buf.numel)] if zero_stage == 0 else buf.owned
            if buf.data.dtype == wide_dtype(buf.data.dtype) and (zero_stage == 0 or buf.group_size == 1):
                master = nn.Parameter(buf.data)  # shares storage: the (whole, unsharded) param buffer is the master
            else:
                master = nn.Parameter(buf.gather_ranges(buf.data, buf.state_ranges).detach().to(wide_dtype(dtype)).clone())
            self.masters.append(master)
            self.grad_shards.append(torch.zeros(master.numel(), dtype=buf.data.dtype, device=buf.data.device)
                                    if zero_stage == 2 else None)
            self.optimizers.append(torch.optim.AdamW([master], lr=opt_cfg.lr, betas=(opt_cfg.beta1, opt_cfg.beta2),
                                                     eps=opt_cfg.eps, weight_decay=buf.weight_decay,
                                                     fused=_fused_adamw_on(master.device)))
        self._hooks = []
        self._armed = False
        # Gradient-accumulation fusion (`fp4/grad_fusion.py`): the grouped expert kernels and the `batch`
        # level's dense tiled GEMMs write their weight gradients straight into a buffer zeroed for the step, where nothing is reduced
        # across ranks (a group of one: no bucket collective to overlap with backward).
        self._fused: list = []
        for buf in self.buffers:
            if buf.group is None or buf.group_size == 1:
                for i, p in enumerate(buf.params):
                    p.fused_grad = FusedGrad(p, buf.param_view(i, buf.grad))
                    self._fused.append((p, p.fused_grad))
        for buf in self.buffers:
            for b in buf.buckets:
                for p in b.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(buf, b)))

    def _make_buffer(self, dtype, axis, wd, items, bucket_numel) -> FlatBuffer:
        group = self.mesh.group(axis) if self.mesh.world_size > 1 else None
        size = self.mesh.size(axis) if group is not None else 1
        rank = dist.get_rank(group) if group is not None else 0
        names, params = [n for n, _ in items], [p for _, p in items]
        offsets, spans = plan_buckets([p.numel() for p in params], bucket_numel, size)
        device = params[0].device
        data = torch.zeros(spans[-1][1], dtype=dtype, device=device)
        grad = torch.zeros_like(data)
        buf = FlatBuffer(axis, group, size, rank, wd, names, params, offsets, [], data, grad,
                         owned_ranges(spans, size, rank))
        for i, p in enumerate(params):
            view = buf.param_view(i, data)
            view.copy_(p.detach())
            p.data = view
            p.grad = buf.param_view(i, grad)
        for start, end in spans:
            members = [p for i, p in enumerate(params) if start <= offsets[i] < end]
            buf.buckets.append(Bucket(start, end, members))
        return buf

    # -- gradient synchronisation -------------------------------------------------------------------
    def _make_hook(self, buf: FlatBuffer, bucket: Bucket):
        def hook(param):
            fused = getattr(param, "fused_grad", None)
            if fused is not None:  # the buffer holds an ordinary accumulation: no fused write may overwrite it
                fused.accumulated()
            if not self._armed or bucket.pending < 0:  # held: reduced in finish_grad_sync
                return
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch(buf, bucket)
        return hook

    def prepare_grad_sync(self, num_microbatches: int, hold=()) -> None:
        """Arm the hooks: a bucket's collective starts when each of its params has accumulated
        `num_microbatches` gradients. Buckets holding a param of `hold` (whose grads change after
        backward, e.g. tensor parallel's partial sums) wait for `finish_grad_sync`."""
        self._armed = True
        held = {id(p) for p in hold}
        for buf in self.buffers:
            for b in buf.buckets:
                b.pending = -1 if any(id(p) in held for p in b.params) else len(b.params) * num_microbatches
                b.work = None

    def _shard_slice(self, buf: FlatBuffer, bucket: Bucket) -> slice:
        """Where this bucket's owned slice sits in the flat shard (stage 2 grad shard)."""
        size = (bucket.end - bucket.start) // buf.group_size
        index = buf.buckets.index(bucket)
        start = sum((b.end - b.start) // buf.group_size for b in buf.buckets[:index])
        return slice(start, start + size)

    def _launch(self, buf: FlatBuffer, bucket: Bucket) -> None:
        chunk = buf.grad[bucket.start:bucket.end]
        if buf.group is None or buf.group_size == 1:
            if self.zero_stage == 2:
                self.grad_shards[self.buffers.index(buf)][self._shard_slice(buf, bucket)].copy_(chunk)
            bucket.work = True
            return
        if self.zero_stage == 2:
            shard = self.grad_shards[self.buffers.index(buf)][self._shard_slice(buf, bucket)]
            bucket.work = _reduce_scatter(shard, chunk, buf.group, async_op=True)
        else:
            bucket.work = dist.all_reduce(chunk, group=buf.group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Wait for (or start) every bucket's reduction and average over the group."""
        for k, buf in enumerate(self.buffers):
            for b in buf.buckets:
                if b.work is None:
                    self._launch(buf, b)
            for b in buf.buckets:
                if b.work is not True:
                    b.work.wait()
                b.work = None
            # SUM → mean over all dp ranks' micro-batches. 1/dp also for expert buffers reduced over
            # edp = dp/ep: their grads already hold the tokens of the ep peers (through the all-to-all
            # backward), so edp × ep = dp ranks' contributions are in the sum (Megatron's scaling).
            # Tensor parallel: the MoE layers run whole on every tp rank with the same tokens, so an
            # expert buffer reduced over edp (a stage's dp×tp ranks / ep) holds tp copies of each
            # dp rank's contribution: 1/(dp·tp) for it (``expert_token_copies``; local tokens: 1/dp).
            # Context parallel: the dp axis holds dp × cp ranks; a cp group's ranks hold shares of one
            # micro-batch's loss (`parallel/context.py`), summed here, so the mean is over dp / cp.
            num_replicas = self.mesh.dp // getattr(self.mesh, "cp", 1) if self.mesh.world_size > 1 else 1
            if buf.axis == "edp" and self.mesh.world_size > 1:
                num_replicas *= self.expert_token_copies
            if num_replicas > 1:
                (self.grad_shards[k] if self.zero_stage == 2 else buf.grad).mul_(1.0 / num_replicas)
        self._armed = False

    def _local_grad(self, k: int) -> torch.Tensor:
        """The reduced gradient matching master k's elements."""
        buf = self.buffers[k]
        if self.zero_stage == 2:
            return self.grad_shards[k]
        return buf.gather_ranges(buf.grad, buf.state_ranges)

    def zero_grad(self) -> None:
        for k, buf in enumerate(self.buffers):
            buf.grad.zero_()
            if self.grad_shards[k] is not None:
                self.grad_shards[k].zero_()
            for i, p in enumerate(buf.params):
                p.grad = buf.param_view(i, buf.grad)
        for _, fused in self._fused:
            fused.reset(zeroed=True)
        self._armed = False

    # -- norm and step -----------------------------------------------------------------------------
    def grad_norm(self) -> float:
        """Global L2 norm over every shard and every pipeline stage; inf/nan propagate."""
        wide = max((wide_dtype(b.data.dtype) for b in self.buffers), key=lambda d: d.itemsize, default=torch.float32)
        sq = torch.zeros((), dtype=wide, device=self.mesh.device)
        if self.mesh.tp > 1:
            sq = self._tp_sq_sum(wide)
        for k, buf in enumerate(self.buffers if self.mesh.tp == 1 else ()):
            if self.zero_stage == 2:
                sq += sum_of_squares(self.grad_shards[k], wide)
            else:
                for lo, hi in merge_ranges(buf.owned):
                    sq += sum_of_squares(buf.grad[lo:hi], wide)
        if self.mesh.world_size > 1:
            for axis in ("dp", "pp"):
                if self.mesh.size(axis) > 1:
                    dist.all_reduce(sq, group=self.mesh.group(axis))
        return float(sq.sqrt())

    def _tp_sq_sum(self, wide) -> torch.Tensor:
        """Σ grad² of this stage's dp×tp ranks' owned slices, each distinct element once: tp shards
        (``tp_shard``, a replicated kv head weighted 1/``tp_replicas``) and expert buffers (ep > 1)
        summed over tp; parameters every tp rank holds whole (equal grads) counted once."""
        split = torch.zeros((), dtype=wide, device=self.mesh.device)
        whole = torch.zeros((), dtype=wide, device=self.mesh.device)
        for k, buf in enumerate(self.buffers):
            flat = self.grad_shards[k] if self.zero_stage == 2 else buf.gather_ranges(buf.grad, buf.owned)
            if buf.axis == "edp":  # a stage's dp×tp ranks refolded as edp×ep: every owned slice distinct
                split += sum_of_squares(flat, wide)
                continue
            for i, lo, hi, pos in buf.pieces(buf.owned):
                p, piece = buf.params[i], flat[pos:pos + hi - lo].to(wide).pow(2).sum()
                if getattr(p, "tp_shard", None) is None:
                    whole += piece
                else:
                    split += piece / getattr(p, "tp_replicas", 1)
        dist.all_reduce(split, group=self.mesh.group("tp"))
        return split + whole

    @torch.no_grad()
    def step(self, lr: float, clip_coef: float = 1.0) -> bool:
        """One AdamW update of every buffer; returns whether this rank's parameters are all finite
        after it (the trainer's post-update check, taken here while each piece is still in cache
        where the param buffer is the master: no extra pass over the weights)."""
        finite = True
        for k, (buf, master, opt) in enumerate(zip(self.buffers, self.masters, self.optimizers)):
            for group in opt.param_groups:
                group["lr"] = lr
            sums = []
            if opt.defaults["fused"]:
                sums = self._fused_step(opt, master, self._local_grad(k), clip_coef)
            else:  # a device without torch's fused AdamW: the library's step on a clipped copy
                grad = self._local_grad(k).to(master.dtype)
                master.grad = grad * clip_coef if clip_coef != 1.0 else grad
                opt.step()
                master.grad = None
            self._write_back(buf, master)
            if master.data_ptr() != buf.data.data_ptr() or not sums:  # the params are a cast or a gather
                sums = [buf.data[lo:lo + CHUNK_NUMEL].sum() for lo in range(0, buf.numel, CHUNK_NUMEL)]
            finite = finite and all_finite_pieces(buf.data, sums)
        return finite

    @staticmethod
    def _fused_step(opt: torch.optim.AdamW, master: torch.Tensor, grad: torch.Tensor, clip_coef: float) -> list:
        """`opt.step()` (torch's fused AdamW: one pass reading and writing master, grad, exp_avg and
        exp_avg_sq) with the gradient cast and clipped out of place, piece by piece into a small
        buffer (p.grad keeps the reduced, unclipped gradient). The same bits as ``opt.step()`` on the
        whole master with ``master.grad = grad.to(master.dtype) * clip_coef`` (tested). Returns the
        sum of every updated piece (for `all_finite_pieces`)."""
        sums = []
        group, state = opt.param_groups[0], opt.state[master]
        if not state:  # as torch.optim.AdamW(fused=True) initialises it
            state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state["step"] += 1
        copy = clip_coef != 1.0 or grad.dtype != master.dtype
        scratch = (torch.empty(min(CHUNK_NUMEL, master.numel()), dtype=master.dtype, device=master.device)
                   if copy else None)
        beta1, beta2 = group["betas"]
        # the pieces as views made by one split per tensor (slicing four tensors per piece in Python
        # cost more than the clipping multiply of a piece at 100M+ parameters)
        pieces = zip(master.detach().split(CHUNK_NUMEL), grad.split(CHUNK_NUMEL), state["exp_avg"].split(CHUNK_NUMEL),
                     state["exp_avg_sq"].split(CHUNK_NUMEL))
        for p, g, exp_avg, exp_avg_sq in pieces:
            if g.dtype == master.dtype and scratch is not None:
                g = torch.mul(g, clip_coef, out=scratch[:g.numel()])
            elif scratch is not None:  # cast, then clip in the master's dtype
                g = scratch[:g.numel()].copy_(g)
                if clip_coef != 1.0:
                    g.mul_(clip_coef)
            torch._fused_adamw_([p], [g], [exp_avg], [exp_avg_sq], [], [state["step"]], lr=group["lr"], beta1=beta1,
                                beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False,
                                maximize=False)
            sums.append(p.sum())
        return sums

    def _write_back(self, buf: FlatBuffer, master: torch.Tensor) -> None:
        """Copy updated masters into the param buffer and all-gather the owned slices."""
        if master.data_ptr() == buf.data.data_ptr():
            return  # the param buffer is the master (ZeRO-0 or a group of one, wide dtype)
        if self.zero_stage == 0:
            buf.data.copy_(master)
            return
        pos, works = 0, []
        for (lo, hi), bucket in zip(buf.owned, buf.buckets):
            piece = master[pos:pos + hi - lo].to(buf.data.dtype)
            pos += hi - lo
            if buf.group is None or buf.group_size == 1:
                buf.data[lo:hi].copy_(piece)
            else:
                works.append(_all_gather(buf.data[bucket.start:bucket.end], piece, buf.group, async_op=True))
        for w in works:
            w.wait()

    # -- state ---------------------------------------------------------------------------------------
    def state_bytes(self) -> dict:
        """Bytes of fp32 masters and Adam moments held by this rank (what ZeRO shards)."""
        masters = sum(m.numel() * m.element_size() for m in self.masters)
        moments = 0
        for opt, m in zip(self.optimizers, self.masters):
            st = opt.state.get(m, {})
            moments += sum(t.numel() * t.element_size() for key, t in st.items() if key != "step")
        return {"masters": masters, "moments": moments}

    def adam_state(self, k: int) -> dict:
        """Flat tensors of buffer k's state: master, exp_avg, exp_avg_sq (zeros before the first step)."""
        master = self.masters[k]
        st = self.optimizers[k].state.get(master, {})
        zeros = torch.zeros_like(master)
        return {"master": master.detach(), "exp_avg": st.get("exp_avg", zeros),
                "exp_avg_sq": st.get("exp_avg_sq", zeros), "step": float(st.get("step", 0.0))}

    def set_adam_state(self, k: int, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                       step: float) -> None:
        buf, m, opt = self.buffers[k], self.masters[k], self.optimizers[k]
        with torch.no_grad():
            m.copy_(master)
            if step > 0:  # the fused kernel reads `step` on the master's device (torch's own layout)
                fused = opt.defaults["fused"]
                step_t = (torch.tensor(float(step), dtype=torch.float32, device=m.device) if fused
                          else torch.tensor(float(step)))
                opt.state[m] = {"step": step_t, "exp_avg": exp_avg.clone().to(m.dtype),
                                "exp_avg_sq": exp_avg_sq.clone().to(m.dtype)}
            else:
                opt.state.pop(m, None)
            self._write_back(buf, m)

    def state_dict(self) -> dict:
        return {"zero_stage": self.zero_stage, "buffers": [self.adam_state(k) for k in range(len(self.buffers))]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["buffers"]) != len(self.buffers):
            raise ValueError("optimizer state was saved with a different parameter grouping; load the sharded "
                             "(dcp) checkpoint instead, which reshards by parameter name")
        for k, s in enumerate(state["buffers"]):
            self.set_adam_state(k, s["master"], s["exp_avg"], s["exp_avg_sq"], s["step"])

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for p, fused in self._fused:
            if p.__dict__.get("fused_grad") is fused:  # not a later optimizer's
                del p.fused_grad
        self._fused = []
