"""verl training engine (BaseEngine, EngineRegistry backend "megatron_fp4") over our `Trainer`.

Constructed as verl's `TrainingWorker` constructs engines::

    EngineRegistry.new(model_type="language_model", backend="megatron_fp4", model_config=HFModelConfig(path=...),
                       engine_config=MegatronFP4EngineConfig(...), optimizer_config=..., checkpoint_config=...)

builds the Qwen3-MoE model at `model_config.path` (config.json + safetensors, through this project's HF
loader) and loads its weights at `initialize()`; `MegatronFP4Engine(cfg=Config)` builds our own
config's model (randomly initialised) instead.

Batches come in either of verl's layouts (see `batches`): padded (TensorDict or DataProto.batch)
or no-padding (nested `input_ids`, after `left_right_2_no_padding`, what verl's trainer sends). The
model output handed to `loss_function(model_output, data, dp_group)` is {"log_probs", "entropy" when
`calculate_entropy`} in the batch's layout, computed with the training-side FP4 mode; verl's own
`ppo_loss` and its `Metric` objects work unchanged (no-padding batches go through verl's
`prepare_micro_batches` / `postprocess_batch_func`, as verl's FSDP engine does). verl's router replay
(``engine_config.router_replay.mode`` R2 / R3 with the batch's ``enable_routing_replay``) records and
replays ``routed_experts`` as verl's Megatron engine does (`_router_replay`, `batches.VerlScore`).

The step is the trainer's (`training/trainer.py`): `forward_backward_batch` runs its micro-batches
through `Trainer.forward_backward` (FP4 step context keyed by optimizer step and micro-batch, also
across several calls of one step; layer gate; aux-loss scale), `optimizer_step` is
`Trainer.apply_update` (mesh-wide non-finite vote, clip, AdamW) at verl's lr-schedule position,
which `lr_scheduler_step` advances and the engine's checkpoint keeps (`LR_STEPS_FILE`).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Optional

import torch
from verl.workers.engine.base import BaseEngine, EngineRegistry

from verl.utils.metric import Metric
from verl.utils.py_functional import append_to_dict

from megatron_fp4.config import Config
from megatron_fp4.verl.batches import VerlScore, packed_route_capture
from megatron_fp4.verl.construct import config_from_verl, data_parallel_mesh, model_dir, router_replay_mode
from megatron_fp4.parallel.mesh import ParallelMesh
from megatron_fp4.training.checkpoint.files import write_durable_text


def _non_tensor(data, key: str, default):
    try:
        return data[key] if key in data.keys() else default
    except (KeyError, TypeError):
        return default


def _reduce(values: list):
    """Per-micro-batch metric values -> one number (verl `Metric`s aggregate by their own rule)."""
    if isinstance(values, Metric):
        return float(values.aggregate())
    return float(sum(float(v) for v in values) / len(values))


@EngineRegistry.register(model_type="language_model", backend="megatron_fp4", device=["cpu", "cuda"])
class MegatronFP4Engine(BaseEngine):
    def __init__(self, model_config=None, engine_config=None, optimizer_config=None, checkpoint_config=None, *,
                 cfg: Optional[Config] = None, micro_batch_size: Optional[int] = None, trainer=None, mesh=None):
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        if isinstance(model_config, Config):
            raise ValueError("MegatronFP4Engine(model_config=...) takes verl's HFModelConfig; pass a megatron_fp4 "
                             "Config as cfg=...")
        if model_config is not None and cfg is not None:
            raise ValueError("pass either model_config (verl: the HF checkpoint at model_config.path) or cfg "
                             "(a megatron_fp4 Config), not both")
        if model_config is not None:
            cfg = config_from_verl(model_config, engine_config, optimizer_config)
            if mesh is None:  # verl's workers: one process per rank, torch.distributed already up
                mesh = data_parallel_mesh(cfg)
        self.cfg = cfg if cfg is not None else (trainer.cfg if trainer is not None else Config())
        if router_replay_mode(engine_config) != "off":  # verl's router_replay.mode drives ours
            self.cfg.rl.router_replay = router_replay_mode(engine_config)
        self.micro_batch_size = micro_batch_size or getattr(engine_config, "micro_batch_size_per_gpu", None)
        self.trainer = trainer
        self.mesh = mesh
        self.mode = None
        self.lr_steps = 0  # verl's lr-schedule position (lr_scheduler_step); the trainer counts optimizer steps
        self.last_update: Optional[dict] = None  # the last `Trainer.apply_update` result (skipped, message, ...)

    def initialize(self):
        """Build the trainer (model, optimizer); with a model_config, load the HF checkpoint's weights."""
        if self.trainer is None:
            from megatron_fp4.training.trainer import Trainer
            self.trainer = Trainer(self.cfg, self.mesh, build_data=False)
        if self.model_config is not None:
            from megatron_fp4.integrations.hf import from_hf_state_dict, load_hf_checkpoint

            mesh = self.trainer.mesh
            if mesh.pp > 1 or mesh.ep > 1:
                raise ValueError("loading model_config.path into a pipeline- or expert-parallel trainer is not "
                                 "supported yet; the verl engine runs data-parallel ranks (each a full replica)")
            _, sd = load_hf_checkpoint(model_dir(self.model_config))  # every dp rank: the same full weights
            from_hf_state_dict(self.trainer.model, sd)
            self.trainer.reset_optimizer()  # masters from the loaded weights
        return self

    @property
    def model(self):
        return self.trainer.model

    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    @contextlib.contextmanager
    def _ctx(self, mode: str):
        self.mode = mode
        self.model.train(mode == "train")
        try:
            yield
        finally:
            self.mode = None

    def train_mode(self, **kwargs):
        return self._ctx("train")

    def eval_mode(self, **kwargs):
        return self._ctx("eval")

    # -- the step: the trainer's (FP4 step context, layer gate, aux scale, mesh-wide non-finite vote) --
    def optimizer_zero_grad(self):
        self.trainer.zero_grad()

    def optimizer_step(self) -> float:
        """`Trainer.apply_update` at verl's lr-schedule position: the mesh-wide non-finite vote, then
        clip and step (or the step refused on every rank, weights unchanged, as `schedule.nan_policy`
        says: skip returns the non-finite norm, stop raises `NonFiniteError`). Returns the grad norm."""
        result = self.trainer.apply_update(schedule_step=self.lr_steps)
        self.last_update = result
        return result["grad_norm"]

    def lr_scheduler_step(self) -> float:
        """Advance verl's lr schedule (verl steps it once per `train_batch` of its worker, which may
        hold several optimizer steps); returns the lr of the next optimizer step."""
        from megatron_fp4.training.optim import lr_at

        self.lr_steps += 1
        return lr_at(self.lr_steps, self.cfg.optimizer, self.cfg.schedule)

    # -- forward / backward ------------------------------------------------------------------------
    def forward_backward_batch(self, data, loss_function: Optional[Callable], forward_only=False) -> dict:
        if loss_function is None and not forward_only:
            raise ValueError("loss_function is required unless forward_only=True")
        if data["input_ids"].is_nested:
            return self._forward_backward_no_padding(data, loss_function, forward_only)
        return self._forward_backward_padded(data, loss_function, forward_only)

    def _run(self, micro_batches: list, score: VerlScore, loss_function, forward_only: bool,
             weights: list[float]) -> list[tuple]:
        """The micro-batches through `Trainer.forward_backward` (any layout: `score` is a `StepLoss`):
        the model output of each (`score.outputs`), verl's `loss_function(model_output, data, dp_group)`
        on it, backward of weight × loss (verl's losses are normalised already: weight 1 on no-padding
        batches, rows/B on padded ones). Numerics level as `compute_log_probs`: ``batch`` forward-only,
        ``standard`` with gradients. Returns (model output, loss, metrics) per micro-batch."""
        group, records = self.get_data_parallel_group(), []

        def loss_fn(out, mb):
            if loss_function is None:
                loss, metrics = torch.zeros((), device=self.trainer.device), {}
            else:
                loss, metrics = loss_function(model_output=out, data=mb, dp_group=group)
            records.append(({k: v.detach() for k, v in out.items()}, float(loss.detach()), metrics))
            return loss, {}

        numerics = self.trainer.model.numerics
        score.numerics, score.loss_fn = numerics, loss_fn
        try:
            self.trainer.forward_backward(micro_batches, score, weights=weights, accumulate=True,
                                          forward_only=forward_only)  # at the model's built level, both passes
        finally:
            if score.recorder is not None:
                score.recorder.remove()
        return records

    def _router_replay(self, data, forward_only: bool) -> tuple[str, bool]:
        """(routes to replay: off | r2 | r3, whether to record the routes used) for one
        forward_backward_batch, as verl's Megatron engine decides: with ``enable_routing_replay`` set
        and a mode configured, R2's forward-only pass without ``routed_experts`` records, every other
        pass replays ``routed_experts``."""
        mode = self.cfg.rl.router_replay
        if mode == "off" or not bool(_non_tensor(data, "enable_routing_replay", False)):
            return "off", False
        if mode == "r2" and forward_only and "routed_experts" not in data.keys():
            return "off", True
        return mode, False

    def _forward_backward_padded(self, data, loss_function, forward_only) -> dict:
        if self._router_replay(data, forward_only) != ("off", False):
            raise ValueError("router replay runs on verl's no-padding batches (left_right_2_no_padding, what "
                             "verl's trainer sends); this batch is padded")
        B = data["input_ids"].shape[0]
        mbs = self.micro_batch_size or B
        entropy = bool(_non_tensor(data, "calculate_entropy", False))
        micro_batches = [data[start:start + mbs] for start in range(0, B, mbs)]
        records = self._run(micro_batches, VerlScore(False, entropy), loss_function, forward_only,
                            [mb["input_ids"].shape[0] / B for mb in micro_batches])
        outputs, metrics = {}, {}
        for out, _, extra in records:
            for k, v in out.items():
                outputs.setdefault(k, []).append(v)
            append_to_dict(metrics, extra)
        return {"model_output": {k: torch.cat(v) for k, v in outputs.items()}, "loss": [r[1] for r in records],
                "metrics": {k: _reduce(v) for k, v in metrics.items()}}

    def _forward_backward_no_padding(self, data, loss_function, forward_only) -> dict:
        """verl's no-padding path, as its FSDP engine runs it: global token count and dp size for the
        loss normalisation, verl's micro-batching and its re-assembly of the nested outputs."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches

        defaults = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": self.micro_batch_size or len(data),
                    "global_batch_size": None}
        tu.assign_non_tensor(data, **{k: v for k, v in defaults.items() if k not in data.keys()})
        num_tokens = data["loss_mask"].sum().to(self.trainer.device)
        group = self.get_data_parallel_group()
        if group is not None:
            torch.distributed.all_reduce(num_tokens, group=group)
        tu.assign_non_tensor(data, batch_num_tokens=int(num_tokens.item()), dp_size=self.get_data_parallel_size())
        entropy = bool(_non_tensor(data, "calculate_entropy", False))
        replay, record = self._router_replay(data, forward_only)
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=group, same_micro_num_in_dp=True)
        micro_batches = list(micro_batches)
        if record and self.trainer.mesh.pp > 1:
            raise ValueError(f"router_replay=r2 records the routes in the old-log-prob pass, where the last stage's "
                             f"loss reads every layer's: not with parallel.pp={self.trainer.mesh.pp} > 1; use pp=1 "
                             "or r3 (the rollout's routes)")
        recorder = packed_route_capture(self.trainer.model, micro_batches, self.trainer.device) if record else None
        score = VerlScore(True, entropy, replay, recorder)
        records = self._run(micro_batches, score, loss_function, forward_only, [1.0] * len(micro_batches))
        output_lst = [{"model_output": out, "loss": loss, "metrics": metrics} for out, loss, metrics in records]
        return postprocess_batch_func(output_lst=output_lst, indices=indices, data=data)

    # -- weights and layout --------------------------------------------------------------------------
    def get_per_tensor_param(self, **kwargs):
        """(name, tensor) of this rank's weights under HF Qwen3-MoE names, per-expert tensors (the HF
        exporter's mapping: what vLLM/SGLang and verl's server adapters load; an expert-parallel rank
        yields its experts under their global indices), and no PEFT config."""
        from megatron_fp4.integrations.hf.sharded import local_hf_state_dict

        return ((n, t.detach()) for n, t in local_hf_state_dict(self.model).items()), None

    def _mesh(self):
        """The trainer's mesh once built; before `initialize()` (verl's `TrainingWorker` asks for the dp
        rank in its constructor) the one the trainer will be built on."""
        if self.trainer is not None:
            return self.trainer.mesh
        return self.mesh if self.mesh is not None else ParallelMesh.single()

    def get_data_parallel_size(self):
        return self._mesh().dp

    def get_data_parallel_rank(self):
        return self._mesh().coord("dp")

    def get_data_parallel_group(self):
        mesh = self._mesh()
        return None if mesh.dp == 1 else mesh.group("dp")

    def is_mp_src_rank_with_outputs(self):
        return True

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        super().to(device, model, optimizer, grad)
        if model and device in ("cpu", "cuda"):
            self.trainer.model.to(device)

    def save_checkpoint(self, local_path: str, hdfs_path=None, global_step: int = 0, max_ckpt_to_keep=None, **kw):
        """The trainer's checkpoint, and verl's lr-schedule position by optimizer step (`LR_STEPS_FILE`)."""
        self.trainer.save_checkpoint(local_path)
        if self.trainer.mesh.rank == 0:
            positions = {**_read_lr_steps(local_path), str(self.trainer.step): self.lr_steps}
            write_durable_text(Path(local_path) / LR_STEPS_FILE, json.dumps(positions))

    def load_checkpoint(self, local_path: str, hdfs_path=None, del_local_after_load: bool = False, **kw):
        """Resume the trainer, and verl's lr schedule where it was at that step (checkpoints without the
        record: the optimizer step, which is what the schedule position was before they were kept apart)."""
        step = self.trainer.load_checkpoint(local_path)
        self.lr_steps = _read_lr_steps(local_path).get(str(step), step)


LR_STEPS_FILE = "verl_lr_steps.json"  # {"<optimizer step>": lr-schedule position}, next to the step dirs


def _read_lr_steps(root: str) -> dict:
    path = Path(root) / LR_STEPS_FILE
    if not path.is_file():
        return {}
    if path.stat().st_size > 1 << 20:
        raise ValueError(f"{path}: {path.stat().st_size} bytes, more than 1 MiB for the lr-schedule positions; "
                         f"remove the file (the schedule then resumes at the optimizer step)")
    try:
        data = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path}: not JSON ({err}); remove the file (the schedule then resumes at the "
                         f"optimizer step)") from None
    if not isinstance(data, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                             for v in data.values()):
        raise ValueError(f"{path}: expected {{\"<step>\": non-negative int}}; remove the file (the schedule then "
                         f"resumes at the optimizer step)")
    return data
