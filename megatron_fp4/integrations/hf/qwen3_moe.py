"""Hugging Face Qwen3-MoE <-> megatron-fp4: config fields and weight names.

Our `MoETransformer` is the Qwen3-MoE decoder, so the mapping is a renaming plus one reshaping:

    ours                                   HF (``Qwen3MoeForCausalLM``)
    embed_tokens.weight                    model.embed_tokens.weight
    layers.{i}.<attention / norms>         model.layers.{i}.<same name>
    layers.{i}.mlp.{gate,up,down}_proj     model.layers.{i}.mlp.{gate,up,down}_proj.weight   (dense layers)
    layers.{i}.mlp.router.weight [E, H]    model.layers.{i}.mlp.gate.weight
    layers.{i}.mlp.experts.w13 [E, 2F, H]  "checkpoint": mlp.experts.{e}.gate_proj.weight = w13[e, :F],
                                                        mlp.experts.{e}.up_proj.weight   = w13[e, F:]
                                           "fused":      mlp.experts.gate_up_proj (the same tensor)
    layers.{i}.mlp.experts.w2 [E, H, F]    "checkpoint": mlp.experts.{e}.down_proj.weight = w2[e]
                                           "fused":      mlp.experts.down_proj (the same tensor)
    norm.weight, lm_head.weight            model.norm.weight, lm_head.weight (absent when tied)

Two HF layouts exist for the experts. "checkpoint" (per-expert tensors) is what safetensors files
on the Hub hold and what transformers 5.x `save_pretrained` writes; "fused" is the module layout of
transformers >= 5 (`Qwen3MoeExperts.gate_up_proj` / `down_proj`, i.e. `model.state_dict()`), whose
loader concatenates gate then up per expert, exactly our w13. `to_hf_state_dict` writes
"checkpoint" by default; `from_hf_state_dict` accepts either, per layer.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch

from megatron_fp4.config import ModelConfig
from megatron_fp4.integrations.hf.config_fields import (bool_field, config_dict, float_field, int_field, layer_list,
                                                        string_list)
from megatron_fp4.integrations.hf.safetensors_header import FLOAT_DTYPES
from megatron_fp4.model.experts import GroupedExperts

HF_MODEL_TYPE = "qwen3_moe"
HF_ARCHITECTURE = "Qwen3MoeForCausalLM"
LAYOUTS = ("checkpoint", "fused")

# Qwen3MoeConfig's defaults (transformers 5.10) for optional fields a config.json may omit, so a
# sparse config.json means here what it means to transformers.
_HF_DEFAULTS = {
    "intermediate_size": 6144, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001, "tie_word_embeddings": False, "initializer_range": 0.02, "rope_theta": 10000.0,
    "decoder_sparse_step": 1,
}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "moe_intermediate_size",
             "num_experts_per_tok")
_MAX_LISTED = 20  # keys listed per category in a mismatch error


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
def hf_config_from_ours(model_cfg: ModelConfig) -> dict:
    """The `transformers.Qwen3MoeConfig` fields (a config.json dict) for our `ModelConfig`.

    RoPE is written both as transformers-5 `rope_parameters` and as the legacy top-level
    `rope_theta` that 4.x readers (and vLLM) use; transformers 5 prefers `rope_parameters`.
    Experts are counted under `num_experts` (the Hub spelling; 5.x maps it to num_local_experts).
    Our router z-loss has no HF counterpart and is not written.
    """
    m = model_cfg
    if m.num_shared_experts:
        raise ValueError(f"model.num_shared_experts={m.num_shared_experts}: Qwen3-MoE has no shared expert, so "
                         f"this model cannot be exported as Qwen3-MoE; set num_shared_experts=0")
    theta = float(m.rope_theta)
    return {
        "model_type": HF_MODEL_TYPE,
        "architectures": [HF_ARCHITECTURE],
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "intermediate_size": m.dense_ffn_hidden_size,
        "moe_intermediate_size": m.moe_ffn_hidden_size,
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "norm_topk_prob": bool(m.norm_topk_prob),
        "decoder_sparse_step": 1,
        "mlp_only_layers": sorted(int(i) for i in m.dense_layers),
        "rms_norm_eps": float(m.norm_eps),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": m.max_seq_len,
        "tie_word_embeddings": bool(m.tie_embeddings),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "router_aux_loss_coef": float(m.router_aux_loss_coef),
        "initializer_range": float(m.init_std),
    }


def _rope_theta(d: Mapping[str, Any]) -> float:
    """RoPE base from either spelling; only plain (default) RoPE is supported."""
    theta = float_field(d, "rope_theta", _HF_DEFAULTS["rope_theta"], positive=True)
    for key in ("rope_parameters", "rope_scaling"):
        params = d.get(key)
        if not params:
            continue
        if not isinstance(params, Mapping):
            raise ValueError(f"HF config {key}={params!r:.80}: expected a mapping like "
                             f"{{'rope_type': 'default', 'rope_theta': 1000000.0}}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"HF config {key}.rope_type={rope_type!r:.80}: only default RoPE is supported by our "
                             f"attention (no yarn/linear/dynamic scaling); use a checkpoint without RoPE scaling")
        theta = float_field(params, "rope_theta", theta, positive=True)
    return theta


def _is_megatron_fp4_recipe(block) -> bool:
    """A `quantization_config` that only records our FP4 recipe over high-precision weights (what
    `tools/convert_checkpoint.py to-hf` writes for the vLLM plugin): the weights read as usual."""
    return isinstance(block, Mapping) and block.get("quant_method") == "megatron_fp4"


def ours_config_from_hf(hf_cfg) -> ModelConfig:
    """Our `ModelConfig` from a Qwen3-MoE config (a config.json dict or a `PretrainedConfig`).

    Absent optional fields take Qwen3MoeConfig's defaults. `mlp_only_layers` and
    `decoder_sparse_step` both become `dense_layers` (HF's rule: layer i is dense when it is in
    mlp_only_layers or (i+1) % decoder_sparse_step != 0). Fields with no HF counterpart
    (router_z_loss_coef, num_shared_experts=0) keep our defaults. Features our decoder does not
    implement raise ValueError naming the field.
    """
    d = config_dict(hf_cfg, "Qwen3-MoE")
    model_type = d.get("model_type", HF_MODEL_TYPE)
    if model_type != HF_MODEL_TYPE:
        raise ValueError(f"HF config model_type={model_type!r:.80}: only {HF_MODEL_TYPE!r} (Qwen3-MoE) is supported")
    config_dict(d, "Qwen3-MoE", _REQUIRED)
    unsupported = {
        "attention_bias": (bool(d.get("attention_bias")), "our q/k/v/o projections have no bias"),
        "use_sliding_window": (bool(d.get("use_sliding_window")), "our attention is full causal attention"),
        "layer_types": (any(t != "full_attention" for t in string_list(d, "layer_types")),
                        "only full_attention layers are implemented"),
        "hidden_act": (d.get("hidden_act", "silu") != "silu", "our MLPs are SwiGLU (silu)"),
        "quantization_config": (bool(d.get("quantization_config"))
                                and not _is_megatron_fp4_recipe(d["quantization_config"]),
                                "pre-quantized (e.g. FP8) checkpoints are not read; use the bf16 checkpoint"),
    }
    for name, (bad, why) in unsupported.items():
        if bad:
            raise ValueError(f"HF config {name}={d.get(name)!r:.80} is not supported: {why}")
    num_layers = int_field(d, "num_hidden_layers")  # bounded before anything loops over the layers
    step = int_field(d, "decoder_sparse_step", _HF_DEFAULTS["decoder_sparse_step"])
    mlp_only = layer_list(d, "mlp_only_layers")
    dense_layers = [i for i in range(num_layers) if i in mlp_only or (i + 1) % step != 0]
    num_experts = d.get("num_experts", d.get("num_local_experts"))
    if not num_experts or len(dense_layers) == num_layers:
        raise ValueError(f"HF config num_experts={num_experts!r:.80}, mlp_only_layers={sorted(mlp_only)!r:.80}, "
                         f"decoder_sparse_step={step}: no layer is MoE; this is a dense model, not Qwen3-MoE")
    num_experts = int_field(d, "num_experts", alias="num_local_experts")
    top_k = int_field(d, "num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"HF config num_experts_per_tok={top_k} must be <= num_experts={num_experts}")
    hidden, num_heads = int_field(d, "hidden_size"), int_field(d, "num_attention_heads")
    num_kv_heads = int_field(d, "num_key_value_heads", num_heads)
    head_dim = int_field(d, "head_dim", max(hidden // num_heads, 1))
    if num_heads % num_kv_heads:
        raise ValueError(f"HF config num_key_value_heads={num_kv_heads} must divide num_attention_heads={num_heads}")
    if head_dim % 2:
        raise ValueError(f"HF config head_dim={head_dim} must be even (rotary embeddings rotate pairs)")

    return ModelConfig(
        vocab_size=int_field(d, "vocab_size"), hidden_size=hidden, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        max_seq_len=int_field(d, "max_position_embeddings", _HF_DEFAULTS["max_position_embeddings"]),
        rope_theta=_rope_theta(d), norm_eps=float_field(d, "rms_norm_eps", _HF_DEFAULTS["rms_norm_eps"], positive=True),
        num_experts=num_experts, top_k=top_k, moe_ffn_hidden_size=int_field(d, "moe_intermediate_size"),
        norm_topk_prob=bool_field(d, "norm_topk_prob", _HF_DEFAULTS["norm_topk_prob"]),
        num_shared_experts=0, dense_layers=dense_layers,
        dense_ffn_hidden_size=int_field(d, "intermediate_size", _HF_DEFAULTS["intermediate_size"]),
        router_aux_loss_coef=float_field(d, "router_aux_loss_coef", _HF_DEFAULTS["router_aux_loss_coef"]),
        tie_embeddings=bool_field(d, "tie_word_embeddings", _HF_DEFAULTS["tie_word_embeddings"]),
        init_std=float_field(d, "initializer_range", _HF_DEFAULTS["initializer_range"]),
    )


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------
def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: must be one of {list(LAYOUTS)} ('checkpoint' = per-expert tensors "
                         f"as in Hub safetensors files, 'fused' = transformers>=5 module state_dict)")


def _check_no_shared_experts(model) -> None:
    if getattr(model.cfg, "num_shared_experts", 0):
        raise ValueError(f"model.num_shared_experts={model.cfg.num_shared_experts}: Qwen3-MoE has no shared "
                         f"expert; this model has no HF Qwen3-MoE equivalent")


_BIAS = ".mlp.router.expert_bias"  # aux-loss-free balancing's router bias, a buffer (model/moe.py)


def _hf_bias_name(name: str) -> str:
    """Our router bias -> DeepSeek-V3's HF name for it (``mlp.gate.e_score_correction_bias``)."""
    return "model." + name[: -len("router.expert_bias")] + "gate.e_score_correction_bias"


