"""Hugging Face GPT-OSS <-> megatron-fp4: config fields and weight names (``GptOssForCausalLM``).

One name table, `EXPERT_TENSORS`, gives both directions; everything else is ``model.`` + our name
(``lm_head.weight`` as is). HF stores every expert tensor fused over experts, transposed to
[E, in, out], with gate and up *interleaved* (gate at even, up at odd columns):

    ours                                   HF
    layers.{i}.mlp.experts.w13 [E, 2F, H]  model.layers.{i}.mlp.experts.gate_up_proj [E, H, 2F]  (interleaved)
    layers.{i}.mlp.experts.b13 [E, 2F]     model.layers.{i}.mlp.experts.gate_up_proj_bias [E, 2F] (interleaved)
    layers.{i}.mlp.experts.w2  [E, H, F]   model.layers.{i}.mlp.experts.down_proj [E, F, H]
    layers.{i}.mlp.experts.b2  [E, H]      model.layers.{i}.mlp.experts.down_proj_bias [E, H]
    layers.{i}.mlp.router.{weight,bias}    model.layers.{i}.mlp.router.{weight,bias}
    layers.{i}.self_attn.sinks             model.layers.{i}.self_attn.sinks

Every conversion is a permutation, so ``from-hf`` then ``to-hf`` gives the same bits. OpenAI's
checkpoints store the two expert weights packed in MXFP4 (``*_blocks`` + ``*_scales``): they are
read by `mxfp4_experts` (an ep rank reads only its experts' rows) and written back with
``mxfp4_experts=True``.
"""
from __future__ import annotations

from typing import Callable, Mapping, NamedTuple

import torch

from megatron_fp4.config import ModelConfig
from megatron_fp4.integrations.hf import mxfp4_experts
from megatron_fp4.integrations.hf.config_fields import (bool_field, config_dict, float_field, int_field, rope_fields,
                                                        string_list)
from megatron_fp4.integrations.hf.qwen3_moe import _Collector, _expert_offsets, _listed

HF_MODEL_TYPE = "gpt_oss"
HF_ARCHITECTURE = "GptOssForCausalLM"

# GptOssConfig's defaults (transformers 5.10) for optional fields a config.json may omit.
_HF_DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 150000.0, "max_position_embeddings": 131072,
                "router_aux_loss_coef": 0.001, "tie_word_embeddings": False, "initializer_range": 0.02,
                "sliding_window": 128}
_YARN_DEFAULT = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def _interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Ours (gate block, then up block along `dim`) -> HF's g0, u0, g1, u1, ..."""
    gate, up = t.chunk(2, dim=dim)
    return torch.stack((gate, up), dim=dim + 1).flatten(dim, dim + 1)


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    idx = [slice(None)] * t.dim()
    idx[dim] = slice(0, None, 2)
    gate = t[tuple(idx)]
    idx[dim] = slice(1, None, 2)
    return torch.cat((gate, t[tuple(idx)]), dim=dim)


class ExpertTensor(NamedTuple):
    ours: str                                           # suffix of our parameter name
    hf: str                                             # suffix of the HF name
    to_hf: Callable[[torch.Tensor], torch.Tensor]       # our [E, ...] -> HF [E, ...]
    from_hf: Callable[[torch.Tensor], torch.Tensor]     # the inverse permutation


# The one name table of the expert tensors (both directions).
EXPERT_TENSORS = (
    ExpertTensor("w13", "gate_up_proj", lambda t: _interleave(t, 1).transpose(1, 2),
                 lambda t: _deinterleave(t.transpose(1, 2), 1)),
    ExpertTensor("b13", "gate_up_proj_bias", lambda t: _interleave(t, 1), lambda t: _deinterleave(t, 1)),
    ExpertTensor("w2", "down_proj", lambda t: t.transpose(1, 2), lambda t: t.transpose(1, 2)),
    ExpertTensor("b2", "down_proj_bias", lambda t: t, lambda t: t),
)
_BY_OURS = {e.ours: e for e in EXPERT_TENSORS}


def _expert_entry(name: str):
    """(HF base name, table row) of our expert parameter `name`, else None."""
    head, _, leaf = name.rpartition(".")
    if head.endswith(".mlp.experts") and leaf in _BY_OURS:
        return f"model.{head}.", _BY_OURS[leaf]
    return None


