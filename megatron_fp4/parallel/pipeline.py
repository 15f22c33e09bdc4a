"""Pipeline parallelism: the decoder cut into ``pp × virtual_stages`` chunks, run by the schedules of
`torch.distributed.pipelining` (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble).

Why the library: its schedules are maintained upstream, run on gloo (CPU) and NCCL alike, and its
`PipelineStage` handles the p2p of activations and their gradients. We only supply what is ours:

- the *split* (pure, unit-tested): `split_layers` gives each chunk a balanced, contiguous range of
  decoder layers (embedding with chunk 0, final norm + LM head with the last chunk), and chunk
  ``c`` lives on pipeline rank ``c % pp`` (Megatron's interleaving: rank r holds r, r+pp, …);
- the *stage modules*: `strip_to_local` removes from the model what other ranks own (on the
  meta device before anything is allocated, in the trainer; or from a full model). A stage runs
  the model's own forward pieces (`embed`, `run_layers`, `head`), never a copy of them. The model object is kept, so
  ``model.named_parameters()`` yields this rank's parameters under their *global* names (what
  ZeRO shards and checkpoints key on) and `model.moe_layers()` lists the local MoE layers;
- the *loss contract*: the step's loss (a `StepLoss`: model inputs + loss of the logits) runs on
  the last stage with the whole micro-batch dict — the schedule's target is the micro-batch
  index, so labels, masks, advantages and old log-probs all reach it; its result, returned as
  ``loss / num_microbatches``, feeds a schedule
  is built with ``scale_grads=False``, so gradients accumulate exactly as in the single-process
  trainer, and the MoE auxiliary losses (``AuxLossAutoScaler`` with scale 1/num_microbatches,
  set by the caller) reach the routers of every stage through the stage's own backward.

Per-micro-batch inputs reach the stages as the schedule's kwargs: `PipelineRunner.run` hands
``schedule.step(tokens, micro_batch=arange(n), positions=..., attention_mask=..., routing_in=...)``
the micro-batches concatenated along the batch dim, and the schedule splits them into the n
micro-batches and passes micro-batch i's slice to every stage's forward (torch: "kwargs can be
passed to all stages via respective step calls"), so `PipelineChunk.forward` gets its micro-batch
index, positions, mask and routes as arguments and runs in that micro-batch's FP4 context. The
schedules call a stage's backward with the micro-batch index alone (no kwargs), so FP4's backward
context comes from `MicroBatchStage`, the one documented `PipelineStage` subclass (two overrides).

Micro-batch shapes are static within a step (the p2p buffers need it); stages and schedule are
built once per (micro-batch count, shape), so RL batches of varying length work.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from megatron_fp4.config.choices import check_choice
from megatron_fp4.fp4 import numerics_of
from megatron_fp4.parallel.dims import (MULTI_CHUNK_SCHEDULES, check_chunks, check_schedule_chunks,
                                        check_v_placement)
from megatron_fp4.parallel.wire import broadcast_message

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv")
STAGE_KWARGS = ("positions", "attention_mask", "routing_in")  # model inputs carried per micro-batch
# Chunk placement each schedule expects: "loop" puts chunk c on rank c % pp (Megatron interleaving);
# "v" (ZB-V) folds the chunks back, rank r holding r and 2·pp−1−r, so the last chunk sits next to
# the first and the loss is computed where the backward starts.
PLACEMENT = {"zbv": "v"}


# -- pure layout functions --------------------------------------------------------------------------
def split_layers(num_layers: int, pp: int, virtual_stages: int = 1) -> list[range]:
    """Balanced contiguous layer ranges of the ``pp × virtual_stages`` chunks, in model order.

    Chunks differ by at most one layer; the extra layers go to the earliest chunks."""
    check_chunks(num_layers, pp, virtual_stages)
    num_chunks = pp * virtual_stages
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
        check_v_placement(virtual_stages)
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
    """One model chunk: the model's own `embed` (first chunk), `run_layers` over its layer range,
    `head` (last chunk). It registers the modules it runs (what the stage's parameters are) and
    calls the model's pieces, so there is one forward for every layout. `forward` takes the
    micro-batch's index (a one-element tensor: the schedule's slice of ``arange(n)``; None: the
    caller's FP4 context) and its
    ``positions`` / ``attention_mask`` (None: default positions, no mask) and ``routing_in``
    (router replay: the micro-batch's routes, every layer's; None: route live) as kwargs."""

    def __init__(self, model: nn.Module, layers: range, is_first: bool, is_last: bool):
        super().__init__()
        self.layer_range, self.is_first, self.is_last = layers, is_first, is_last
        self.seq_split = 1  # tensor ranks the sequence is split over between layers (sequence parallel)
        # The last chunk registers the embedding too when it is the tied head's weight.
        self.embed_tokens = model.embed_tokens if is_first or (is_last and model.lm_head is None) else None
        self.layers = nn.ModuleList([model.layers[i] for i in layers])
        self.norm = model.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None
        self._model = (model,)  # a tuple: not registered as a submodule

    @property
    def numerics(self):
        """The model's `fp4.Numerics` (the stage's backward enters its micro-batch there)."""
        return self._model[0].numerics

    def forward(self, x: torch.Tensor, micro_batch: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, routing_in: torch.Tensor | None = None) -> torch.Tensor:
        (model,) = self._model
        ctx = contextlib.nullcontext() if micro_batch is None else \
            numerics_of(model).micro_batch(int(micro_batch.reshape(-1)[0]))
        with ctx:  # FP4 SR streams keyed by micro-batch (None: the caller's context)
            h = model.embed(x) if self.is_first else _ContiguousGrad.apply(x)
            if positions is None:  # of the whole sequence (sequence parallel: h holds 1/tp of it)
                whole = x if self.is_first else h[:, :1].expand(-1, h.shape[1] * self.seq_split, -1)
                positions = model.default_positions(whole)
            h = model.run_layers(h, positions, attention_mask, self.layer_range, routing_in=routing_in)
            return model.head(h) if self.is_last else h.contiguous()  # p2p sends need it (a tp reduce-scatter's view)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: the p2p send of a received
    activation's gradient needs one (tensor parallel's all-gather backward gives a strided view)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def strip_to_local(model: nn.Module, local_layers: set[int], has_first: bool, has_last: bool) -> None:
    """Drop (in place) every module this rank's chunks do not hold; names of the rest stay global.

    Tied embeddings (``model.lm_head is None``) split over two ranks work as in Megatron: the last
    stage keeps its own copy of ``embed_tokens`` for the head, initialised to the same bits (same
    name, same seed), and both copies are marked ``grad_axis = "embed"`` so their gradients are
    reduced over the mesh's embedding group (first and last stage): the two copies get the sum of
    both uses and stay equal through every update."""
    tied = model.lm_head is None
    for i in range(len(model.layers)):
        if i not in local_layers:
            model.layers[i] = _Absent()
    if not has_first and not (tied and has_last):
        model.embed_tokens = None
    elif tied and has_first != has_last:
        model.embed_tokens.weight.grad_axis = "embed"
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


# -- FP4 micro-batch context of the backward --------------------------------------------------------
class BackwardInMicroBatch:
    """Mixin for a `PipelineStage`: its backward calls (full, input and weight) run inside the FP4
    context of their micro-batch, the schedule's chunk id, so FP4 stochastic rounding in the
    backward draws the single-process trainer's streams whatever the schedule's order. Needed
    because torch's schedules call ``backward_one_chunk(i, ...)`` / ``backward_weight_one_chunk(i)``
    with no user arguments (the forward gets its index as a kwarg, `PipelineChunk.forward`)."""

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        with numerics_of(self.submod).micro_batch(bwd_chunk_id):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        with numerics_of(self.submod).micro_batch(bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)


class MicroBatchStage(BackwardInMicroBatch, PipelineStage):
    """torch's `PipelineStage` with its backward in the FP4 micro-batch context (`BackwardInMicroBatch`)."""