def _weights(model):
    """(name, tensor) of every parameter, then of every router bias buffer: what the HF names map."""
    yield from model.named_parameters()
    yield from ((n, b) for n, b in model.named_buffers() if n.endswith(_BIAS))


def to_hf_state_dict(model, layout: str = "checkpoint") -> dict[str, torch.Tensor]:
    """HF Qwen3-MoE tensors of `model` (detached; they may be views of our parameters, so clone
    before modifying them). `layout` "checkpoint" (default) gives per-expert tensors as in Hub
    safetensors files; "fused" gives `Qwen3MoeForCausalLM.state_dict()` names of transformers 5.x."""
    _check_no_shared_experts(model)
    return hf_tensors(model, layout)


def _same(name: str) -> str:
    return name


def hf_tensors(model, layout: str = "checkpoint", rename: Callable[[str], str] = _same) -> dict[str, torch.Tensor]:
    """`to_hf_state_dict` without the Qwen3-MoE check; `rename` maps our other (non-expert, non-router)
    parameter names to the family's HF names without the ``model.`` prefix (DeepSeek-V3 shares the
    rest of this layout)."""
    _check_layout(layout)
    out: dict[str, torch.Tensor] = {}
    for name, param in _weights(model):
        t = param.detach()
        if name == "lm_head.weight":
            out[name] = t
        elif name.endswith(".mlp.router.weight"):
            out["model." + name[: -len("router.weight")] + "gate.weight"] = t
        elif name.endswith(_BIAS):
            out[_hf_bias_name(name)] = t
        elif name.endswith(".mlp.experts.w13"):
            base, ffn = "model." + name[: -len("w13")], t.shape[1] // 2
            if layout == "fused":
                out[base + "gate_up_proj"] = t
            else:
                for e in range(t.shape[0]):
                    out[f"{base}{e}.gate_proj.weight"] = t[e, :ffn]
                    out[f"{base}{e}.up_proj.weight"] = t[e, ffn:]
        elif name.endswith(".mlp.experts.w2"):
            base = "model." + name[: -len("w2")]
            if layout == "fused":
                out[base + "down_proj"] = t
            else:
                for e in range(t.shape[0]):
                    out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out["model." + rename(name)] = t
    return out


