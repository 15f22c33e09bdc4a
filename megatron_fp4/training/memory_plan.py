"""Memory per rank of a config and layout, from the project's own code: the planner behind
``tools/memory_plan.py`` (see docs/memory.md, "Planning").

- **Parameters**: each pipeline rank's model is built on the meta device and cut exactly as the
  trainer cuts it (`expert_parallel.local_expert_range` / `_local_experts`, then
  `pipeline.build_chunks` → `strip_to_local`, then `GroupedExperts.shard_ffn` for etp and
  `parallelize_tp` itself for tp, without a process group), so the parameter list is the trainer's.
- **Gradients and optimizer**: every mesh (one process included: a dp group of size 1) uses
  `ZeroAdamW` (parallel/zero.py): params and grads live in flat buffers per (dtype, reduction axis,
  weight decay), laid out by its own pure `plan_buckets` (padded to the axis' group size: dp of
  one tp coordinate, edp = dp·tp/(ep·etp) for experts, embed); fp32 masters and both Adam moments cover the owned slices at
  stages 1/2, the whole buffer at stage 0 (where an fp32 buffer is its own master, as in a group of
  one); stage 2 adds the reduced-grad shard. Every torch AdamW param (one per buffer) also holds a 4-byte ``step``.
- **Activations**: the bytes autograd saves for one micro-batch of a chunk (the larger of the LM
  step's and a packed RL one, `micro_batch_shape`; `layer_activation_bytes`, checked term by term
  against ``saved_tensors_hooks`` in tests/unit/test_memory_plan.py; by family: GQA, MLA, GPT-OSS,
  `attention_activation_bytes`; at the ``batch`` numerics level the block attention's q, k, v,
  output and log-sum-exp, `block_attention_bytes`, the tiled GEMMs' padded rows, `tiled_rows`;
  context parallel `cp_attention_bytes`, packed rows `packed_attention_bytes`), times the
  micro-batches in flight of the schedule, plus the FP4 ``Q(W)`` each MoEResQ linear saves
  (fp32, `_DgradHalf`; once per step under the trainer's per-step weight cache).
- **Transients**: the loss' logits, one module's returned weight gradients (`returned_grad_bytes`)
  and the update's temporaries; `RankPlan.total` is the peak of live bytes.

Expert rows per rank assume balanced routing (each rank's experts get ``tokens × top_k`` rows per
micro-batch on average); the real number varies with the router.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_fp4.config import Config, ConfigError
from megatron_fp4.fp4.row_calls import onednn_kernel_bytes, onednn_serves, tall_heights
from megatron_fp4.model import MoETransformer
from megatron_fp4.model.layers import wide_dtype
from megatron_fp4.model.moe import GroupedExperts
from megatron_fp4.model.router import Router
from megatron_fp4.model.specs import no_weight_decay
from megatron_fp4.parallel.dims import ParallelDims
from megatron_fp4.parallel.pipeline import PLACEMENT, rank_chunks, split_layers
from megatron_fp4.training.memory_activations import (activation_dtype, chunk_activation_bytes, gemm_device,
                                                      gemms_are_tiled, param_dtype)
from megatron_fp4.training.model_cut import RankCoords, cut_model
from megatron_fp4.parallel.flat_buffer import CHUNK_NUMEL, owned_ranges, plan_buckets

PLANNED_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
_STEP_BYTES = 4  # torch AdamW's per-param ``step`` scalar (float32)


@dataclass
class RankPlan:
    """Bytes held by one rank (all ranks of `ranks`, a contiguous range, hold the same)."""

    role: str
    ranks: range
    params: int
    grads: int
    masters: int
    moments: int
    steps: int
    activations: int
    fp4_weights: int  # Q(W) saved by the MoEResQ linears (fp32)
    head_transient: int  # last stage: logits and their gradient during the loss' backward
    step_transient: int = 0  # optimizer step: grad copies and AdamW's sqrt/denominator temporaries
    grad_transient: int = 0  # backward: one module's weight gradients before autograd adds them to the buffer
    kernel_cache: int = 0  # oneDNN's primitives for the `batch` level's wide fp32 GEMMs (`onednn_kernel_bytes`)
    # of those, how many are heights past the probed ones: made as calls first take them (a ceiling)
    kernel_tall: int = 0
    inflight: dict = field(default_factory=dict)  # chunk -> micro-batches in flight
    param_numel: int = 0

    @property
    def optimizer(self) -> int:
        return self.masters + self.moments + self.steps

    @property
    def total(self) -> int:
        """Peak live bytes of a step (what ``torch.cuda.max_memory_allocated`` reads; on CPU the C
        heap's in-use bytes): the state and Q(W) (cached from the step's first forward to the
        update) plus the larger of the backward's peak (the saved tensors, the loss' logits and one
        module's returned weight gradients) and the update's temporaries: the saved tensors are
        freed before the update, so the two never coexist (measured: benchmarks/bench_memory_plan.py,
        whose cp2 layout, with small activations and a large update temporary, told the sum from
        the larger). oneDNN's primitive cache (the ``batch`` level's wide GEMMs on CPU) is held from the
        first forward on. The allocator's retained free pages (peak RSS, CUDA's reserved bytes) come on top."""
        backward = self.activations + self.head_transient + self.grad_transient
        return (self.params + self.grads + self.optimizer + self.fp4_weights + self.kernel_cache
                + max(backward, self.step_transient))


def local_meta_model(cfg: Config, pp_rank: int, ep_rank: int, tp_rank: int = 0) -> MoETransformer:
    """This rank's model on the meta device, cut by the trainer's own sequence (`model_cut.cut_model`
    by shape: experts, pipeline chunks, etp, tp), in the trainer's dtype and FP4 mode."""
    with torch.device("meta"):
        model = MoETransformer(cfg.model, cfg.fp4)
    cut_model(model, cfg, ranks=RankCoords(pp=pp_rank, ep=ep_rank, tp=tp_rank))
    model.to(param_dtype(cfg))
    model.set_fp4_mode(cfg.fp4.train_mode)
    return model


