"""`Config.validate()`: every check of a config's own fields, before a process group or tensor exists.

Its functions take a `megatron_fp4.config.schema.Config`; this module imports nothing of `schema`
(`schema` imports it), so the two are no import circle. The parallel layout (pp, dp, tp, ep, etp, virtual
stages, schedule, GC-MoE's ring) is checked against the world size by
`megatron_fp4.parallel.dims.ParallelDims.from_config`, next to the mesh: the trainer runs both.

Each error names the field, the value it has and what to do instead.
"""
from __future__ import annotations

import dataclasses
import math

from megatron_fp4.config.choices import _CHOICES, RECOMPUTE_MODULES, ConfigError
from megatron_fp4.config.family import validate_family
from megatron_fp4.config.yaml_io import show

ARITHMETIC_VOCAB_SIZE = 18  # pad, bos, eos, 0-9, + - * = and space


# Sanity limits, checked before anything is built: far above any real model (Qwen3-235B: vocab 151936,
# hidden 4096, 94 layers, 128 experts), far below what would make building it allocate terabytes or
# loop for hours (a typo such as vocab_size=1e14 or num_layers=1e8).
_LIMITS = {
    "model.vocab_size": 1 << 22, "model.hidden_size": 1 << 17, "model.num_layers": 4096, "model.num_heads": 4096,
    "model.num_kv_heads": 4096, "model.head_dim": 4096, "model.max_seq_len": 1 << 24, "model.num_experts": 1 << 16,
    "model.top_k": 1 << 16, "model.moe_ffn_hidden_size": 1 << 20, "model.num_shared_experts": 1 << 10,
    "model.shared_expert_ffn_hidden_size": 1 << 20, "model.dense_ffn_hidden_size": 1 << 20,
    "data.num_samples": 1 << 28,  # the sampler holds a permutation of them (8 bytes each)
}


# Floats that become a time or a size: bounded, so a typo (1e300) is an error here, not an
# OverflowError in timedelta or an allocation on every rank.
MAX_TIMEOUT_S = 7 * 24 * 3600
MAX_BUCKET_MB = 1 << 20  # 1 TiB


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def require(cond: bool, field: str, value, fix: str) -> None:
    if not cond:
        raise ConfigError(f"{field}={show(value)}: {fix}")


def _check_finite_floats(node, prefix: str = "") -> None:
    """Every float field of every section must be a real number: NaN/Inf would reach the weights."""
    for f in dataclasses.fields(node):
        value, name = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_finite_floats(value, name + ".")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name}={value!r}: must be a finite number (NaN and Inf are not allowed)")


def check_model_limits(cfg) -> None:
    """Sizes positive and within the sanity limits: what building the model needs (also used alone
    for a checkpoint's saved config, whose layout is not this job's)."""
    m = cfg.model
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "num_experts", "top_k", "moe_ffn_hidden_size", "max_seq_len"):
        require(getattr(m, name) > 0, f"model.{name}", getattr(m, name), "must be a positive integer")
    for name in ("num_shared_experts", "shared_expert_ffn_hidden_size", "dense_ffn_hidden_size"):
        require(getattr(m, name) >= 0, f"model.{name}", getattr(m, name), "must be >= 0")
    for dotted, limit in _LIMITS.items():
        value = _get(cfg, dotted)
        require(value <= limit, dotted, value, f"exceeds the sanity limit {limit}; this is far beyond any real "
                 f"model (a typo?): give the intended size")