class _Collector:
    """Gathers checkpoint tensors for our parameters, recording every problem instead of stopping
    at the first, so one error lists them all. `sd` is a mapping of HF names to tensors; a lazy one
    (`checkpoint.SafetensorsTensors`) also offers ``shape(key)``, ``dtype(key)`` (from the file
    headers) and ``rows(key, lo, hi)``, so a rank reads only its experts' rows of a fused tensor.
    ``headers_only`` (lazy `sd`): nothing is read; meta tensors of the right shape stand in."""

    def __init__(self, sd: Mapping[str, torch.Tensor], headers_only: bool = False):
        self.sd, self.used = sd, set()
        self.lazy = hasattr(sd, "rows")
        self.headers_only = headers_only and self.lazy
        self.missing: list[str] = []
        self.bad_shape: list[str] = []
        self.bad_dtype: list[str] = []

    def take(self, key: str, shape, rows: Optional[tuple[int, int]] = None) -> torch.Tensor | None:
        """The tensor `key` (rows [lo, hi) of it when `rows` is given), checked to have `shape`
        (the full tensor's shape) and a floating-point dtype (all our parameters are float)."""
        if key not in self.sd:
            self.missing.append(key)
            return None
        self.used.add(key)
        t = None if self.lazy else self.sd[key]
        have = tuple(self.sd.shape(key)) if self.lazy else tuple(t.shape)
        if have != tuple(shape):
            self.bad_shape.append(f"{key}: checkpoint {list(have)} vs model {list(shape)}")
            return None
        dtype = self.sd.dtype(key) if self.lazy else t.dtype
        if not (dtype in FLOAT_DTYPES if self.lazy else dtype.is_floating_point):
            self.bad_dtype.append(f"{key}: {str(dtype).replace('torch.', '')}")
            return None
        if self.headers_only:
            return torch.empty(shape if rows is None else (rows[1] - rows[0], *shape[1:]), device="meta")
        if rows is None:
            return self.sd[key] if self.lazy else t
        return self.sd.rows(key, *rows) if self.lazy else t[rows[0]:rows[1]]

    def take_experts(self, base: str, suffixes: tuple, shape, experts: range) -> torch.Tensor | None:
        """Per-expert tensors `base{e}.{suffix}.weight` for e in `experts`, concatenated over
        suffixes, stacked over e."""
        if len(experts) * len(suffixes) > len(self.sd):  # cannot all be there: say so without a loop over them
            self.missing.append(f"{base}{{{experts.start}..{experts.stop - 1}}}.{{{','.join(suffixes)}}}.weight "
                                f"({len(experts)} experts; the checkpoint holds {len(self.sd)} tensors in all)")
            return None
        parts = [[self.take(f"{base}{e}.{s}.weight", shape) for s in suffixes] for e in experts]
        if any(p is None for row in parts for p in row):
            return None
        return torch.stack([torch.cat(row, dim=0) for row in parts])


