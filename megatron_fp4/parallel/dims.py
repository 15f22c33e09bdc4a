"""The parallel layout as a value: `ParallelDims`, the size of every axis, and every layout check.

Pure (no process group, no tensor): built from the config and the world size, it resolves
``parallel.dp = -1`` (`resolve_dp`) and `validate` holds every check a layout must pass, each error
naming the field and the fix. `megatron_fp4.parallel.mesh.ParallelMesh` builds the process groups
of a validated `ParallelDims`; a single process is a `ParallelDims` of all ones.

Megatron's parallel folding: one pipeline stage's ranks are laid out twice over the same processes,

- **dense** (attention, dense MLP, embeddings): ``pp × dp × tp``, tp fastest, so
  ``rank = (pp_rank·dp + dp_rank)·tp + tp_rank``;
- **experts**: the same ``dp·tp`` ranks of a stage refolded as ``edp × ep × etp``, etp fastest:
  ``ep`` ranks hold different experts of a layer (all-to-all partners), ``edp`` ranks the same
  experts (their data-parallel group), ``etp`` ranks split each expert's matrices.

With ``etp = 1`` the expert grid is the stage's dp×tp ranks as ``edp × ep`` with ep fastest: the MoE
layers run whole on every tp rank (`parallel/tensor_parallel.py`), so an ep group may hold tp peers,
which dispatch the same tokens; ZeRO scales expert gradients by 1/(dp·tp) accordingly
(`parallel/zero.py`), and ep must divide dp. With ``etp = tp`` (the one other value: the etp group is
the tp group) every expert's ffn dim is cut over the tp ranks (`parallel/moe/expert_tensor_parallel.py`;
`check_expert_tensor_parallel`: moe_tp_tokens=whole, the all-to-all dispatcher, FP4 blocks inside a
rank's slice). With ``parallel.moe_tp_tokens=local`` (etp = 1) each tp rank routes its own 1/tp of
the sequence (`parallel/moe/tp_moe.py`): ep may be any divisor of dp·tp (FP4 experts: a multiple of tp,
so an ep group holds whole tp groups, which the all-to-all dispatcher folds) and expert gradients
are scaled 1/dp (`check_moe_local_tokens`). The ``embed`` axis (pp > 1)
joins the first and the last stage's ranks of one tp coordinate: they hold the two copies of tied
embeddings (Megatron's embedding group).

Context parallelism (``parallel.cp``, `parallel/context.py`) adds no axis to the grids: the ``dp``
axis of ``ParallelDims`` and of the mesh holds ``parallel.dp × cp`` ranks, all of which hold the
same parameters (Megatron-Core's ``dp_cp`` group: gradients, ZeRO shards and checkpoints span it),
and each ``cp`` group is ``cp`` consecutive dp coordinates that share one sequence, so
``rank = ((pp_rank·dp_data + data_rank)·cp + cp_rank)·tp + tp_rank`` (Megatron-Core's order
tp-cp-dp-pp). ``data`` is the data-parallel coordinate (``dp // cp`` replicas read different data).

The checks that also stand alone (`check_chunks`, `check_v_placement`, `check_schedule_chunks`,
`check_expert_split`, `check_gcmoe`, `check_tensor_parallel`) are what the pipeline split, the
expert placement and the GC-MoE dispatcher call on their own arguments, so no check is written twice.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_fp4.config.choices import ConfigError
from megatron_fp4.config.validate import require

DENSE_AXES = ("pp", "dp", "tp")
EXPERT_AXES = ("pp", "edp", "ep", "etp")
MULTI_CHUNK_SCHEDULES = ("interleaved_1f1b", "interleaved_zero_bubble", "zbv")
INTERLEAVED_SCHEDULES = ("interleaved_1f1b", "interleaved_zero_bubble")  # chunks on rank c % pp


# -- checks that stand alone (called by pipeline.py, expert_parallel.py, gcmoe*.py too) ---------------
def check_chunks(num_layers: int, pp: int, virtual_stages: int) -> None:
    """Every one of the ``pp × virtual_stages`` model chunks gets at least one decoder layer."""
    require(pp >= 1, "parallel.pp", pp, "must be >= 1")
    require(virtual_stages >= 1, "parallel.virtual_stages", virtual_stages, "must be >= 1")
    num_chunks = pp * virtual_stages
    require(num_layers >= num_chunks, "parallel.virtual_stages", virtual_stages,
            f"pp×virtual_stages={num_chunks} model chunks but only model.num_layers={num_layers} layers; "
            f"every chunk needs at least one layer: lower parallel.pp or parallel.virtual_stages")


def check_v_placement(virtual_stages: int) -> None:
    """The V placement (ZB-V) holds exactly two chunks per pipeline rank."""
    require(virtual_stages == 2, "parallel.virtual_stages", virtual_stages,
            "schedule zbv places exactly 2 model chunks per pipeline rank (a V); set virtual_stages=2")


def check_schedule_chunks(schedule: str, virtual_stages: int) -> None:
    """Several chunks per rank need a multi-chunk schedule, and those schedules need several chunks."""
    if schedule in INTERLEAVED_SCHEDULES:
        require(virtual_stages > 1, "parallel.virtual_stages", virtual_stages,
                f"schedule {schedule} needs virtual_stages >= 2 (or use schedule=1f1b)")
    elif schedule == "zbv":
        check_v_placement(virtual_stages)
    else:
        require(virtual_stages == 1, "parallel.schedule", schedule,
                f"virtual_stages={virtual_stages} needs a multi-chunk schedule "
                f"({', '.join(MULTI_CHUNK_SCHEDULES[:-1])} or {MULTI_CHUNK_SCHEDULES[-1]})")


def check_expert_split(num_experts: int, ep: int) -> None:
    """Every ep rank owns the same number of experts."""
    require(ep >= 1, "parallel.ep", ep, "must be >= 1")
    require(num_experts >= 1, "model.num_experts", num_experts, "must be >= 1")
    require(num_experts % ep == 0, "parallel.ep", ep,
            f"model.num_experts={num_experts} is not divisible by parallel.ep={ep}: choose ep among the "
            f"divisors of num_experts so every rank owns the same number of experts")


def check_gcmoe(ep: int, chunk_tokens: int, ring_slots: int, transfer_sms: int = 0) -> None:
    """GC-MoE's chunking: positive sizes, and a receive ring with a slot for every peer."""
    require(chunk_tokens >= 1, "parallel.gcmoe_chunk_tokens", chunk_tokens, "must be >= 1")
    if ring_slots < max(1, ep - 1):
        raise ConfigError(f"parallel.gcmoe_ring_slots={ring_slots} must be >= max(1, parallel.ep - 1) = "
                          f"{max(1, ep - 1)}: a transfer step receives one chunk from every peer; raise it")
    require(transfer_sms >= 0, "parallel.gcmoe_transfer_sms", transfer_sms, "must be >= 0 (0: no SM split)")