def hf_name(name: str) -> str:
    """The HF name of our parameter `name` (experts: the fused tensor's)."""
    entry = _expert_entry(name)
    if entry is not None:
        return entry[0] + entry[1].hf
    return name if name == "lm_head.weight" else "model." + name


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
def hf_config_from_ours(m: ModelConfig) -> dict:
    """The `transformers.GptOssConfig` fields (a config.json dict) of our GPT-OSS `ModelConfig`."""
    if m.family != HF_MODEL_TYPE:
        raise ValueError(f"model.family={m.family!r} cannot be written as GPT-OSS")
    rope = {"rope_theta": float(m.rope_theta), **(m.rope_scaling or {"rope_type": "default"})}
    return {
        "model_type": HF_MODEL_TYPE, "architectures": [HF_ARCHITECTURE], "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim, "intermediate_size": m.moe_ffn_hidden_size,
        "num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k, "hidden_act": "silu",
        "rms_norm_eps": float(m.norm_eps), "rope_theta": float(m.rope_theta), "rope_parameters": rope,
        "rope_scaling": m.rope_scaling, "max_position_embeddings": m.max_seq_len,
        "layer_types": list(m.layer_types) or ["full_attention"] * m.num_layers,
        "sliding_window": m.sliding_window or None, "tie_word_embeddings": bool(m.tie_embeddings),
        "attention_bias": True, "attention_dropout": 0.0, "swiglu_limit": 7.0,
        "router_aux_loss_coef": float(m.router_aux_loss_coef), "initializer_range": float(m.init_std),
    }


_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate")