def _expert_offsets(model) -> dict[str, int]:
    """Parameter-name prefix of every experts module -> global id of its first expert (an expert-
    parallel rank holds experts [offset, offset + E_local))."""
    return {f"{name}.": m.expert_offset for name, m in model.named_modules() if isinstance(m, GroupedExperts)}


def _collect(model, sd: Mapping[str, torch.Tensor], headers_only: bool = False,
             rename: Callable[[str], str] = _same) -> tuple[dict, _Collector]:
    """Our parameter name -> checkpoint tensor (in our layout), plus the bookkeeping. `model` may be
    one rank's shard (pipeline chunks, local experts): only its parameters are read."""
    col, found = _Collector(sd, headers_only), {}
    offsets = _expert_offsets(model)
    for name, param in _weights(model):
        shape = tuple(param.shape)
        if name.endswith(_BIAS):  # optional: a checkpoint without it (e.g. from the Hub) starts the bias at 0
            t = col.take(_hf_bias_name(name), shape) if _hf_bias_name(name) in sd else None
        elif name.endswith(".mlp.experts.w13") or name.endswith(".mlp.experts.w2"):
            is_w13 = name.endswith("w13")
            base = "model." + name[: -len("w13" if is_w13 else "w2")]
            fused = base + ("gate_up_proj" if is_w13 else "down_proj")
            lo = offsets.get(name[: name.rindex(".") + 1], 0)
            experts = range(lo, lo + shape[0])
            if fused in sd:
                num_global = getattr(model.cfg, "num_experts", shape[0])
                t = col.take(fused, (num_global, *shape[1:]), rows=(experts.start, experts.stop))
            else:
                per_expert = (shape[1] // 2, shape[2]) if is_w13 else shape[1:]
                t = col.take_experts(base, ("gate_proj", "up_proj") if is_w13 else ("down_proj",), per_expert,
                                     experts)
        elif name.endswith(".mlp.router.weight"):
            t = col.take("model." + name[: -len("router.weight")] + "gate.weight", shape)
        elif name == "lm_head.weight":
            t = col.take(name, shape)
        else:
            t = col.take("model." + rename(name), shape)
        if t is not None:
            found[name] = t
    embed = found.get("embed_tokens.weight")
    if model.cfg.tie_embeddings and "lm_head.weight" in sd:  # tied: a copy of the embedding may be stored
        col.used.add("lm_head.weight")
        if embed is not None and not col.headers_only:
            lm_head = sd["lm_head.weight"]
            if lm_head.shape != embed.shape or not torch.equal(lm_head, embed):
                col.bad_shape.append("lm_head.weight: differs from model.embed_tokens.weight, but the config ties "
                                     "them (tie_word_embeddings=True); use a config with tie_word_embeddings=False")
    return found, col


def _listed(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_LISTED])
    return shown + (f", ... ({len(keys) - _MAX_LISTED} more)" if len(keys) > _MAX_LISTED else "")


