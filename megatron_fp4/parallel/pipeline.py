"""Pipeline parallelism: the decoder cut into ``pp × virtual_stages`` chunks, run by the schedules of
`torch.distributed.pipelining` (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble).

Why the library: its schedules are maintained upstream, run on gloo (CPU) and NCCL alike, and its
`PipelineStage` handles the p2p of activations and their gradients. We only supply what is ours:

- the *split* (pure, unit-tested): `split_layers` gives each chunk a balanced, contiguous range of
  decoder layers (embedding with chunk 0, final norm + LM head with the last chunk), and chunk
  ``c`` lives on pipeline rank ``c % pp`` (Megatron's interleaving: rank r holds r, r+pp, …);
- the *stage modules*: every rank builds the full, identically initialised model, then
  `strip_to_local` removes what other ranks own. The model object is kept, so
  ``model.named_parameters()`` yields this rank's parameters under their *global* names (what
  ZeRO shards and checkpoints key on) and `model.moe_layers()` lists the local MoE layers;
- the *loss contract*: the schedule's loss_fn returns ``loss / num_microbatches`` and the schedule
  is built with ``scale_grads=False``, so gradients accumulate exactly as in the single-process
  trainer, and the MoE auxiliary losses (``AuxLossAutoScaler`` with scale 1/num_microbatches,
  set by the caller) reach the routers of every stage through the stage's own backward.

Micro-batch shapes are static (packed fixed-length data), which the p2p buffers need.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from megatron_fp4.fp4 import micro_batch as fp4_micro_batch

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv")
MULTI_CHUNK_SCHEDULES = ("interleaved_1f1b", "interleaved_zero_bubble", "zbv")
# Chunk placement each schedule expects: "loop" puts chunk c on rank c % pp (Megatron interleaving);
# "v" (ZB-V) folds the chunks back, rank r holding r and 2·pp−1−r, so the last chunk sits next to
# the first and the loss is computed where the backward starts.
PLACEMENT = {"zbv": "v"}


# -- pure layout functions --------------------------------------------------------------------------
def split_layers(num_layers: int, pp: int, virtual_stages: int = 1) -> list[range]:
    """Balanced contiguous layer ranges of the ``pp × virtual_stages`` chunks, in model order.

    Chunks differ by at most one layer; the extra layers go to the earliest chunks."""
    num_chunks = pp * virtual_stages
    if pp < 1 or virtual_stages < 1:
        raise ValueError(f"pp={pp} and virtual_stages={virtual_stages} must be >= 1")
    if num_layers < num_chunks:
        raise ValueError(f"parallel.virtual_stages: pp×virtual_stages={num_chunks} chunks but only "
                         f"model.num_layers={num_layers} layers; every chunk needs at least one layer")
    base, extra = divmod(num_layers, num_chunks)
    ranges, start = [], 0
    for c in range(num_chunks):
        size = base + (1 if c < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def chunk_to_rank(chunk: int, pp: int, style: str = "loop") -> int:
    """Pipeline rank holding model chunk `chunk` (``style`` "loop": interleaved, "v": ZB-V)."""
    if style == "v":
        assert 0 <= chunk < 2 * pp, (chunk, pp)
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def rank_chunks(pp_rank: int, pp: int, virtual_stages: int = 1, style: str = "loop") -> list[int]:
    """Model chunks held by pipeline rank `pp_rank`, ascending: r, r+pp, r+2·pp, … ("loop"), or
    r, 2·pp−1−r ("v", exactly two chunks per rank)."""
    if style == "v":
        if virtual_stages != 2:
            raise ValueError(f"parallel.virtual_stages={virtual_stages}: the V placement (schedule zbv) holds "
                             f"exactly 2 chunks per rank; set virtual_stages=2")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(virtual_stages)]


def theoretical_bubble(pp: int, virtual_stages: int, num_microbatches: int) -> float:
    """Idle fraction of the ideal (interleaved) 1F1B pipeline, (pp−1)/(v·m), relative to busy time."""
    return (pp - 1) / (virtual_stages * num_microbatches)


# -- stage modules ----------------------------------------------------------------------------------
class _Absent(nn.Module):
    """Placeholder for a decoder layer another pipeline rank owns (keeps layer indices global)."""

    is_moe = False

    def forward(self, *args, **kwargs):
        raise RuntimeError("this decoder layer lives on another pipeline rank")


class PipelineChunk(nn.Module):
    """One model chunk: (embedding) → layers[lo:hi] → (norm + LM head). Shares the model's modules."""

    def __init__(self, model: nn.Module, layers: range, is_first: bool, is_last: bool):
        super().__init__()
        self.layer_range, self.is_first, self.is_last = layers, is_first, is_last
        self.embed_tokens = model.embed_tokens if is_first else None
        self.layers = nn.ModuleList([model.layers[i] for i in layers])
        self.norm = model.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.is_first else x
        B, T = h.shape[:2]
        positions = torch.arange(T, device=h.device).expand(B, T)
        for layer in self.layers:
            h = layer(h, positions)
        if self.is_last:
            h = self.lm_head(self.norm(h))
        return h


def strip_to_local(model: nn.Module, local_layers: set[int], has_first: bool, has_last: bool) -> None:
    """Drop (in place) every module this rank's chunks do not hold; names of the rest stay global."""
    if model.lm_head is None and (has_first != has_last):
        raise ValueError("model.tie_embeddings=True is not supported with pipeline parallelism (the embedding "
                         "and the LM head live on different stages); set model.tie_embeddings=false")
    for i in range(len(model.layers)):
        if i not in local_layers:
            model.layers[i] = _Absent()
    if not has_first:
        model.embed_tokens = None
    if not has_last:
        model.norm = None
        model.lm_head = None