def stage_kwargs(inputs: list[dict]) -> dict:
    """The schedule's kwargs for micro-batch model inputs `inputs`: ``micro_batch`` (arange(n), one
    index per micro-batch after the schedule's split) and each of `STAGE_KWARGS` that the
    micro-batches give, concatenated along the batch dim (the schedule splits it back)."""
    out = {"micro_batch": torch.arange(len(inputs))}  # on the host: read there, no device sync
    for key in STAGE_KWARGS:
        given = [inp.get(key) is not None for inp in inputs]
        if any(given) and not all(given):
            raise ValueError(f"the micro-batches of a pipelined step give {key!r} for some micro-batches and not "
                             "for others; give it for all of them or none (StepLoss.model_inputs)")
        if all(given) and inputs:
            out[key] = torch.cat([inp[key] for inp in inputs])
    return out


# -- the runner -------------------------------------------------------------------------------------
def schedule_class(name: str):
    from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
               "interleaved_zero_bubble": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}
    check_choice("parallel.schedule", name, classes)
    return classes[name]


class PipelineRunner:
    """This rank's stages; `run(micro_batches, step_loss)` does forward+backward of one step.

    `step_loss` is a `training.step_loss.StepLoss`-like object: `model_inputs(mb)` (tokens, optional
    positions / attention_mask) and `loss(logits, mb) -> (loss, metrics)`, the micro-batch's mean
    loss, computed on the last stage with the whole micro-batch dict. The runner divides it by the
    number of micro-batches for the gradients and reports the true means (same on every pp rank).
    Stages and schedule are built per micro-batch count and shape (the p2p buffers are static)."""

    def __init__(self, model: nn.Module, mesh, schedule: str, virtual_stages: int):
        self.model, self.mesh, self.schedule_name = model, mesh, schedule
        self.pp, self.pp_rank = mesh.pp, mesh.coord("pp")
        self.group = mesh.group("pp")
        style = PLACEMENT.get(schedule, "loop")
        schedule_class(schedule)  # a bad name fails here, before the model is cut
        check_schedule_chunks(schedule, virtual_stages)
        self.chunks = build_chunks(model, self.pp, self.pp_rank, virtual_stages, style)
        self.num_stages = self.pp * virtual_stages
        self.last_stage_rank = chunk_to_rank(self.num_stages - 1, self.pp, style)  # reports the loss
        self.has_first = any(chunk.is_first for _, chunk in self.chunks)
        self.has_last = any(chunk.is_last for _, chunk in self.chunks)
        self._built: dict = {}
        self.tp, self.seq_split = 1, 1  # `set_tensor_parallel`
        self.stages = self.schedule = None
        self._step_loss, self._batch, self._metrics = None, [], {}

    def set_tensor_parallel(self, tp: int, sequence_parallel: bool) -> None:
        """The stages' model is cut over `tp` ranks (`parallel/tensor_parallel.py`): the p2p
        activations are [B, S/tp, H] under sequence parallel, the last stage's logits [B, S, V/tp]."""
        self.tp, self.seq_split = tp, tp if sequence_parallel else 1
        for _, chunk in self.chunks:
            chunk.seq_split = self.seq_split
        self._built.clear()

    def prepare(self, num_microbatches: int, micro_batch_shape: tuple[int, int]) -> None:
        """Build (or reuse) the stages and schedule for this micro-batch count and [batch, seq] shape."""
        key = (num_microbatches, tuple(micro_batch_shape))
        if key not in self._built:
            self._built[key] = self._build(num_microbatches, micro_batch_shape)
        self.num_microbatches = num_microbatches
        self.stages, self.schedule = self._built[key]

    def _build(self, num_microbatches: int, micro_batch_shape: tuple[int, int]):
        mesh, model = self.mesh, self.model
        # Static shapes given up front: without them the library infers them by running each
        # stage on uninitialised inputs, which FP4's non-finite-input check rightly refuses.
        mbs, seq_len = micro_batch_shape
        dtype = next(model.parameters()).dtype
        hidden = torch.zeros(mbs, seq_len // self.seq_split, model.cfg.hidden_size, dtype=dtype, device=mesh.device)
        tokens = torch.zeros(mbs, seq_len, dtype=torch.long, device=mesh.device)
        logits = torch.zeros(mbs, seq_len, model.cfg.vocab_size // self.tp, dtype=dtype, device=mesh.device)
        hidden_in = hidden.clone().requires_grad_()  # received activations need their gradient
        stages = [MicroBatchStage(chunk, c, self.num_stages, mesh.device, group=self.group,
                                input_args=(tokens if chunk.is_first else hidden_in,),
                                output_args=(logits if chunk.is_last else hidden,),
                                input_grads=(None if chunk.is_first else hidden,),
                                output_grads=(None if chunk.is_last else hidden,))
                  for c, chunk in self.chunks]
        cls = schedule_class(self.schedule_name)
        stage_arg = stages if self.schedule_name in MULTI_CHUNK_SCHEDULES else stages[0]
        return stages, cls(stage_arg, n_microbatches=num_microbatches, loss_fn=self._scaled_loss, scale_grads=False)

    def _scaled_loss(self, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The schedule's loss: `index` is the micro-batch number (the target we hand the schedule)."""
        i = int(index.reshape(-1)[0])
        loss, metrics = self._step_loss.loss(logits, self._batch[i])
        self._metrics[i] = metrics
        scaled = loss / self.num_microbatches
        scaled.unscaled = loss.detach()  # for the report; the schedule may call loss_fn for shape inference
        return scaled

    def run(self, micro_batches: list[dict], step_loss, forward_only: bool = False) -> tuple[float, dict]:
        """Forward and backward of every micro-batch (`forward_only`: forward and loss only, e.g. to
        score an RL batch under torch.no_grad()); returns the mean loss and metrics (broadcast from
        the last stage, so every pp rank returns the same)."""
        n = len(micro_batches)
        inputs = [step_loss.model_inputs(mb) for mb in micro_batches]
        shapes = {tuple(inp["tokens"].shape) for inp in inputs}
        if len(shapes) != 1:
            raise ValueError(f"the micro-batches of a pipelined step have different [batch, seq] shapes {sorted(shapes)}; "
                             "pad them to one shape (the pipeline's p2p buffers are static)")
        self.prepare(n, shapes.pop())
        self._step_loss, self._batch, self._metrics = step_loss, micro_batches, {}
        args = (torch.cat([inp["tokens"] for inp in inputs]),) if self.has_first else ()
        kwargs = stage_kwargs(inputs)
        target = torch.arange(n, device=self.mesh.device) if self.has_last else None
        losses = [] if self.has_last else None
        try:
            (self.schedule.eval if forward_only else self.schedule.step)(*args, target=target, losses=losses,
                                                                         return_outputs=False, **kwargs)
        finally:
            self._batch, self._step_loss = [], None
        loss, metrics = 0.0, {}
        if self.has_last:
            assert len(losses) == n, len(losses)
            # The same sums as the single-process trainer: Σ float(x_i) / n in micro-batch order.
            loss = sum(float(l.unscaled) / n for l in losses)
            for i in range(n):
                for key, value in self._metrics[i].items():
                    metrics[key] = metrics.get(key, 0.0) + float(value) / n
        if self.pp > 1:
            loss, metrics = self._broadcast_report(loss, metrics)
        return loss, metrics

    def _broadcast_report(self, loss: float, metrics: dict) -> tuple[float, dict]:
        """The last stage's loss and metrics to every pp rank (`parallel.wire`: names as JSON, never pickle)."""
        values = [torch.tensor([loss, *metrics.values()], dtype=torch.float64)] if self.has_last else None
        keys, (values,) = broadcast_message(list(metrics) if self.has_last else None, values,
                                            self.mesh.ranks["pp"][self.last_stage_rank], self.group, self.mesh.device,
                                            expect=lambda names: [((1 + len(names),), torch.float64)])
        return float(values[0]), dict(zip(keys, values[1:].tolist()))
