"""Our state dict <-> Megatron-Core GPTModel (MoE) state-dict names.

    ours                                     Megatron-Core (tp = pp = ep = 1, global expert ids)
    embed_tokens.weight                      embedding.word_embeddings.weight
    layers.{i}.input_layernorm.weight        decoder.layers.{i}.input_layernorm.weight                  (spec 'local')
                                             decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight (spec 'te')
    layers.{i}.self_attn.{q,k,v}_proj        decoder.layers.{i}.self_attention.linear_qkv.weight  (interleaved, below)
    layers.{i}.self_attn.o_proj              decoder.layers.{i}.self_attention.linear_proj.weight
    layers.{i}.self_attn.{q,k}_norm          decoder.layers.{i}.self_attention.{q,k}_layernorm.weight
    layers.{i}.post_attention_layernorm      decoder.layers.{i}.pre_mlp_layernorm.weight   (MoE layers; and dense, 'local')
                                             decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight   (dense layers, 'te')
    layers.{i}.mlp.router.weight             decoder.layers.{i}.mlp.router.weight
    layers.{i}.mlp.experts.w13[e]            experts 'sequential': mlp.experts.local_experts.{e}.linear_fc1.weight
                                             experts 'te_grouped': mlp.experts.linear_fc1.weight{e}
    layers.{i}.mlp.experts.w2[e]             ... linear_fc2 likewise
    layers.{i}.mlp.shared_expert.*           mlp.shared_experts.linear_fc1.weight = [gate; up], linear_fc2.weight = down
    layers.{i}.mlp.{gate,up,down}_proj       mlp.linear_fc1.weight = [gate; up], mlp.linear_fc2.weight  (dense layers)
    norm.weight                              decoder.final_layernorm.weight
    lm_head.weight                           output_layer.weight (absent when embeddings are tied)

fc1 is gate rows then up rows: Megatron's gated MLP does ``chunk(fc1(x), 2)`` and activates the
first half, the same order as our w13.

linear_qkv (``SelfAttention.get_query_key_value_tensors``): rows are grouped per query group g
(= KV head g): ``[q heads g·r … g·r+r−1 (r·D rows), k head g (D rows), v head g (D rows)]`` for
g = 0 … G−1, with r = num_heads / num_kv_heads. Query head h uses KV head h // r in both models
(our `repeat_interleave`), so the grouping is consistent.

`_extra_state` entries (TE/FP8 metadata, None in the local spec) carry no weights: they are not
written and are ignored on read. The mapping is pure renaming, slicing and concatenation: a
round trip returns the same bits.
"""
from __future__ import annotations

import re
from typing import Mapping

import torch