def check_tensor_parallel(model, tp: int, seq_len: int, sequence_parallel: bool) -> None:
    """What tensor parallelism over `tp` ranks demands of the model: whole heads per rank (kv heads
    split, or each replicated over ``tp / num_kv_heads`` ranks), the vocabulary and the dense MLP
    split evenly, and (sequence parallel) the sequence too."""
    require(model.num_heads % tp == 0, "model.num_heads", model.num_heads,
            f"must be a multiple of parallel.tp={tp}: every tensor-parallel rank needs whole attention heads; "
            f"choose tp dividing num_heads")
    require(model.num_kv_heads % tp == 0 or tp % model.num_kv_heads == 0, "model.num_kv_heads", model.num_kv_heads,
            f"must divide or be divided by parallel.tp={tp}: kv heads are split over the ranks or each "
            f"replicated over tp/num_kv_heads of them; choose tp a divisor or a multiple of num_kv_heads")
    require(model.vocab_size % tp == 0, "model.vocab_size", model.vocab_size,
            f"must be a multiple of parallel.tp={tp}: the embedding and LM head are split along the vocabulary; "
            f"pad the vocabulary to a multiple of tp")
    if model.dense_layers:
        require(model.dense_ffn_hidden_size % tp == 0, "model.dense_ffn_hidden_size", model.dense_ffn_hidden_size,
                f"must be a multiple of parallel.tp={tp}: the dense MLP is split along its hidden size")
    if sequence_parallel:
        require(seq_len % tp == 0, "schedule.seq_len", seq_len,
                f"must be a multiple of parallel.tp={tp}: sequence parallel gives each rank 1/tp of the sequence; "
                f"change seq_len or set parallel.sequence_parallel=false")


