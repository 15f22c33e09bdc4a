"""Typed configuration: dataclasses, YAML loading, dotted overrides and one `validate()`.

Every field a user can set lives here. Unknown keys are errors (a typo must never be silently
ignored) and `validate()` runs before any process group or tensor exists, naming the field, the
value and the fix.

    cfg = load_config("megatron_fp4/configs/tiny_moe.yaml", overrides=["model.num_layers=4"])
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

from megatron_fp4.config.choices import ConfigError, apply_env_overrides, choice_for_bool
from megatron_fp4.config.validate import validate_config
from megatron_fp4.config.yaml_io import MAX_BYTES, Plain, parse_yaml, plain_value, show


@dataclass
class ModelConfig:
    # The model family (megatron_fp4/model/registry.py, docs/families.md): qwen3_moe | gpt_oss | deepseek_v3
    family: str = "qwen3_moe"
    vocab_size: int = 32
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    # RoPE scaling: null (plain RoPE) or YaRN, {rope_type: yarn, factor, original_max_position_embeddings,
    # beta_fast (32), beta_slow (1), truncate (true)} as in the HF config (GPT-OSS)
    rope_scaling: Optional[dict] = None
    # Per layer "full_attention" | "sliding_attention" (empty: all full); sliding layers see the last
    # sliding_window keys (GPT-OSS alternates them)
    layer_types: list = field(default_factory=list)
    sliding_window: int = 0
    norm_eps: float = 1e-6
    # DeepSeek-V3 multi-head latent attention (model.family=deepseek_v3; 0 elsewhere): q low rank (0:
    # one q_proj), kv low rank, per-head non-rotary / rotary query-key dims and value dim
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek-V3 routing: sigmoid scores, top-k within the moe_topk_group best of moe_n_group expert
    # groups, combine weights times moe_routed_scaling_factor
    moe_n_group: int = 1
    moe_topk_group: int = 1
    moe_routed_scaling_factor: float = 1.0
    # MoE
    num_experts: int = 8
    top_k: int = 2
    moe_ffn_hidden_size: int = 64
    norm_topk_prob: bool = True
    num_shared_experts: int = 0
    shared_expert_ffn_hidden_size: int = 64
    # Layers given here are dense SwiGLU MLPs instead of MoE (e.g. [0] for a dense first layer).
    dense_layers: list = field(default_factory=list)
    dense_ffn_hidden_size: int = 128
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.001
    # aux-loss-free balancing (DeepSeek-V3): per-expert router bias for the top-k selection, moved by
    # this rate · sign(mean load - load) after each optimizer step (0: off, no bias)
    moe_router_bias_update_rate: float = 0.0
    moe_aux_loss_type: str = "global"  # global (over the batch's tokens) | seq (DeepSeek-V3 per sequence)
    # Expert capacity (Megatron-Core's moe_expert_capacity_factor; model/capacity.py): None = no
    # capacity; else each expert takes <= ceil(T*k/E*factor) (token, slot) pairs of a forward call,
    # dropping the rest by moe_token_drop_policy: probs (lowest weights first) | position (latest
    # tokens first). Pretraining/SFT only: rollouts would drop other tokens (refused for RL).
    moe_capacity_factor: Optional[float] = None
    moe_token_drop_policy: str = "probs"
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Activation recomputation (megatron_fp4/model/recompute.py): none | full (each block of
    # recompute_num_layers decoder layers re-runs in backward) | selective (the recompute_modules,
    # of attention, experts, mlp, moe, re-run in backward, keeping their GEMM outputs)
    recompute: str = "none"
    recompute_num_layers: int = 1
    recompute_modules: list = field(default_factory=lambda: ["attention", "experts", "mlp"])


@dataclass
class FP4Config:
    # Which linears are FP4: "experts" (expert fc1/fc2 and shared experts), "experts+attention"
    # (adds q/k/v/o) or "none". Router, embeddings, norms and LM head are never quantized.
    scope: str = "experts"
    format: str = "nvfp4"  # nvfp4 | mxfp4
    train_mode: str = "fp4_resq"  # bf16 | fp4 | fp4_resq
    rollout_mode: str = "fp4_resq"
    quantize_backward: bool = True
    grad_rounding: str = "nearest"  # nearest | stochastic
    seed: int = 0
    compile: str = "auto"  # auto | on | off: compiled fake-quant kernels (fp4/fused.py; MEGATRON_FP4_COMPILE overrides)
    # auto | off | interpret: Triton quantizers on CUDA (fp4/triton_fp4.py; MEGATRON_FP4_TRITON overrides)
    triton: str = "auto"


@dataclass
class ParallelConfig:
    pp: int = 1
    dp: int = -1  # -1: whatever the world size leaves
    ep: int = 1
    tp: int = 1  # tensor parallel: attention, dense MLP, embedding/LM head (MoE layers: moe_tp_tokens, etp)
    sequence_parallel: bool = True  # with tp > 1: norms/residuals on 1/tp of the sequence (Megatron's SP)
    # with tp > 1, the tokens a tp rank's MoE layers route: whole (the whole sequence on every tp rank,
    # the default) | local (its own 1/tp of the sequence: Megatron's parallel folding; ep may then span
    # the stage's dp×tp ranks; FP4 experts need ep a multiple of tp and the alltoall dispatcher)
    moe_tp_tokens: str = "whole"
    etp: int = 1  # expert tensor parallel (a stage's dp×tp ranks refolded as edp×ep×etp): 1, or = tp (MoE whole)
    # context parallel (docs/parallel.md): each sequence split over cp ranks in 2·cp load-balanced chunks,
    # attention by an all-gather of K/V; world = pp × dp × cp × tp (dp counts data replicas)
    cp: int = 1
    virtual_stages: int = 1
    # gpipe | 1f1b | interleaved_1f1b | interleaved_zero_bubble (ZB1P, virtual_stages >= 2) | zbv (ZB-V,
    # virtual_stages = 2, V placement); the zero-bubble ones split backward into input- and weight-grad
    schedule: str = "1f1b"
    zero_stage: int = 1  # 0 (plain DDP-style all-reduce), 1 or 2
    bucket_size_mb: float = 4.0
    expert_dispatcher: str = "alltoall"  # alltoall | gcmoe
    gcmoe_chunk_tokens: int = 64
    gcmoe_ring_slots: int = 8  # receive ring: ring_slots × chunk_tokens × hidden elements per rank
    gcmoe_transfer_sms: int = 20  # CUDA green-context split; ignored on CPU
    # Seconds any collective of any group the mesh creates may wait for a peer before the job ends
    # with an error (a hung or stopped rank must not block the others forever).
    timeout_s: float = 300.0


@dataclass
class OptimizerConfig:
    lr: float = 3e-3
    min_lr: float = 3e-4
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass
class ScheduleConfig:
    # Optimizer steps of the run (>= 1): `Trainer.train` stops there and the learning rate reaches
    # optimizer.min_lr there (training/optim.py: linear warm-up, then cosine decay).
    train_steps: int = 200
    # Steps of the linear warm-up from 0 to optimizer.lr, in [0, train_steps].
    warmup_steps: int = 20
    # Sequences per optimizer step over all data replicas; a multiple of micro_batch_size × the data-parallel
    # size (parallel.dp; the cp ranks of a replica share its sequences). With pp > 1: at least pp micro-batches
    # per step (1f1b), a multiple of pp (interleaved schedules).
    global_batch_size: int = 16
    # Sequences per micro-batch (one forward/backward pass of a replica; >= 1). Gradients are accumulated over
    # global_batch_size / (micro_batch_size × dp) micro-batches per step.
    micro_batch_size: int = 4
    # Tokens per training sequence (<= model.max_seq_len). With tp > 1 and sequence_parallel: a multiple of tp;
    # with cp > 1: a multiple of 2·cp (and with both, seq_len / cp a multiple of tp).
    seq_len: int = 64
    # Seeds the weight initialisation, the data sampler (its order is resumable) and the GRPO loop's sampling and
    # minibatch shuffle: the same seed, the same bits.
    seed: int = 1234
    # A step in which any rank saw a non-finite activation, loss or gradient: stop (NonFiniteError on every rank,
    # the weights unchanged) | skip (the step's update dropped on every rank; the run goes on).
    nan_policy: str = "stop"
    max_consecutive_skips: int = 10  # with nan_policy=skip: stop after this many non-finite steps in a row (>= 1)


@dataclass
class DataConfig:
    kind: str = "arithmetic"  # arithmetic | megatron | numpy
    path: Optional[str] = None
    num_samples: int = 20000
    max_operand: int = 99


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    save_interval: int = 100  # steps between saves (and always at the end, when dir is set); 0: only at the end
    load: Optional[str] = None  # a checkpoint directory, or "auto" for the latest in `dir`
    keep_last: int = 3  # newest step directories kept in `dir` (older ones are deleted); 0 keeps all


@dataclass
class LoggingConfig:
    tensorboard_dir: Optional[str] = "runs/tiny_moe"
    log_interval: int = 10
    progress: bool = True


@dataclass
class NumericsConfig:
    # The numerics level (megatron_fp4/fp4/invariant.py, docs/numerics.md) of the rollout engine and the
    # trainer's no-grad log-prob scoring. "batch": fixed-shape kernel calls, a token's log-prob and experts
    # do not depend on the batch, padding or KV cache (rollout and trainer at the same tp agree bit for
    # bit). "exact": FP4 GEMMs summed exactly, bits independent of the layout too (a rollout at another
    # tp than the trainer). "standard": the fastest, batch-variant kernels. Cost: benchmarks/bench_batch_invariant.py.
    invariance: str = "batch"


MAX_STALENESS = 64  # rl.max_staleness's bound: each batch in flight holds its samples in memory


@dataclass
class RLConfig:
    router_replay: str = "off"  # off | r2 | r3 (megatron_fp4/rl/algo/replay.py)
    # Off-policy overlap (megatron_fp4/rl/overlap.py): batch m is sampled with policy version
    # max(0, m - max_staleness) while the trainer updates on earlier batches; 0 = the synchronous loop.
    max_staleness: int = 0
    staleness_policy: str = "wait"  # wait (deterministic) | drop (stale batches dropped, not deterministic)
    # Packed micro-batches (megatron_fp4/training/packing.py): GRPO scoring and updates lay prompts +
    # responses back to back, no padding, at most this many tokens per micro-batch; 0 (or null): the
    # padded micro-batches of micro_batch_size rows.
    max_tokens_per_micro_batch: Optional[int] = 0
    # PipelineRL's in-flight weight updates: a request picks up a newly loaded version between decode
    # steps (KV cache kept); needs max_staleness >= 1 and staleness_policy=drop (under wait no
    # version is published while a batch it may affect is generating).
    inflight_updates: bool = False

    def __post_init__(self):
        budget = self.max_tokens_per_micro_batch
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ConfigError(f"rl.max_tokens_per_micro_batch={budget!r} must be an integer >= 0 (0: padded "
                              "micro-batches of micro_batch_size rows; N: micro-batches packed to at most N tokens, "
                              "at least the longest prompt + response)")
        if self.router_replay not in ("off", "r2", "r3"):
            raise ConfigError(f"rl.router_replay={self.router_replay!r} must be one of off | r2 | r3")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) \
                or not 0 <= self.max_staleness <= MAX_STALENESS:
            raise ConfigError(f"rl.max_staleness={self.max_staleness!r} must be an integer in 0..{MAX_STALENESS} "
                              "(0: the synchronous loop; k: a batch is trained on at most k versions after the one "
                              "that sampled it)")
        if self.staleness_policy not in ("wait", "drop"):
            raise ConfigError(f"rl.staleness_policy={self.staleness_policy!r} must be wait (deterministic: the "
                              "rollout waits for the version a batch needs) or drop (stale batches are dropped)")
        if not isinstance(self.inflight_updates, bool):
            raise ConfigError(f"rl.inflight_updates={self.inflight_updates!r} must be true or false")
        if self.inflight_updates and (self.max_staleness == 0 or self.staleness_policy != "drop"):
            raise ConfigError("rl.inflight_updates=true needs rl.max_staleness >= 1 and rl.staleness_policy=drop: "
                              "otherwise no version is published while a request is generating, so nothing would "
                              "change; set both, or rl.inflight_updates=false")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    fp4: FP4Config = field(default_factory=FP4Config)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    numerics: NumericsConfig = field(default_factory=NumericsConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "fp32"  # fp32 | bf16 (autocast on CUDA, bf16 params on CPU) | fp64 (verification: all in float64)

    def validate(self) -> "Config":
        """Every field on its own (the layout against a world size: `parallel.dims.ParallelDims`)."""
        validate_config(self)
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_INT_TEXT = re.compile(r"[-+]?[0-9][0-9_]*")
_FLOAT_TEXT = re.compile(r"[-+]?(\.[0-9]+|[0-9][0-9_]*(\.[0-9_]*)?)([eE][-+]?[0-9]+)?")


def _is_optional(hint: Any) -> bool:
    return "Optional" in str(hint) or "None" in str(hint)


def _non_optional(hint: Any) -> Any:
    """X of Optional[X] (its value is converted like an X field's), else `hint`."""
    args = [a for a in get_args(hint) if a is not type(None)]
    return args[0] if get_origin(hint) is Union and len(args) == 1 else hint


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Convert a YAML/CLI value to the annotated type, with an error naming the field. A `Plain`
    YAML scalar gives its text to a str field (``off``, ``0755``, ``12:30`` stay as written) and
    its YAML value to the others."""
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of fields, got {show(value)}")
        return _from_dict(hint, value, where)
    base = _non_optional(hint)
    yaml_value = value.value if isinstance(value, Plain) else value
    if yaml_value is None:
        if _is_optional(hint):
            return None
        raise ConfigError(f"{where}: null is not allowed here; give a value of type {getattr(base, '__name__', hint)}")
    try:
        if base is str:
            return _to_str(value, where)
        if base is bool:
            if isinstance(yaml_value, str) and yaml_value.lower() in ("true", "false", "1", "0"):
                return yaml_value.lower() in ("true", "1")
            if not isinstance(yaml_value, bool):
                raise TypeError
            return yaml_value
        if base is int:
            return _to_int(value)
        if base is float:
            if isinstance(yaml_value, bool) or isinstance(yaml_value, (list, dict)):
                raise TypeError
            return float(yaml_value)
        if base is list:
            if not isinstance(yaml_value, (list, tuple)):
                raise TypeError
            return list(plain_value(yaml_value))
    except (TypeError, ValueError, OverflowError):
        either = " or null" if base is not hint else ""
        raise ConfigError(f"{where}={show(value)}: expected {getattr(base, '__name__', hint)}{either}") from None
    return plain_value(value)


def _to_str(value: Any, where: str) -> str:
    if isinstance(value, Plain):
        return value.text
    if isinstance(value, bool):  # a Python bool (config_from_dict): the field's own on/off names, if any
        named = choice_for_bool(where, value)
        if named is None:
            raise TypeError
        return named
    if not isinstance(value, (str, int, float)):
        raise TypeError
    return str(value)


def _to_int(value: Any) -> int:
    """Decimal text (``0755`` is 755, not YAML 1.1's octal), an integral ``1e6``, or YAML's int."""
    if isinstance(value, Plain) and _INT_TEXT.fullmatch(value.text):
        return int(value.text.replace("_", ""))
    if isinstance(value, Plain) and ":" in value.text:  # YAML 1.1's base 60 (12:30 = 750): never meant
        raise TypeError
    text = value.text if isinstance(value, Plain) else value
    if isinstance(text, str) and _FLOAT_TEXT.fullmatch(text):
        value = float(text.replace("_", ""))
    elif isinstance(value, Plain):
        value = value.value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float)
                                                                        and not value.is_integer()):
        raise TypeError
    return int(value)


def _from_dict(cls, data: dict, prefix: str = ""):
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if prefix == "numerics" and "batch_invariant" in unknown:
        raise ConfigError("numerics.batch_invariant was replaced by numerics.invariance: write "
                          "'invariance: exact' for the old true (layout-invariant bits), 'batch' for the faster "
                          "batch-invariant default, 'standard' for the old false")
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"unknown config key(s) {[where + k for k in unknown]}; valid keys under "
            f"'{prefix or '<top level>'}' are {sorted(names)} (check the spelling)"
        )
    kwargs = {k: _coerce(v, hints[k], f"{prefix}.{k}" if prefix else k) for k, v in data.items()}
    return cls(**kwargs)


def config_from_dict(data: dict) -> Config:
    return _from_dict(Config, data or {})


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to a nested dict, in place."""
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value, e.g. model.num_layers=4")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
        node[parts[-1]] = parse_yaml(raw) if raw.strip() != "" else None
    return data


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> Config:
    """Load a YAML config (or the defaults when path is None) and apply dotted overrides, then the
    environment's (``MEGATRON_FP4_COMPILE``, ``MEGATRON_FP4_TRITON``: the only place they are read)."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "does not exist"
            raise ConfigError(f"config file {str(path)!r} {what}; pass an existing YAML file")
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise ConfigError(f"config file {str(path)!r} is {size} bytes; a config is a few KB (at most "
                              f"{MAX_BYTES}): pass the YAML config, not another file")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start}); "
                              f"pass the YAML config") from None
        data = parse_yaml(text) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections at the top level")
    apply_overrides(data, overrides or [])
    apply_env_overrides(data, os.environ)
    return config_from_dict(data)


def default_config_path() -> Path:
    """The embedded default: the tiny FP4 MoE that trains on a laptop in minutes."""
    return Path(__file__).parent.parent / "configs" / "tiny_moe.yaml"