def validate_config(cfg) -> None:
    _check_finite_floats(cfg)
    for dotted, allowed in _CHOICES.items():
        value = _get(cfg, dotted)
        require(value in allowed, dotted, value, f"must be one of {list(allowed)}")

    m = cfg.model
    check_model_limits(cfg)
    require(m.hidden_size % m.num_heads == 0, "model.hidden_size", m.hidden_size,
             f"must be divisible by model.num_heads={m.num_heads}; change one of them")
    require(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads", m.num_kv_heads,
             f"must divide model.num_heads={m.num_heads} (grouped-query attention shares each KV head)")
    require(m.head_dim % 2 == 0, "model.head_dim", m.head_dim, "must be even (rotary embeddings rotate pairs)")
    require(m.top_k <= m.num_experts, "model.top_k", m.top_k,
             f"cannot exceed model.num_experts={m.num_experts}; lower top_k or add experts")
    for layer in m.dense_layers:
        require(isinstance(layer, int) and 0 <= layer < m.num_layers, "model.dense_layers", m.dense_layers,
                 f"entries must be layer indices in [0, {m.num_layers})")
    require(m.router_aux_loss_coef >= 0, "model.router_aux_loss_coef", m.router_aux_loss_coef, "must be >= 0")
    require(m.router_z_loss_coef >= 0, "model.router_z_loss_coef", m.router_z_loss_coef, "must be >= 0")
    require(0 <= m.moe_router_bias_update_rate <= 1, "model.moe_router_bias_update_rate", m.moe_router_bias_update_rate,
            "must be in [0, 1]: the per-step move of a router score bias (DeepSeek-V3 uses 0.001; 0 = no "
            "aux-loss-free bias)")
    require(m.moe_aux_loss_type in ("global", "seq"), "model.moe_aux_loss_type", m.moe_aux_loss_type,
             "must be 'global' or 'seq'")
    require(m.moe_capacity_factor is None or 0 < m.moe_capacity_factor <= m.num_experts, "model.moe_capacity_factor",
            m.moe_capacity_factor, f"must be in (0, model.num_experts={m.num_experts}] (e.g. 1.25; from "
            f"num_experts/top_k on nothing is dropped), or null for no capacity")
    require(m.moe_token_drop_policy in ("probs", "position"), "model.moe_token_drop_policy", m.moe_token_drop_policy,
            "must be 'probs' (drop the lowest combine weights) or 'position' (drop the latest tokens)")
    require(m.init_std > 0, "model.init_std", m.init_std, "must be > 0 (the std of the initial weights, e.g. 0.02)")
    require(m.rope_theta > 0, "model.rope_theta", m.rope_theta,
             "must be > 0 (the rotary base, e.g. 10000; 0 makes every rotary frequency NaN)")
    require(m.norm_eps > 0, "model.norm_eps", m.norm_eps, "must be > 0 (RMSNorm's epsilon, e.g. 1e-6)")
    require(m.recompute_num_layers >= 1, "model.recompute_num_layers", m.recompute_num_layers,
             "must be >= 1 (decoder layers per recomputed block with model.recompute=full)")
    require(isinstance(m.recompute_modules, list) and set(m.recompute_modules) <= set(RECOMPUTE_MODULES),
             "model.recompute_modules", m.recompute_modules, f"entries must be among {list(RECOMPUTE_MODULES)}")
    require(m.recompute != "selective" or bool(m.recompute_modules), "model.recompute_modules", m.recompute_modules,
             "model.recompute=selective needs at least one module to recompute (or set model.recompute=none)")
    if cfg.data.kind == "arithmetic":
        # The embedded tokenizer's size, as a constant: config sits above training/ in the layer
        # order and must not import it (tests/unit/test_data.py pins the two together).
        require(m.vocab_size >= ARITHMETIC_VOCAB_SIZE, "model.vocab_size", m.vocab_size,
                 f"the embedded arithmetic tokenizer needs at least {ARITHMETIC_VOCAB_SIZE} tokens")

    _validate_fp4_shapes(cfg)

    s = cfg.schedule
    require(s.seq_len <= m.max_seq_len, "schedule.seq_len", s.seq_len,
             f"exceeds model.max_seq_len={m.max_seq_len}; raise max_seq_len or shorten seq_len")
    for name in ("train_steps", "global_batch_size", "micro_batch_size", "seq_len", "max_consecutive_skips"):
        require(getattr(s, name) > 0, f"schedule.{name}", getattr(s, name), "must be a positive integer")
    require(0 <= s.warmup_steps <= s.train_steps, "schedule.warmup_steps", s.warmup_steps,
             f"must be in [0, schedule.train_steps={s.train_steps}]")

    o = cfg.optimizer
    require(o.lr > 0, "optimizer.lr", o.lr, "must be > 0")
    require(0 <= o.min_lr <= o.lr, "optimizer.min_lr", o.min_lr, f"must be in [0, optimizer.lr={o.lr}]")
    require(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optimizer.beta1/beta2", (o.beta1, o.beta2), "must be in [0, 1)")
    require(o.clip_grad >= 0, "optimizer.clip_grad", o.clip_grad, "must be >= 0 (0 disables clipping)")
    require(o.eps > 0, "optimizer.eps", o.eps, "must be > 0 (Adam's denominator epsilon, e.g. 1e-8)")
    require(o.weight_decay >= 0, "optimizer.weight_decay", o.weight_decay, "must be >= 0 (0 disables decay)")

    _validate_parallel(cfg)
    validate_family(cfg)
    _validate_packing(cfg)

    d = cfg.data
    if d.kind == "arithmetic":
        require(d.num_samples >= 1, "data.num_samples", d.num_samples,
                 "must be a positive integer (the number of generated training sequences)")
    if d.kind in ("megatron", "numpy"):
        require(bool(d.path), "data.path", d.path,
                 f"data.kind={d.kind!r} reads a file: set data.path (a .bin/.idx prefix or a .npy file)")
    c = cfg.checkpoint
    require(c.save_interval >= 0, "checkpoint.save_interval", c.save_interval, "must be >= 0")
    require(c.load != "auto" or bool(c.dir), "checkpoint.load", c.load, "'auto' needs checkpoint.dir to look in")
    require(c.keep_last >= 0, "checkpoint.keep_last", c.keep_last,
             "must be >= 0 (the number of newest step directories kept; 0 keeps all)")
    require(cfg.logging.log_interval >= 0, "logging.log_interval", cfg.logging.log_interval,
             "must be >= 0 (0 turns the periodic statistics off)")


def _validate_fp4_shapes(cfg) -> None:
    m, f = cfg.model, cfg.fp4
    if f.scope == "none":
        return
    block = 16 if f.format == "nvfp4" else 32
    # (field, size): every dimension an FP4 operand is blocked along. Inputs are blocked along the
    # last dim; weights in 16×16 tiles (NVFP4) so their output dim must be a multiple too.
    dims = [("model.hidden_size", m.hidden_size), ("model.moe_ffn_hidden_size", m.moe_ffn_hidden_size)]
    if m.num_shared_experts:
        dims.append(("model.shared_expert_ffn_hidden_size", m.shared_expert_ffn_hidden_size))
    if f.scope == "experts+attention":
        dims.append(("model.num_heads*model.head_dim", m.num_heads * m.head_dim))
        dims.append(("model.num_kv_heads*model.head_dim", m.num_kv_heads * m.head_dim))
    for name, size in dims:
        require(size % block == 0, name, size,
                 f"FP4 format {f.format} quantizes in blocks of {block}: make it a multiple of {block} "
                 f"or set fp4.scope=none")


def _validate_parallel(cfg) -> None:
    """The parallel section's fields that are no layout (the layout: `parallel.dims.ParallelDims`)."""
    p = cfg.parallel
    require(0 < p.timeout_s <= MAX_TIMEOUT_S, "parallel.timeout_s", p.timeout_s,
            f"must be in (0, {MAX_TIMEOUT_S}] seconds (how long a collective waits for a hung peer before the "
            f"job ends; {MAX_TIMEOUT_S} is a week)")
    require(0 < p.bucket_size_mb <= MAX_BUCKET_MB, "parallel.bucket_size_mb", p.bucket_size_mb,
            f"must be in (0, {MAX_BUCKET_MB}] MiB (the gradient all-reduce bucket, e.g. 4)")


def _validate_packing(cfg) -> None:
    """Packed RL micro-batches (``rl.max_tokens_per_micro_batch`` > 0) need the Qwen3-MoE attention and
    full sequences on each rank."""
    if not cfg.rl.max_tokens_per_micro_batch:
        return
    family = getattr(cfg.model, "family", "qwen3_moe")
    require(family == "qwen3_moe", "rl.max_tokens_per_micro_batch", cfg.rl.max_tokens_per_micro_batch,
            f"needs model.family=qwen3_moe (packed attention); the {family} attention takes padded micro-batches: "
            "set it to 0")
    require(getattr(cfg.parallel, "cp", 1) == 1, "rl.max_tokens_per_micro_batch", cfg.rl.max_tokens_per_micro_batch,
            f"is not supported with parallel.cp={cfg.parallel.cp} (context parallelism splits one sequence, packing "
            "joins several): set it to 0 or parallel.cp=1")
