"""Build our `Config` from what verl's `TrainingWorker` hands `EngineRegistry.new`: an
`HFModelConfig` (a Qwen3-MoE checkpoint directory: config.json + safetensors), the engine config
(`MegatronFP4EngineConfig`, strategy "megatron_fp4", or any verl `EngineConfig`), the optimizer
config and the checkpoint config.

The FP4 recipe comes from `engine_config.fp4` (a dict of `FP4Config` fields) if given, else from the
model's `megatron_fp4_quant.json` sidecar (written by `export_for_vllm`), else the project default.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch.distributed as dist
from verl.workers.config.engine import EngineConfig

from megatron_fp4.config import Config, FP4Config
from megatron_fp4.config.choices import check_choice
from megatron_fp4.config.schema import _from_dict
from megatron_fp4.integrations.hf.checkpoint import CONFIG_FILE
from megatron_fp4.integrations.hf.families import ours_config_from_hf
from megatron_fp4.model.registry import numerics_level_for
from megatron_fp4.parallel.mesh import ParallelMesh, resolve_device

SIDECAR_FP4_FIELDS = ("scope", "format", "train_mode", "rollout_mode")


@dataclass
class MegatronFP4EngineConfig(EngineConfig):
    """verl engine config for backend "megatron_fp4": `fp4` holds `FP4Config` fields (e.g.
    {"train_mode": "fp4_resq"}); `dtype` is our Config.dtype (fp32 | bf16 | fp64, or verl's torch
    names float32 | bfloat16 | float64). Any other verl `EngineConfig` (e.g. the FSDPEngineConfig of
    verl's default actor tree with `strategy: megatron_fp4`) works too: its `dtype` is read the same
    way and the FP4 recipe comes from the checkpoint's sidecar."""

    strategy: str = "megatron_fp4"
    fp4: dict = field(default_factory=dict)
    dtype: str = "fp32"


# verl's engine configs name dtypes as torch does (FSDPEngineConfig.dtype defaults to "bfloat16")
_DTYPES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp64": "fp64", "float64": "fp64"}


def _dtype(name) -> str:
    if name is None:
        return "fp32"
    if str(name) not in _DTYPES:
        raise ValueError(f"engine dtype={name!r} is not supported by the megatron_fp4 engine; use one of "
                         f"{sorted(_DTYPES)} (e.g. actor_rollout_ref.actor.fsdp_config.dtype=float32)")
    return _DTYPES[str(name)]


def model_dir(model_config) -> Path:
    path = getattr(model_config, "local_path", None) or getattr(model_config, "path", None)
    if not path or not (Path(path) / CONFIG_FILE).is_file():
        raise ValueError(f"model_config.path={path!r} is not a Hugging Face checkpoint directory ({CONFIG_FILE} "
                         "not found); point actor_rollout_ref.model.path at a Qwen3-MoE checkpoint")
    return Path(path)


def fp4_config_for(path: Path, engine_config=None) -> FP4Config:
    """`engine_config.fp4` if given, else the checkpoint's sidecar, else the project default."""
    from megatron_fp4.integrations.vllm import SIDECAR_FILE, load_quant_sidecar

    fields = dict(getattr(engine_config, "fp4", None) or {})
    if not fields and (path / SIDECAR_FILE).is_file():
        sidecar = load_quant_sidecar(path)
        fields = {k: sidecar[k] for k in SIDECAR_FP4_FIELDS if k in sidecar}
    return _from_dict(FP4Config, fields, "engine_config.fp4")


def checkpoint_numerics_level(path: Path, family: str) -> str:
    """The numerics level (`numerics.invariance`) the actor and the project's own rollout compute at
    for the checkpoint at `path`: the level the vLLM plugin serves its `quantization_config` block at
    (`integrations.vllm.sidecar.served_level`), so an actor scoring what vLLM rolled out agrees with
    it; the project default without a block. A family that lacks the level runs its first one."""
    from megatron_fp4.integrations.vllm.sidecar import QUANT_METHOD, served_level

    block = json.loads((path / CONFIG_FILE).read_text()).get("quantization_config") or {}
    wanted = served_level(block) if block.get("quant_method") == QUANT_METHOD else Config().numerics.invariance
    return numerics_level_for(family, wanted)


# verl's EngineRouterReplayConfig.mode (engine_config.router_replay, e.g. actor.megatron.router_replay.mode)
# -> our rl.router_replay
_ROUTER_REPLAY = {"disabled": "off", "R2": "r2", "R3": "r3"}


def router_replay_mode(engine_config) -> str:
    """``rl.router_replay`` for verl's ``engine_config.router_replay.mode`` (absent: off)."""
    mode = getattr(getattr(engine_config, "router_replay", None), "mode", "disabled")
    check_choice("router_replay.mode", mode, sorted(_ROUTER_REPLAY), "verl's modes")
    return _ROUTER_REPLAY[mode]


def config_from_verl(model_config, engine_config=None, optimizer_config=None) -> Config:
    """Our Config for verl's (model_config, engine_config, optimizer_config)."""
    path = model_dir(model_config)
    cfg = Config(model=ours_config_from_hf(json.loads((path / CONFIG_FILE).read_text())))
    cfg.numerics.invariance = checkpoint_numerics_level(path, cfg.model.family)  # what its vLLM plugin serves
    cfg.fp4 = fp4_config_for(path, engine_config)
    # The gradient is verl's loss_function's alone, as in verl's FSDP/Megatron engines (HF Qwen3-MoE adds
    # its router aux loss only to its own LM loss). A per-micro-batch aux term would also make the
    # update depend on how verl splits the batch over dp ranks and micro-batches.
    cfg.model.router_aux_loss_coef = cfg.model.router_z_loss_coef = 0.0
    cfg.dtype = _dtype(getattr(engine_config, "dtype", None))
    cfg.logging.tensorboard_dir = None
    cfg.rl.router_replay = router_replay_mode(engine_config)
    seed = getattr(engine_config, "seed", None)
    if seed is not None:
        cfg.schedule.seed = int(seed)
    o = optimizer_config
    if o is not None:
        cfg.optimizer.lr = float(o.lr)
        cfg.optimizer.weight_decay = float(o.weight_decay)
        cfg.optimizer.beta1, cfg.optimizer.beta2 = (float(b) for b in o.betas)
        cfg.optimizer.clip_grad = float(o.clip_grad)
        warmup: Optional[int] = getattr(o, "lr_warmup_steps", None)
        total = int(getattr(o, "total_training_steps", -1) or -1)
        if (warmup is None or warmup < 0) and total > 0:
            warmup = int(float(getattr(o, "lr_warmup_steps_ratio", 0.0) or 0.0) * total)
        cfg.schedule.warmup_steps = max(0, int(warmup or 0))
        cfg.schedule.train_steps = total if total > 0 else max(1, cfg.schedule.warmup_steps)
        # verl's "constant" scheduler (its default) ignores min_lr_ratio: lr stays at lr after warmup;
        # "cosine" decays to lr * min_lr_ratio at total_training_steps
        kind = str(getattr(o, "lr_scheduler_type", None) or getattr(o, "warmup_style", None) or "constant")
        if kind not in ("constant", "cosine"):
            raise ValueError(f"optim.lr_scheduler_type={kind!r}: the megatron_fp4 engine supports constant and cosine")
        ratio = getattr(o, "min_lr_ratio", None)
        cosine = kind == "cosine" and total > 0
        cfg.optimizer.min_lr = cfg.optimizer.lr * (float(ratio or 0.0) if cosine else 1.0)
    return cfg


def data_parallel_mesh(cfg: Config):
    """The mesh of a verl worker rank: every process of torch.distributed's default group is one
    data-parallel rank (a full model replica), so dp size and rank are the group's; None (a single
    process) when torch.distributed is not initialised or has one rank. Sets `cfg.parallel.dp` and a
    schedule that validates for it (the trainer's own data loader is not used under verl)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    world = dist.get_world_size()
    cfg.parallel.dp, cfg.parallel.pp, cfg.parallel.ep = world, 1, 1
    cfg.schedule.global_batch_size = cfg.schedule.micro_batch_size * world
    return ParallelMesh.build(pp=1, dp=world, device=resolve_device(cfg.device), timeout_s=cfg.parallel.timeout_s)