def ours_config_from_hf(hf_cfg) -> ModelConfig:
    """Our GPT-OSS `ModelConfig` from a config.json dict (or a `GptOssConfig`); optional fields take
    GptOssConfig's defaults, features our layers do not implement raise ValueError naming the field."""
    d = config_dict(hf_cfg, "GPT-OSS", _REQUIRED)
    if d.get("attention_bias", True) is not True:
        raise ValueError("HF config attention_bias=false is not supported: GPT-OSS layers have q/k/v/o biases")
    limit = d.get("swiglu_limit", 7.0)
    if limit != 7.0:
        raise ValueError(f"HF config swiglu_limit={limit!r:.80}: only 7.0 (GptOssExperts' constant) is implemented")
    quant = d.get("quantization_config")
    if quant and not (isinstance(quant, Mapping) and quant.get("quant_method") in ("mxfp4", "megatron_fp4")):
        raise ValueError(f"HF config quantization_config={quant!r:.120}: only MXFP4-packed experts (quant_method "
                         "mxfp4) or full-precision weights are read")
    num_layers = int_field(d, "num_hidden_layers")
    layer_types = string_list(d, "layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                                    for i in range(num_layers)]
    if len(layer_types) != num_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"HF config layer_types={layer_types!r:.120}: must give full_attention or "
                         f"sliding_attention for each of the {num_layers} layers")
    num_experts = int_field(d, "num_local_experts", alias="num_experts")
    top_k = int_field(d, "num_experts_per_tok", alias="experts_per_token")
    if top_k > num_experts:
        raise ValueError(f"HF config num_experts_per_tok={top_k} must be <= num_local_experts={num_experts}")
    hidden, num_heads = int_field(d, "hidden_size"), int_field(d, "num_attention_heads")
    num_kv_heads = int_field(d, "num_key_value_heads", num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"HF config num_key_value_heads={num_kv_heads} must divide num_attention_heads={num_heads}")
    head_dim = int_field(d, "head_dim", max(hidden // num_heads, 1))
    if head_dim % 2:
        raise ValueError(f"HF config head_dim={head_dim} must be even (rotary embeddings rotate pairs)")
    theta, scaling = rope_fields(d, _HF_DEFAULTS["rope_theta"], "GPT-OSS", _YARN_KEYS, absent=_YARN_DEFAULT)
    sliding = "sliding_attention" in layer_types
    return ModelConfig(
        family=HF_MODEL_TYPE, vocab_size=int_field(d, "vocab_size"), hidden_size=hidden, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        max_seq_len=int_field(d, "max_position_embeddings", _HF_DEFAULTS["max_position_embeddings"]),
        rope_theta=theta, rope_scaling=scaling, layer_types=layer_types,
        sliding_window=int_field(d, "sliding_window", _HF_DEFAULTS["sliding_window"]) if sliding else 0,
        norm_eps=float_field(d, "rms_norm_eps", _HF_DEFAULTS["rms_norm_eps"], positive=True),
        num_experts=num_experts, top_k=top_k, moe_ffn_hidden_size=int_field(d, "intermediate_size"),
        norm_topk_prob=False, num_shared_experts=0, dense_layers=[],
        router_aux_loss_coef=float_field(d, "router_aux_loss_coef", _HF_DEFAULTS["router_aux_loss_coef"]),
        tie_embeddings=bool_field(d, "tie_word_embeddings", _HF_DEFAULTS["tie_word_embeddings"]),
        init_std=float_field(d, "initializer_range", _HF_DEFAULTS["initializer_range"]),
    )


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------
def to_hf_state_dict(model, layout: str = "checkpoint", mxfp4: bool = False) -> dict[str, torch.Tensor]:
    """HF GPT-OSS tensors of `model` (the one layout: fused experts; `layout` is accepted for the
    common signature). ``mxfp4``: the expert weights packed as ``*_blocks`` + ``*_scales``
    (`mxfp4_experts.pack`; refused unless they lie on the MXFP4 grid)."""
    if layout not in ("checkpoint", "fused"):
        raise ValueError(f"layout={layout!r}: must be 'checkpoint' or 'fused' (GPT-OSS has one layout)")
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        t, entry = param.detach(), _expert_entry(name)
        if entry is None:
            out[hf_name(name)] = t
            continue
        base, row = entry
        hf = row.to_hf(t)
        if mxfp4 and row.ours in ("w13", "w2"):  # packed along `in` as HF stores it: [E, out, in]
            blocks, scales = mxfp4_experts.pack(hf.transpose(1, 2), f"{base}{row.hf}")
            out[f"{base}{row.hf}_blocks"], out[f"{base}{row.hf}_scales"] = blocks, scales
        else:
            out[base + row.hf] = hf
    return out


def _collect(model, sd, headers_only: bool):
    col, found = _Collector(sd, headers_only), {}
    offsets = _expert_offsets(model)
    for name, param in model.named_parameters():
        shape, entry = tuple(param.shape), _expert_entry(name)
        if entry is None:
            t = col.take(hf_name(name), shape)
        else:
            base, row = entry
            lo = offsets.get(name[: name.rindex(".") + 1], 0)
            hf_shape = tuple(row.to_hf(torch.empty((model.cfg.num_experts, *shape[1:]), device="meta")).shape)
            key = base + row.hf
            if key not in sd and mxfp4_experts.is_packed(sd, key):  # OpenAI's MXFP4 experts [E, out, in]
                col.used.update((key + "_blocks", key + "_scales"))
                t = mxfp4_experts.read(sd, key, (hf_shape[0], hf_shape[2], hf_shape[1]), (lo, lo + shape[0]),
                                       headers_only=col.headers_only)
                t = None if t is None else t.transpose(1, 2)
            else:
                t = col.take(key, hf_shape, rows=(lo, lo + shape[0]))
            t = None if t is None else row.from_hf(t)
        if t is not None:
            found[name] = t
    if model.cfg.tie_embeddings and "lm_head.weight" in sd:  # tied: a copy of the embedding may be stored
        col.used.add("lm_head.weight")
        embed = found.get("embed_tokens.weight")
        if embed is not None and not col.headers_only and not torch.equal(sd["lm_head.weight"], embed):
            col.bad_shape.append("lm_head.weight: differs from model.embed_tokens.weight, but the config ties them "
                                 "(tie_word_embeddings=true); use a config with tie_word_embeddings=false")
    return found, col


def _checked(model, sd, shard: bool, headers_only: bool) -> dict[str, torch.Tensor]:
    found, col = _collect(model, sd, headers_only)
    unexpected = [] if shard else sorted(set(sd) - col.used)
    problems = [f"{what} ({len(keys)}): {_listed(keys)}" for what, keys in (
        ("missing keys", col.missing), ("unexpected keys", unexpected), ("mismatched tensors", col.bad_shape),
        ("non-float tensors where the model has float weights", col.bad_dtype)) if keys]
    if problems:
        raise ValueError("HF GPT-OSS state dict does not match the model: " + "; ".join(problems) + ". Build the "
                         "model from the checkpoint's own config (ours_config_from_hf) and pass a GptOssForCausalLM "
                         "state dict (keys start with 'model.' or 'lm_head.').")
    return found


def ours_from_hf_state_dict(model, sd: Mapping[str, torch.Tensor], shard: bool = False) -> dict[str, torch.Tensor]:
    """`model`'s parameter names -> the HF tensors in our layout, checked strictly (one ValueError
    listing every problem); ``shard``: `model` is one rank's part, other ranks' tensors are no error."""
    return _checked(model, sd, shard, headers_only=False)


def check_hf_state_dict(model, sd: Mapping[str, torch.Tensor], shard: bool = False) -> None:
    """The checks alone, on file headers when `sd` is lazy (nothing read, `model` may be meta)."""
    _checked(model, sd, shard, headers_only=True)


def from_hf_state_dict(model, sd: Mapping[str, torch.Tensor], shard: bool = False) -> None:
    """Load HF GPT-OSS tensors into `model` in place (strict, all checks before any write)."""
    found = ours_from_hf_state_dict(model, sd, shard)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in found.items():
            params[name].copy_(t)