def build_chunks(model: nn.Module, pp: int, pp_rank: int, virtual_stages: int = 1,
                 style: str = "loop") -> list[tuple[int, PipelineChunk]]:
    """Strip `model` to this rank's chunks and return [(chunk index, chunk module)] in chunk order."""
    ranges = split_layers(len(model.layers), pp, virtual_stages)
    mine = rank_chunks(pp_rank, pp, virtual_stages, style)
    last = len(ranges) - 1
    local = {i for c in mine for i in ranges[c]}
    chunks = [(c, PipelineChunk(model, ranges[c], c == 0, c == last)) for c in mine]
    strip_to_local(model, local, 0 in mine, last in mine)
    return chunks


# -- FP4 micro-batch context (fp4-followups) --------------------------------------------------------
def run_chunks_in_fp4_micro_batch(stage) -> None:
    """Run each forward/backward call of `stage` inside the FP4 context of its micro-batch (the
    schedule's chunk id, the first positional argument), so FP4 stochastic rounding draws the same
    streams as the single-process trainer, whatever the schedule's order."""
    for method in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        def in_micro_batch(chunk_id, *args, _original=getattr(stage, method), **kwargs):
            with fp4_micro_batch(chunk_id):
                return _original(chunk_id, *args, **kwargs)
        setattr(stage, method, in_micro_batch)


# -- the runner -------------------------------------------------------------------------------------
def schedule_class(name: str):
    from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
               "interleaved_zero_bubble": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}
    if name not in classes:
        raise ValueError(f"parallel.schedule={name!r} must be one of {list(classes)}")
    return classes[name]


class PipelineRunner:
    """This rank's stages and schedule; `run` does forward+backward of one step's micro-batches.

    `loss_fn(logits, labels) -> loss` is the per-micro-batch mean loss; the runner divides it by the
    number of micro-batches for the gradients and reports the true mean (same on every pp rank)."""

    def __init__(self, model: nn.Module, mesh, schedule: str, virtual_stages: int, num_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], micro_batch_shape: tuple[int, int]):
        from torch.distributed.pipelining import PipelineStage

        self.model, self.mesh, self.num_microbatches = model, mesh, num_microbatches
        self.pp, self.pp_rank = mesh.pp, mesh.coord("pp")
        self.group = mesh.group("pp")
        style = PLACEMENT.get(schedule, "loop")
        self.chunks = build_chunks(model, self.pp, self.pp_rank, virtual_stages, style)
        num_stages = self.pp * virtual_stages
        self.last_stage_rank = chunk_to_rank(num_stages - 1, self.pp, style)  # reports the loss
        # Static shapes given up front: without them the library infers them by running each
        # stage on uninitialised inputs, which FP4's non-finite-input check rightly refuses.
        mbs, seq_len = micro_batch_shape
        dtype = next(model.parameters()).dtype
        hidden = torch.zeros(mbs, seq_len, model.cfg.hidden_size, dtype=dtype, device=mesh.device)
        tokens = torch.zeros(mbs, seq_len, dtype=torch.long, device=mesh.device)
        logits = torch.zeros(mbs, seq_len, model.cfg.vocab_size, dtype=dtype, device=mesh.device)
        hidden_in = hidden.clone().requires_grad_()  # received activations need their gradient
        self.stages = [PipelineStage(chunk, c, num_stages, mesh.device, group=self.group,
                                     input_args=(tokens if chunk.is_first else hidden_in,),
                                     output_args=(logits if chunk.is_last else hidden,),
                                     input_grads=(None if chunk.is_first else hidden,),
                                     output_grads=(None if chunk.is_last else hidden,))
                       for c, chunk in self.chunks]
        for stage in self.stages:  # fp4-followups: FP4 SR streams keyed by micro-batch
            run_chunks_in_fp4_micro_batch(stage)
        self.has_first = any(chunk.is_first for _, chunk in self.chunks)
        self.has_last = any(chunk.is_last for _, chunk in self.chunks)
        self._loss_fn = loss_fn
        cls = schedule_class(schedule)
        stages = self.stages if schedule in MULTI_CHUNK_SCHEDULES else self.stages[0]
        if schedule not in MULTI_CHUNK_SCHEDULES:
            assert len(self.stages) == 1, "virtual_stages > 1 needs an interleaved schedule"
        self.schedule = cls(stages, n_microbatches=num_microbatches, loss_fn=self._scaled_loss, scale_grads=False)

    def _scaled_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self._loss_fn(logits, labels)
        scaled = loss / self.num_microbatches
        scaled.unscaled = loss.detach()  # for the report; the schedule may call loss_fn for shape inference
        return scaled

    def run(self, micro_batches: list[dict]) -> float:
        """Forward and backward of every micro-batch; returns the mean loss (broadcast from the last stage)."""
        assert len(micro_batches) == self.num_microbatches, (len(micro_batches), self.num_microbatches)
        args = (torch.cat([mb["tokens"] for mb in micro_batches]),) if self.has_first else ()
        target = torch.cat([mb["labels"] for mb in micro_batches]) if self.has_last else None
        losses = [] if self.has_last else None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        total = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        if self.has_last:
            assert len(losses) == self.num_microbatches, len(losses)
            # The same sum as the single-process trainer: Σ float(loss_i) / n in float64.
            total.fill_(sum(float(l.unscaled) / self.num_microbatches for l in losses))
        if self.pp > 1:
            dist.broadcast(total, src=self.mesh.ranks["pp"][self.last_stage_rank], group=self.group)
        return float(total)