SPECS = ("local", "te")
EXPERT_LAYOUTS = ("sequential", "te_grouped")


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> torch.Tensor:
    """q [heads·D, H], k/v [kv_heads·D, H] -> Megatron's linear_qkv weight [(heads+2·kv_heads)·D, H]."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}")
    r, hidden = num_heads // num_kv_heads, q.shape[-1]
    for name, t, rows in (("q", q, num_heads * head_dim), ("k", k, num_kv_heads * head_dim),
                          ("v", v, num_kv_heads * head_dim)):
        if tuple(t.shape) != (rows, hidden):
            raise ValueError(f"{name} weight has shape {tuple(t.shape)}, expected {(rows, hidden)}")
    groups = torch.cat([q.reshape(num_kv_heads, r * head_dim, hidden), k.reshape(num_kv_heads, head_dim, hidden),
                        v.reshape(num_kv_heads, head_dim, hidden)], dim=1)
    return groups.reshape(-1, hidden)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """Inverse of `interleave_qkv`: (q, k, v) weights."""
    r, hidden = num_heads // num_kv_heads, qkv.shape[-1]
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.shape[0] != rows:
        raise ValueError(f"linear_qkv weight has {qkv.shape[0]} rows, expected (heads + 2·kv_heads)·head_dim = {rows}")
    q, k, v = qkv.reshape(num_kv_heads, (r + 2) * head_dim, hidden).split([r * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def check_family(model_cfg) -> None:
    """The Megatron-Core mapping is Qwen3-MoE's: another family's weights are refused, not renamed wrongly."""
    family = getattr(model_cfg, "family", "qwen3_moe")
    if family != "qwen3_moe":
        raise ValueError(f"model.family={family!r}: the Megatron-Core name/config mapping covers qwen3_moe only "
                         "(docs/families.md); convert through Hugging Face (tools/convert_checkpoint.py to-hf)")


def _check(spec: str, experts: str) -> None:
    if spec not in SPECS:
        raise ValueError(f"spec={spec!r}: must be one of {SPECS} ('te' = TE layer specs with the input norm fused "
                         f"into linear_qkv, 'local' = Megatron-Core's own modules)")
    if experts not in EXPERT_LAYOUTS:
        raise ValueError(f"experts={experts!r}: must be one of {EXPERT_LAYOUTS} ('sequential' = SequentialMLP "
                         f"local_experts.{{e}}, 'te_grouped' = TEGroupedMLP weight{{e}})")


def _expert_key(prefix: str, fc: str, e: int, experts: str) -> str:
    if experts == "sequential":
        return f"{prefix}mlp.experts.local_experts.{e}.{fc}.weight"
    return f"{prefix}mlp.experts.{fc}.weight{e}"


def _input_norm_key(prefix: str, spec: str) -> str:
    return f"{prefix}self_attention.linear_qkv.layer_norm_weight" if spec == "te" else f"{prefix}input_layernorm.weight"


def _pre_mlp_norm_key(prefix: str, spec: str, is_moe: bool) -> str:
    return f"{prefix}mlp.linear_fc1.layer_norm_weight" if (spec == "te" and not is_moe) else f"{prefix}pre_mlp_layernorm.weight"


def to_mcore_state_dict(state_dict: Mapping[str, torch.Tensor], model_cfg, spec: str = "te",
                        experts: str = "sequential") -> dict[str, torch.Tensor]:
    """Megatron-Core names for our `state_dict` (as from `MoETransformer.state_dict()`).
    Concatenated tensors (qkv, fc1 of dense/shared MLPs) are new; the rest are the same tensors."""
    check_family(model_cfg)
    _check(spec, experts)
    m = model_cfg
    sd = dict(state_dict)
    out: dict[str, torch.Tensor] = {}

    def take(key):
        if key not in sd:
            raise ValueError(f"our state dict lacks {key!r} (does model_cfg match the model?)")
        return sd.pop(key)

    out["embedding.word_embeddings.weight"] = take("embed_tokens.weight")
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"decoder.layers.{i}."
        is_moe = i not in m.dense_layers
        att = f"{dst}self_attention."
        out[_input_norm_key(dst, spec)] = take(src + "input_layernorm.weight")
        out[att + "linear_qkv.weight"] = interleave_qkv(
            take(src + "self_attn.q_proj.weight"), take(src + "self_attn.k_proj.weight"),
            take(src + "self_attn.v_proj.weight"), m.num_heads, m.num_kv_heads, m.head_dim)
        out[att + "linear_proj.weight"] = take(src + "self_attn.o_proj.weight")
        out[att + "q_layernorm.weight"] = take(src + "self_attn.q_norm.weight")
        out[att + "k_layernorm.weight"] = take(src + "self_attn.k_norm.weight")
        out[_pre_mlp_norm_key(dst, spec, is_moe)] = take(src + "post_attention_layernorm.weight")
        if is_moe:
            out[dst + "mlp.router.weight"] = take(src + "mlp.router.weight")
            w13, w2 = take(src + "mlp.experts.w13"), take(src + "mlp.experts.w2")
            for e in range(w13.shape[0]):
                out[_expert_key(dst, "linear_fc1", e, experts)] = w13[e]
                out[_expert_key(dst, "linear_fc2", e, experts)] = w2[e]
            if m.num_shared_experts:
                s = src + "mlp.shared_expert."
                out[dst + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
                    [take(s + "gate_proj.weight"), take(s + "up_proj.weight")], dim=0)
                out[dst + "mlp.shared_experts.linear_fc2.weight"] = take(s + "down_proj.weight")
        else:
            out[dst + "mlp.linear_fc1.weight"] = torch.cat(
                [take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")], dim=0)
            out[dst + "mlp.linear_fc2.weight"] = take(src + "mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = take("norm.weight")
    if not m.tie_embeddings:
        out["output_layer.weight"] = take("lm_head.weight")
    if sd:
        raise ValueError(f"our state dict has entries with no Megatron-Core name: {sorted(sd)[:20]}")
    return out


def from_mcore_state_dict(mcore_sd: Mapping[str, torch.Tensor], model_cfg, spec: str = "te",
                          experts: str = "sequential") -> dict[str, torch.Tensor]:
    """Our state dict from Megatron-Core names (strict: a missing or unexpected weight raises;
    `_extra_state` entries are skipped). Experts are stacked into w13/w2 (new tensors)."""
    check_family(model_cfg)
    _check(spec, experts)
    m = model_cfg
    sd = {k: v for k, v in mcore_sd.items() if not k.endswith("._extra_state")}
    out: dict[str, torch.Tensor] = {}

    def take(key):
        if key not in sd:
            raise ValueError(f"Megatron-Core state dict lacks {key!r} (spec={spec!r}, experts={experts!r}; "
                             f"check they match how the checkpoint was written)")
        return sd.pop(key)

    out["embed_tokens.weight"] = take("embedding.word_embeddings.weight")
    for i in range(m.num_layers):
        src, dst = f"decoder.layers.{i}.", f"layers.{i}."
        is_moe = i not in m.dense_layers
        att = f"{src}self_attention."
        out[dst + "input_layernorm.weight"] = take(_input_norm_key(src, spec))
        q, k, v = split_qkv(take(att + "linear_qkv.weight"), m.num_heads, m.num_kv_heads, m.head_dim)
        out[dst + "self_attn.q_proj.weight"], out[dst + "self_attn.k_proj.weight"] = q, k
        out[dst + "self_attn.v_proj.weight"] = v
        out[dst + "self_attn.o_proj.weight"] = take(att + "linear_proj.weight")
        out[dst + "self_attn.q_norm.weight"] = take(att + "q_layernorm.weight")
        out[dst + "self_attn.k_norm.weight"] = take(att + "k_layernorm.weight")
        out[dst + "post_attention_layernorm.weight"] = take(_pre_mlp_norm_key(src, spec, is_moe))
        if is_moe:
            out[dst + "mlp.router.weight"] = take(src + "mlp.router.weight")
            out[dst + "mlp.experts.w13"] = torch.stack(
                [take(_expert_key(src, "linear_fc1", e, experts)) for e in range(m.num_experts)])
            out[dst + "mlp.experts.w2"] = torch.stack(
                [take(_expert_key(src, "linear_fc2", e, experts)) for e in range(m.num_experts)])
            if m.num_shared_experts:
                gate, up = take(src + "mlp.shared_experts.linear_fc1.weight").chunk(2, dim=0)
                out[dst + "mlp.shared_expert.gate_proj.weight"], out[dst + "mlp.shared_expert.up_proj.weight"] = gate, up
                out[dst + "mlp.shared_expert.down_proj.weight"] = take(src + "mlp.shared_experts.linear_fc2.weight")
        else:
            gate, up = take(src + "mlp.linear_fc1.weight").chunk(2, dim=0)
            out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
            out[dst + "mlp.down_proj.weight"] = take(src + "mlp.linear_fc2.weight")
    out["norm.weight"] = take("decoder.final_layernorm.weight")
    if not m.tie_embeddings:
        out["lm_head.weight"] = take("output_layer.weight")
    if sd:
        raise ValueError(f"Megatron-Core state dict has entries this config does not explain: {sorted(sd)[:20]}")
    return out


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")


def mcore_layer_index(name: str):
    """Layer index of a Megatron-Core parameter name, or None outside the decoder layers."""
    match = _LAYER_RE.match(name)
    return int(match.group(1)) if match else None


__all__ = ["SPECS", "EXPERT_LAYOUTS", "interleave_qkv", "split_qkv", "to_mcore_state_dict", "from_mcore_state_dict",
           "mcore_layer_index"]