def from_hf_state_dict(model, sd: Mapping[str, torch.Tensor], shard: bool = False) -> None:
    """Load HF Qwen3-MoE tensors into `model` in place (strict). Experts may come per layer in the
    "checkpoint" (per-expert) or "fused" layout. Missing keys, unexpected keys or shape mismatches
    raise one ValueError listing them all, before any parameter is modified. Values are cast to the
    parameter dtype (e.g. a bf16 checkpoint into an fp32 model). ``shard=True``: `model` is one
    rank's part (pipeline chunks, local experts) and `sd` may hold the others' tensors too, so
    only missing and mismatched tensors are errors."""
    found = ours_from_hf_state_dict(model, sd, shard)
    params = dict(_weights(model))
    with torch.no_grad():
        for name, t in found.items():
            params[name].copy_(t)


def ours_from_hf_state_dict(model, sd: Mapping[str, torch.Tensor], shard: bool = False) -> dict[str, torch.Tensor]:
    """`model`'s parameter names -> the HF tensors in our layout (experts stacked), checked as
    strictly as `from_hf_state_dict` (one ValueError listing every problem); `model` is not touched."""
    return _checked(model, sd, shard, headers_only=False)


def check_hf_state_dict(model, sd: Mapping[str, torch.Tensor], shard: bool = False) -> None:
    """The checks of `from_hf_state_dict` (names, shapes, float dtypes) without reading a tensor when
    `sd` is lazy (`checkpoint.SafetensorsTensors`: shapes and dtypes come from the file headers), so
    `model` may be a meta-device model: a checkpoint is checked before its model is allocated."""
    _checked(model, sd, shard, headers_only=True)


def _checked(model, sd: Mapping[str, torch.Tensor], shard: bool, headers_only: bool) -> dict[str, torch.Tensor]:
    _check_no_shared_experts(model)
    return checked_tensors(model, sd, shard, headers_only)


def checked_tensors(model, sd: Mapping[str, torch.Tensor], shard: bool, headers_only: bool,
                    rename: Callable[[str], str] = _same, family: str = "Qwen3-MoE",
                    hf_class: str = HF_ARCHITECTURE) -> dict[str, torch.Tensor]:
    """`ours_from_hf_state_dict`'s checks and tensors for any family sharing this layout (`rename`
    as in `hf_tensors`); `family` and `hf_class` name it in the error."""
    found, col = _collect(model, sd, headers_only, rename)
    unexpected = [] if shard else sorted(set(sd) - col.used)
    if col.missing or unexpected or col.bad_shape or col.bad_dtype:
        problems = []
        if col.missing:
            problems.append(f"missing keys ({len(col.missing)}): {_listed(col.missing)}")
        if unexpected:
            problems.append(f"unexpected keys ({len(unexpected)}): {_listed(unexpected)}")
        if col.bad_shape:
            problems.append(f"mismatched tensors ({len(col.bad_shape)}): {_listed(col.bad_shape)}")
        if col.bad_dtype:
            problems.append(f"non-float tensors where the model has float weights ({len(col.bad_dtype)}): "
                            f"{_listed(col.bad_dtype)}")
        raise ValueError(f"HF {family} state dict does not match the model: " + "; ".join(problems)
                         + ". Build the model from the checkpoint's own config (ours_config_from_hf) and pass "
                           f"a {hf_class} state dict (keys start with 'model.' or 'lm_head.').")
    return found