# -- gradients and optimizer ----------------------------------------------------------------------
def _axis(p) -> str:
    """ZeroAdamW's reduction axis of a param."""
    return getattr(p, "grad_axis", None) or (getattr(p, "expert_group", "edp") if getattr(p, "is_expert", False) else "dp")


def _group_size(axis: str, p, dp: int) -> int:
    """The ranks of a reduction axis (parallel/dims.py): dp and embed are one tp coordinate's, edp
    refolds a stage's dp×tp ranks as edp×ep×etp."""
    return {"dp": dp, "edp": dp * p.tp // (p.ep * p.etp), "embed": 2 * dp if p.pp > 1 else dp}[axis]


def zero_bytes(named_params, cfg: Config, dp: int) -> dict:
    """Bytes of `ZeroAdamW`'s buffers on one rank: its grouping, `plan_buckets` and `owned_ranges`."""
    p = cfg.parallel
    groups: dict[tuple, list] = {}
    for name, t in named_params:
        if t.requires_grad:
            wd = 0.0 if no_weight_decay(name, t) else cfg.optimizer.weight_decay
            groups.setdefault((t.dtype, _axis(t), wd), []).append(t)
    out = dict(params=0, grads=0, masters=0, moments=0, steps=0, step_transient=0)
    for (dtype, axis, _), items in groups.items():
        size = _group_size(axis, p, dp)
        bucket_numel = max(1, int(p.bucket_size_mb * 2**20 / torch.finfo(dtype).bits * 8))
        _, spans = plan_buckets([t.numel() for t in items[::-1]], bucket_numel, size)
        numel, elem, wide = spans[-1][1], dtype.itemsize, wide_dtype(dtype).itemsize
        owned = sum(hi - lo for lo, hi in owned_ranges(spans, size, 0))
        state = numel if p.zero_stage == 0 else owned
        out["params"] += numel * elem
        out["grads"] += numel * elem + (owned * elem if p.zero_stage == 2 else 0)
        shares = (p.zero_stage == 0 or size == 1) and wide_dtype(dtype) == dtype  # the fp32 buffer is the master
        out["masters"] += 0 if shares else state * wide
        out["moments"] += 2 * state * wide
        out["steps"] += _STEP_BYTES
        # `step` (torch's fused AdamW, CPU and CUDA): the reduced grad is a view of the buffer unless
        # a rank's owned slices lie apart (ZeRO-1, several buckets: one cat); cast and clipping go
        # piece by piece through one `CHUNK_NUMEL` buffer (buffers step one after another: the largest counts).
        gathered = state * elem if p.zero_stage == 1 and size > 1 and len(spans) > 1 else 0
        out["step_transient"] = max(out["step_transient"], gathered + min(CHUNK_NUMEL, state) * wide)
    return out


def _fused_weights(module, cfg: Config) -> list:
    """The own parameters of `module` whose gradient kernel writes into the optimizer's zeroed
    buffer when granted (`fp4/grad_fusion.py`): a `GroupedExperts`' w13/w2 (the grouped FP4 kernel,
    `moeresq_grouped`; FP4 off, the tiled grouped GEMM) — not GPT-OSS's per-expert loop, whose
    GEMMs see one expert's slice of the parameter (a view: no claim); at the ``batch`` level the
    tiled dense GEMMs' weights (`tiled._TiledMM`): a plain linear's, a `MoEResQLinear`'s only in its
    bf16 mode (`moeresq_linear` is then `invariant.linear`; a quantizing mode's `_WgradHalf`
    returns its gradient), the router's when its fp32 upcast is the parameter itself; at every
    level the untied token embedding's (`layers.Embedding`). Biases never (autograd's ``out + bias``)."""
    from megatron_fp4.fp4.moeresq import MoEResQLinear
    from megatron_fp4.model.gpt_oss import GptOssExperts
    from megatron_fp4.model.layers import Embedding

    if isinstance(module, GroupedExperts):
        return [] if isinstance(module, GptOssExperts) else [module.w13, module.w2]
    if isinstance(module, Embedding) and module.fuse_weight_grad and module.padding_idx is None:
        return [module.weight]  # every level: its backward's index_add goes into the buffer (tied: the LM head's claim)
    if not gemms_are_tiled(cfg):
        return []
    if isinstance(module, torch.nn.Linear) or (isinstance(module, MoEResQLinear) and module.recipe.mode == "bf16"):
        return [module.weight]
    if isinstance(module, Router) and module.weight.dtype == wide_dtype(module.weight.dtype):
        return [module.weight]
    return []


def returned_grad_bytes(model: MoETransformer, cfg: Config, dp: int, num_microbatches: int) -> dict:
    """Per module (by name) the bytes of the weight gradients its backward returns to autograd's
    accumulation in one micro-batch (those `_fused_weights` writes into the buffer excepted, which
    the optimizer grants only at one micro-batch per step, in a reduction group of one)."""
    p, out = cfg.parallel, {}
    for name, module in model.named_modules():
        own = [t for t in module.parameters(recurse=False) if t.requires_grad]
        fused = {id(t) for t in _fused_weights(module, cfg)} if num_microbatches == 1 else set()
        returned = sum(t.numel() * t.element_size() for t in own
                       if id(t) not in fused or _group_size(_axis(t), p, dp) != 1)
        if returned:
            out[name] = returned
    return out


def weight_grad_transient(model: MoETransformer, cfg: Config, dp: int, num_microbatches: int) -> int:
    """Bytes of the weight gradients one module's backward returns before autograd's accumulation adds
    them into the flat buffer's views (`ZeroAdamW`: ``param.grad`` is a view; the returned gradient is
    a fresh tensor of the weight's size, in its dtype). The largest module's own parameters count: a
    `GroupedExperts`' w13 and w2 gradients are both held at once (measured: the step's peak RSS rises
    by both, not by the larger; benchmarks/bench_memory_plan.py, docs/memory.md). Gradient fusion
    (`fp4/grad_fusion.py`, `_fused_weights`) writes some kernels' gradients straight into the buffer
    instead, but only for the step's first micro-batch in a group of one: with several micro-batches
    per step the later ones take the ordinary path (`returned_grad_bytes`)."""
    return max(returned_grad_bytes(model, cfg, dp, num_microbatches).values(), default=0)


def fp4_weight_bytes(model: MoETransformer) -> int:
    """fp32 Q(W) of every local FP4 weight (each MoEResQ linear saves it for dgrad)."""
    total = 0
    for module in model.fp4_modules():
        if module.recipe.mode == "bf16":
            continue
        weights = (module.w13, module.w2) if isinstance(module, GroupedExperts) else (module.weight,)
        total += sum(t.numel() for t in weights) * 4
    return total


def inflight_microbatches(schedule: str, pp: int, pp_rank: int, virtual_stages: int, num_microbatches: int) -> list[int]:
    """Micro-batches whose activations a rank holds at its peak, per local chunk (in chunk order).

    GPipe: all. 1F1B: ``pp - stage``. Interleaved 1F1B (Megatron): ``2(pp - r - 1) + (v - 1)·pp + 1``
    chunk forwards before the first backward, taken in the schedule's order (pp micro-batches per
    chunk, chunks in turn)."""
    m, v = num_microbatches, virtual_stages
    if schedule == "gpipe":
        return [m] * v
    if schedule == "1f1b":
        return [min(pp - pp_rank, m)]
    if schedule != "interleaved_1f1b":
        raise ConfigError(f"parallel.schedule={schedule!r}: the planner models {list(PLANNED_SCHEDULES)}; the "
                          f"zero-bubble schedules hold weight-grad operands longer (not modeled yet)")
    forwards = min(v * m, 2 * (pp - pp_rank - 1) + (v - 1) * pp + 1)
    counts = [0] * v
    for i in range(forwards):
        counts[(i // pp) % v] += 1
    return [min(c, m) for c in counts]


# -- the plan -------------------------------------------------------------------------------------
def micro_batch_shape(cfg: Config) -> tuple[int, int, bool]:
    """([batch, seq], packed) of the largest micro-batch the trainer runs: the LM step's
    ``micro_batch_size`` × ``seq_len``, or a packed RL micro-batch, one row of up to
    ``rl.max_tokens_per_micro_batch`` tokens (`training/packing.py`), when that holds more tokens."""
    s = cfg.schedule
    budget = cfg.rl.max_tokens_per_micro_batch or 0
    return (1, budget, True) if budget > s.micro_batch_size * s.seq_len else (s.micro_batch_size, s.seq_len, False)


def plan_memory(cfg: Config, world_size: int, weight_cache: bool = True) -> list[RankPlan]:
    """One `RankPlan` per pipeline rank (its dp/ep/tp peers hold the same bytes: tp cuts evenly). Raises `ConfigError`
    (or ValueError from the layout functions) with a one-line message for a bad config or layout.
    `weight_cache`: Q(W) once per step (the trainer's default) rather than per micro-batch in flight."""
    cfg.validate()
    p, s = cfg.parallel, cfg.schedule
    dp = ParallelDims.from_config(cfg, world_size).dp  # every layout check
    num_mb = s.global_batch_size // (s.micro_batch_size * (dp // p.cp))  # dp holds dp × cp ranks
    ranges = split_layers(cfg.model.num_layers, p.pp, p.virtual_stages)
    style = PLACEMENT.get(p.schedule, "loop")
    schedule = p.schedule if p.pp > 1 else "1f1b"
    plans = []
    batch, seq, packed = micro_batch_shape(cfg)
    for pp_rank in range(p.pp):
        model = local_meta_model(cfg, pp_rank, 0)
        named = list(model.named_parameters())
        state = zero_bytes(named, cfg, dp)
        chunks = rank_chunks(pp_rank, p.pp, p.virtual_stages, style)
        counts = inflight_microbatches(schedule, p.pp, pp_rank, p.virtual_stages, num_mb)
        acts, inflight = 0, {}
        for c, n in zip(chunks, counts):
            acts += n * chunk_activation_bytes(cfg, model, ranges[c], c == 0, c == len(ranges) - 1, batch, seq,
                                               packed)
            inflight[c] = n
        stochastic_w = cfg.fp4.scope != "none" and _weight_rounding(model) == "stochastic"
        qw = fp4_weight_bytes(model) * (1 if weight_cache and not stochastic_w else max(sum(counts), 1))
        is_last = len(ranges) - 1 in chunks
        tokens = batch * seq // p.cp
        a, w = activation_dtype(cfg).itemsize, wide_dtype(activation_dtype(cfg)).itemsize
        head = tokens * cfg.model.vocab_size // p.tp * (a + w) if is_last else 0  # V/tp logits under tp
        ranks = range(pp_rank * dp * p.tp, (pp_rank + 1) * dp * p.tp)  # a stage's ranks are contiguous; no list of them
        grad_tmp = weight_grad_transient(model, cfg, dp, num_mb)
        plans.append(RankPlan(f"pp{pp_rank}", ranks, activations=acts, fp4_weights=qw, head_transient=head,
                              grad_transient=grad_tmp, kernel_cache=onednn_cache_bytes(model, cfg),
                              kernel_tall=sum(tall_heights(k, n) for k, n in onednn_shapes(model, cfg)),
                              inflight=inflight, param_numel=sum(t.numel() for _, t in named), **state))
    return plans


def onednn_cache_bytes(model: MoETransformer, cfg: Config) -> int:
    """What oneDNN's primitive cache keeps for this rank's GEMMs at most (`row_calls.onednn_kernel_bytes`:
    the trainer's dense weight form past the probed heights) over :func:`onednn_shapes`."""
    return sum(onednn_kernel_bytes(k, n) for k, n in onednn_shapes(model, cfg))


def onednn_shapes(model: MoETransformer, cfg: Config) -> set:
    """The (k, n) of this rank's GEMMs oneDNN serves: at the ``batch`` level on a CPU, every distinct
    [n, k] weight (a linear's, an expert's of a grouped [E, n, k]; embeddings are gathered, not
    multiplied, unless tied to the head) that oneDNN may serve at the activations' dtype
    (`row_calls.onednn_serves`: the shape's row plan probed it)."""
    if gemm_device(cfg).type != "cpu" or not gemms_are_tiled(cfg):
        return set()
    dtype = activation_dtype(cfg)
    shapes = set()
    for name, p in model.named_parameters():
        if p.dim() not in (2, 3) or ("embed" in name and not cfg.model.tie_embeddings):
            continue
        n, k = p.shape[-2:]
        if onednn_serves(k, n, dtype):
            shapes.add((k, n))
    return shapes


def _weight_rounding(model: MoETransformer) -> str:
    return next((mod.recipe.weight.rounding for mod in model.fp4_modules()), "nearest")