def check_fp4_tensor_cut(cfg, tp: int) -> None:
    """The FP4 linears' blocks inside every tp rank's slice, kv heads enough for FP4 attention: what
    `parallelize_tp` checks while it cuts, run here on a meta-device model (no memory, no process
    group), so a layout it would refuse on every rank is one ConfigError before any group exists."""
    if cfg.fp4.scope == "none":
        return
    import torch

    from megatron_fp4.model import MoETransformer
    from megatron_fp4.parallel.tensor_parallel import parallelize_tp

    with torch.device("meta"):
        model = MoETransformer(cfg.model, cfg.fp4)  # as the trainer builds it before its tp cut
    try:
        parallelize_tp(model, None, cfg.parallel.sequence_parallel, moe_tokens=cfg.parallel.moe_tp_tokens,
                       size_rank=(tp, 0))
    except ValueError as err:
        raise ConfigError(f"parallel.tp={tp} cannot cut this model's FP4 layers: {err}") from None


def check_moe_local_tokens(cfg, dims: "ParallelDims") -> None:
    """``parallel.moe_tp_tokens=local``: each tp rank routes its 1/tp of the sequence
    (`parallel/moe/tp_moe.py`). FP4 experts quantize their weight gradient along a micro-batch's tokens
    in single-process order, which the all-to-all dispatcher restores when the ep group holds whole tp
    groups (ep a multiple of tp, etp = 1); the capacity factor and the sequence-level aux loss
    depend on the whole call's tokens."""
    p, m, f = cfg.parallel, cfg.model, cfg.fp4
    require(m.moe_capacity_factor is None and m.moe_aux_loss_type == "global", "parallel.moe_tp_tokens",
            p.moe_tp_tokens, "does not take model.moe_capacity_factor or model.moe_aux_loss_type=seq (both depend "
            "on the whole sequence's tokens); set parallel.moe_tp_tokens=whole")
    fp4_wgrad = f.scope != "none" and f.train_mode != "bf16" and f.quantize_backward
    if fp4_wgrad:
        require(dims.ep % dims.tp == 0 and p.expert_dispatcher == "alltoall" and dims.etp == 1,
                "parallel.moe_tp_tokens", p.moe_tp_tokens,
                f"with FP4 experts (their weight gradient quantizes along a micro-batch's tokens in order) needs "
                f"parallel.ep={dims.ep} a multiple of parallel.tp={dims.tp}, parallel.etp=1 and "
                f"parallel.expert_dispatcher=alltoall (got {p.expert_dispatcher}); or set parallel.moe_tp_tokens=whole")


def check_expert_tensor_parallel(cfg, dims: "ParallelDims") -> None:
    """``parallel.etp`` (= tp, MoE layers whole on every tp rank: the etp ranks hold the same rows,
    `parallel/moe/expert_tensor_parallel.py` ``replicated``): every expert's ffn dim splits evenly, FP4
    blocks stay inside a rank's slice, and the all-to-all dispatcher (DCP of the etp shards:
    `training/checkpoint/dcp_etp.py`)."""
    p, m, f = cfg.parallel, cfg.model, cfg.fp4
    require(p.moe_tp_tokens == "whole", "parallel.moe_tp_tokens", p.moe_tp_tokens,
            f"expert tensor parallel (parallel.etp={dims.etp}) with moe_tp_tokens=local is not implemented yet; "
            "set parallel.moe_tp_tokens=whole or parallel.etp=1")
    require(m.moe_ffn_hidden_size % dims.etp == 0, "model.moe_ffn_hidden_size", m.moe_ffn_hidden_size,
            f"must be a multiple of parallel.etp={dims.etp}: every expert's ffn dim is split over the etp ranks")
    block = 32 if f.format == "mxfp4" else 16
    if f.scope != "none" and f.train_mode != "bf16":
        require((m.moe_ffn_hidden_size // dims.etp) % block == 0, "model.moe_ffn_hidden_size", m.moe_ffn_hidden_size,
                f"over parallel.etp={dims.etp} leaves {m.moe_ffn_hidden_size // dims.etp} ffn features per rank, not a "
                f"multiple of the {f.format} block ({block}): FP4 blocks would straddle ranks; change the sizes")
    require(p.expert_dispatcher == "alltoall", "parallel.expert_dispatcher", p.expert_dispatcher,
            f"expert tensor parallel (parallel.etp={dims.etp}) runs a rank's experts at once: use alltoall")


def check_context_parallel(cfg, dims: "ParallelDims") -> None:
    """``parallel.cp > 1``: what the sequence split (`parallel/context.py`) implements and what it
    refuses, each with the combination named."""
    p, m, f, s = cfg.parallel, cfg.model, cfg.fp4, cfg.schedule
    cp = dims.cp
    require(s.seq_len % (2 * cp) == 0, "schedule.seq_len", s.seq_len,
            f"must be a multiple of 2×parallel.cp = {2 * cp}: context parallel cuts each sequence into 2·cp "
            f"equal chunks (rank r holds chunks r and 2·cp-1-r); change seq_len or parallel.cp")
    require(dims.etp == 1, "parallel.etp", dims.etp,
            f"context parallel (parallel.cp={cp}) with parallel.etp > 1 is not implemented yet; set parallel.etp=1 "
            f"or parallel.cp=1 (cp composes with dp, ZeRO, pp, ep and tp)")
    if dims.tp > 1:
        require(p.moe_tp_tokens == "whole", "parallel.moe_tp_tokens", p.moe_tp_tokens,
                f"context parallel (parallel.cp={cp}) with moe_tp_tokens=local (token statistics over tp × cp) is "
                f"not implemented yet; set parallel.moe_tp_tokens=whole or parallel.cp=1")
        if getattr(p, "sequence_parallel", False):
            require((s.seq_len // cp) % dims.tp == 0, "schedule.seq_len", s.seq_len,
                    f"must leave each cp rank a multiple of parallel.tp={dims.tp} tokens (seq_len / cp = "
                    f"{s.seq_len // cp}): sequence parallel splits a cp rank's tokens over tp")
    require(m.moe_capacity_factor is None, "model.moe_capacity_factor", m.moe_capacity_factor,
            f"expert capacity depends on the whole sequence's tokens: not with parallel.cp={cp}; set it to null "
            f"or parallel.cp=1")
    require(m.moe_aux_loss_type == "global", "model.moe_aux_loss_type", m.moe_aux_loss_type,
            f"the per-sequence aux loss needs the whole sequence on one rank: not with parallel.cp={cp}; use "
            f"global or parallel.cp=1")
    require(m.recompute == "none", "model.recompute", m.recompute,
            f"recomputation with parallel.cp={cp} (the K/V all-gather inside a recomputed block) is not "
            f"implemented yet; set model.recompute=none or parallel.cp=1")
    require(f.scope == "none" or f.train_mode == "bf16", "fp4.scope", f.scope,
            f"FP4 training with parallel.cp={cp} is not implemented yet (FP4 scales and the weight gradient's "
            f"blocks run along a micro-batch's tokens, which cp splits); set fp4.scope=none or "
            f"fp4.train_mode=bf16, or parallel.cp=1")


def resolve_dp(cfg, world_size: int) -> int:
    """Data-parallel size: explicit, or what the world leaves after pp and tp."""
    return ParallelDims.from_parallel(cfg.parallel, world_size).dp


# -- the layout ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParallelDims:
    """Sizes of every axis of one job's layout (each >= 1; world_size = pp × dp × tp). ``dp = -1`` until
    `validate` resolves it. The dense grid is pp × dp × tp, the experts' refolds each stage's dp·tp ranks
    as edp × ep × etp (the module docstring)."""

    # Processes in the job (torchrun's WORLD_SIZE); a single process is a layout of all ones.
    world_size: int = 1
    # Pipeline stages: the model's layers cut into pp consecutive pieces (× parallel.virtual_stages chunks each).
    pp: int = 1
    # Ranks of a stage that hold the same parameters: parallel.dp data replicas × cp; gradients and the ZeRO
    # shards span them. -1: what world_size leaves after pp and tp.
    dp: int = 1
    # Tensor parallel: ranks that split each attention/dense-MLP/embedding matrix (parallel/tensor_parallel.py).
    tp: int = 1
    # Expert parallel: ranks that hold different experts of a layer (all-to-all partners); divides the experts,
    # and dp (or dp·tp with parallel.moe_tp_tokens=local).
    ep: int = 1
    # Expert tensor parallel: ranks that split each expert's matrices; 1 or tp (the etp group is the tp group).
    etp: int = 1
    # Context parallel: cp consecutive dp coordinates share one sequence, each holding 2 of its 2·cp chunks
    # (dp counts them).
    cp: int = 1

    @classmethod
    def from_parallel(cls, parallel, world_size: int) -> "ParallelDims":
        """The validated axes of a ``parallel:`` config section on `world_size` processes
        (``parallel.dp`` counts data replicas: the dp axis here holds dp × cp ranks)."""
        cp = getattr(parallel, "cp", 1)
        require(cp >= 1, "parallel.cp", cp, "must be >= 1 (1: no context parallelism)")
        dp = parallel.dp * cp if parallel.dp >= 1 else parallel.dp
        return cls(world_size, parallel.pp, dp, parallel.tp, parallel.ep, parallel.etp, cp).validate()

    @classmethod
    def from_config(cls, cfg, world_size: int) -> "ParallelDims":
        """The validated layout of `cfg` on `world_size` processes: every check, `cfg`'s model,
        schedule and dispatcher against it included."""
        return cls.from_parallel(cfg.parallel, world_size).validate(cfg)

    # -- checks ----------------------------------------------------------------------------------
    def validate(self, cfg=None) -> "ParallelDims":
        """Every layout check; returns these dims with dp resolved. With `cfg`, also what the layout
        demands of the model (experts, layers), the batch and the pipeline schedule."""
        for axis in ("pp", "tp", "ep", "etp", "cp"):
            require(getattr(self, axis) >= 1, f"parallel.{axis}", getattr(self, axis), "must be >= 1")
        require(self.etp == 1 or self.etp == self.tp, "parallel.etp", self.etp,
                f"expert tensor parallelism is implemented with the etp group = the tp group: set etp=1 or "
                f"etp=parallel.tp={self.tp}")
        require(self.dp == -1 or self.dp >= 1, "parallel.dp", self.dp,
                "must be >= 1, or -1 to infer it from the world size")
        require(self.world_size >= 1, "world size", self.world_size, "must be >= 1")
        if self.world_size == 1 and (self.pp > 1 or self.ep > 1):
            raise ConfigError(f"parallel.pp={self.pp}, parallel.ep={self.ep}: pp/ep > 1 need several processes: "
                              f"launch with torchrun (see docs/usage.md) or set them to 1")
        require(self.world_size > 1 or self.tp == 1, "parallel.tp", self.tp,
                "tensor parallelism needs several processes: launch with torchrun (see docs/parallel.md) or set tp=1")
        require(self.world_size > 1 or self.cp == 1, "parallel.cp", self.cp,
                "context parallelism needs several processes: launch with torchrun (see docs/parallel.md) or set cp=1")
        dims = self if self.dp != -1 else dataclasses.replace(self, dp=self._inferred_dp())
        require(dims.pp * dims.dp * dims.tp == self.world_size, "parallel.dp", self.dp // self.cp,
                f"dp×cp×pp×tp = {dims.dp // self.cp}×{self.cp}×{dims.pp}×{dims.tp} must equal the world size "
                f"{self.world_size}; set parallel.dp=-1 to infer it, or launch pp×dp×cp×tp processes"
                if self.cp > 1 else
                f"dp×pp×tp = {dims.dp}×{dims.pp}×{dims.tp} must equal the world size {self.world_size}; "
                f"set parallel.dp=-1 to infer it, or launch pp×dp×tp processes")
        require(dims.dp % self.cp == 0, "parallel.cp", self.cp,
                f"the world size {self.world_size} leaves {dims.dp} ranks per pp×tp coordinate, not a multiple "
                f"of parallel.cp; launch pp×dp×cp×tp processes")
        if dims.tp == 1:  # with tp, parallel.moe_tp_tokens decides (`_validate_against`)
            require(dims.dp % dims.ep == 0, "parallel.ep", dims.ep,
                    f"expert parallel groups are carved out of the data-parallel ranks: ep must divide dp={dims.dp}")
        require((dims.dp * dims.tp) % (dims.ep * dims.etp) == 0, "parallel.etp", dims.etp,
                f"a stage's dp×tp = {dims.dp * dims.tp} ranks are refolded as edp×ep×etp: ep×etp = "
                f"{dims.ep * dims.etp} must divide it")
        if cfg is not None:
            dims._validate_against(cfg)
        return dims

    def _inferred_dp(self) -> int:
        require(self.world_size % (self.pp * self.tp) == 0, "parallel.pp", self.pp,
                f"world size {self.world_size} is not divisible by pp×tp={self.pp * self.tp}; choose pp dividing "
                f"the number of processes")
        return self.world_size // (self.pp * self.tp)

    def _validate_against(self, cfg) -> None:
        p, m, s = cfg.parallel, cfg.model, cfg.schedule
        check_expert_split(m.num_experts, self.ep)
        if self.etp > 1:
            check_expert_tensor_parallel(cfg, self)
        if self.tp > 1 and p.moe_tp_tokens == "local":
            check_moe_local_tokens(cfg, self)
        elif self.tp > 1:
            require(self.dp % self.ep == 0, "parallel.ep", self.ep,
                    f"expert parallel groups are carved out of the data-parallel ranks: ep must divide dp={self.dp} "
                    f"(or, with parallel.tp > 1, set parallel.moe_tp_tokens=local to fold tp into ep)")
        check_chunks(m.num_layers, self.pp, p.virtual_stages)
        require(s.micro_batch_size >= 1, "schedule.micro_batch_size", s.micro_batch_size, "must be a positive integer")
        data = self.data_dp  # the cp ranks of one data replica read the same micro-batches
        require(s.global_batch_size % (s.micro_batch_size * data) == 0, "schedule.global_batch_size",
                s.global_batch_size, f"must be a multiple of micro_batch_size×dp = {s.micro_batch_size}×{data}")
        num_microbatches = s.global_batch_size // (s.micro_batch_size * data)
        check_schedule_chunks(p.schedule, p.virtual_stages)
        if p.schedule == "1f1b" and self.pp > 1:  # torch's Schedule1F1B: every stage busy in the steady state
            require(num_microbatches >= self.pp, "schedule.global_batch_size", s.global_batch_size,
                    f"schedule 1f1b needs at least pp={self.pp} micro-batches per step, got {num_microbatches} "
                    f"(global_batch_size / (micro_batch_size×dp={s.micro_batch_size}×{self.dp})); raise "
                    f"global_batch_size or lower micro_batch_size")
        if p.schedule in INTERLEAVED_SCHEDULES:
            require(num_microbatches % self.pp == 0, "schedule.global_batch_size", s.global_batch_size,
                    f"schedule {p.schedule} needs the number of micro-batches ({num_microbatches}) to be a "
                    f"multiple of pp={self.pp}; adjust global_batch_size or micro_batch_size")
        require(self.pp > 1 or p.virtual_stages == 1, "parallel.virtual_stages", p.virtual_stages,
                "model chunks are pipeline stages: virtual_stages > 1 needs parallel.pp > 1 (or set it to 1)")
        if self.tp > 1:
            check_tensor_parallel(m, self.tp, s.seq_len, getattr(p, "sequence_parallel", False))
            check_fp4_tensor_cut(cfg, self.tp)
        if self.cp > 1:
            check_context_parallel(cfg, self)
        check_gcmoe(self.ep if p.expert_dispatcher == "gcmoe" else 1, p.gcmoe_chunk_tokens, p.gcmoe_ring_slots,
                    p.gcmoe_transfer_sms)

    # -- sizes, coordinates and groups (pure) ----------------------------------------------------
    @property
    def edp(self) -> int:
        return self.dp * self.tp // (self.ep * self.etp)

    @property
    def data_dp(self) -> int:
        """Data-parallel replicas: ranks that read different data (``parallel.dp``; dp / cp)."""
        return self.dp // self.cp

    def size(self, axis: str) -> int:
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp, "ep": self.ep, "etp": self.etp, "edp": self.edp,
                "embed": 2 * self.dp if self.pp > 1 else self.dp, "world": self.world_size, "cp": self.cp,
                "data": self.data_dp}[axis]

    def shape(self, axes: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(self.size(axis) for axis in axes)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on every axis (dense and expert grids)."""
        dense = _unravel(rank, self.shape(DENSE_AXES))
        expert = _unravel(rank, self.shape(EXPERT_AXES))
        coords = {**dict(zip(DENSE_AXES, dense)), **dict(zip(EXPERT_AXES, expert))}
        return {**coords, "cp": coords["dp"] % self.cp, "data": coords["dp"] // self.cp}

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of `axis` as ascending lists of global ranks (what DeviceMesh builds)."""
        if axis == "world":
            return [list(range(self.world_size))]
        if axis == "cp":  # cp consecutive dp coordinates of one (pp, tp) coordinate
            return sorted([self._rank({"pp": p, "dp": d * self.cp + c, "tp": t}, DENSE_AXES) for c in range(self.cp)]
                          for p in range(self.pp) for d in range(self.data_dp) for t in range(self.tp))
        if axis == "embed":
            if self.pp == 1:
                return []
            return [[self._rank({"pp": p, "dp": d, "tp": t}, DENSE_AXES) for p in (0, self.pp - 1)
                     for d in range(self.dp)] for t in range(self.tp)]
        axes = DENSE_AXES if axis in DENSE_AXES else EXPERT_AXES
        others = [a for a in axes if a != axis]
        out = []
        for fixed in _grid(self.shape(tuple(others))):
            coord = dict(zip(others, fixed))
            out.append([self._rank({**coord, axis: i}, axes) for i in range(self.size(axis))])
        return sorted(out)

    def group_of(self, axis: str, rank: int) -> list[int]:
        """The ranks of `rank`'s group on `axis` ([] when it has none: embed without pp)."""
        return next((g for g in self.groups(axis) if rank in g), [])

    def _rank(self, coord: dict, axes: tuple[str, ...]) -> int:
        rank = 0
        for axis in axes:
            rank = rank * self.size(axis) + coord[axis]
        return rank


def _unravel(index: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for n in reversed(shape):
        out.append(index % n)
        index //= n
    return out[::-1]


def _grid(shape: tuple[int, ...]):
    total = 1
    for n in shape:
        total *= n
    return (_unravel(i, shape) for i in range(total))
