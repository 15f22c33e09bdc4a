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

GPT-OSS (as Megatron-Core's GPT-OSS layers name them):

    layers.{i}.self_attn.{q,k,v}_proj.bias   ...self_attention.linear_qkv.bias     (interleaved like the weight)
    layers.{i}.self_attn.o_proj.bias         ...self_attention.linear_proj.bias
    layers.{i}.self_attn.sinks               ...self_attention.core_attention.softmax_offset  (softmax_type learnable)
    layers.{i}.mlp.router.bias               ...mlp.router.bias
    layers.{i}.mlp.experts.b13[e] / b2[e]    the experts' linear_fc1 / linear_fc2 .bias (sequential) or .bias{e} (te_grouped)
    (no q/k norms)

DeepSeek-V3 (MLASelfAttention; its TE spec fuses the latent norms into the up-projections):

    layers.{i}.self_attn.q_a_proj            ...self_attention.linear_q_down_proj.weight   (q_lora_rank > 0)
    layers.{i}.self_attn.q_a_layernorm       ...linear_q_up_proj.layer_norm_weight ('te') / q_layernorm.weight ('local')
    layers.{i}.self_attn.q_b_proj            ...linear_q_up_proj.weight
    layers.{i}.self_attn.q_proj              ...linear_q_proj.weight                        (q_lora_rank = 0)
    layers.{i}.self_attn.kv_a_proj_with_mqa  ...linear_kv_down_proj.weight
    layers.{i}.self_attn.kv_a_layernorm      ...linear_kv_up_proj.layer_norm_weight ('te') / kv_layernorm.weight ('local')
    layers.{i}.self_attn.kv_b_proj           ...linear_kv_up_proj.weight
    layers.{i}.input_layernorm               decoder.layers.{i}.input_layernorm.weight    (both specs)
    layers.{i}.mlp.router.expert_bias        ...mlp.router.expert_bias (HF's e_score_correction_bias)

The rows keep HF's order on both sides (per head [nope; rope] for q, [nope; v] for kv_b, the
rotary part interleaved: Megatron-Core's MLA de-interleaves it as our layers do).

One table (`name_map`: a list of `Entry`, each our keys, Megatron-Core's keys and the transform
each way) serves both `to_mcore_state_dict` and `from_mcore_state_dict`.

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
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from megatron_fp4.config.choices import check_choice

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


FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3")


def check_family(model_cfg) -> str:
    """The model family of `model_cfg`, one the Megatron-Core mapping covers (all three today)."""
    family = getattr(model_cfg, "family", "qwen3_moe")
    if family not in FAMILIES:
        raise ValueError(f"model.family={family!r}: the Megatron-Core name/config mapping covers {list(FAMILIES)} "
                         "(docs/families.md)")
    return family


def _check(spec: str, experts: str) -> None:
    check_choice("spec", spec, SPECS, "'te' = TE layer specs with the input norm fused into linear_qkv, "
                 "'local' = Megatron-Core's own modules")
    check_choice("experts", experts, EXPERT_LAYOUTS, "'sequential' = SequentialMLP local_experts.{e}, "
                 "'te_grouped' = TEGroupedMLP weight{e}")


def _expert_key(prefix: str, fc: str, e: int, experts: str, kind: str = "weight") -> str:
    if experts == "sequential":
        return f"{prefix}mlp.experts.local_experts.{e}.{fc}.{kind}"
    return f"{prefix}mlp.experts.{fc}.{kind}{e}"


def _input_norm_key(prefix: str, spec: str) -> str:
    return f"{prefix}self_attention.linear_qkv.layer_norm_weight" if spec == "te" else f"{prefix}input_layernorm.weight"


def _pre_mlp_norm_key(prefix: str, spec: str, is_moe: bool) -> str:
    return f"{prefix}mlp.linear_fc1.layer_norm_weight" if (spec == "te" and not is_moe) else f"{prefix}pre_mlp_layernorm.weight"


# -- the name map: one table, read in both directions ---------------------------------------------
def _same(tensors: list) -> list:
    return list(tensors)


@dataclass(frozen=True)
class Entry:
    """Our keys `ours` <-> Megatron-Core keys `mcore`; `to_mcore` / `to_ours` turn the tensors of
    one side (in key order) into the other's (renaming: the same tensors)."""
    ours: tuple
    mcore: tuple
    to_mcore: Callable = _same
    to_ours: Callable = _same


def _rename(ours: str, mcore: str) -> Entry:
    return Entry((ours,), (mcore,))


def _cat_halves(ours: tuple, mcore: str) -> Entry:
    """[gate; up] rows in one Megatron fc1 (its GLU chunks fc1's output in two, the first activated)."""
    return Entry(ours, (mcore,), lambda t: [torch.cat(t, dim=0)], lambda t: list(t[0].chunk(2, dim=0)))


def _stacked_experts(ours: str, mcore: tuple) -> Entry:
    """Our stacked [E, ...] tensor <-> one Megatron tensor per expert."""
    return Entry((ours,), mcore, lambda t: list(t[0].unbind(0)), lambda t: [torch.stack(t)])


def _qkv(ours: tuple, mcore: str, m) -> Entry:
    """q/k/v weights (or biases) <-> linear_qkv, rows grouped per query group (`interleave_qkv`)."""
    heads, groups, dim = m.num_heads, m.num_kv_heads, m.head_dim

    def to_mcore(t):
        bias = t[0].dim() == 1
        out = interleave_qkv(*(x[:, None] if bias else x for x in t), heads, groups, dim)
        return [out[:, 0] if bias else out]

    def to_ours(t):
        bias = t[0].dim() == 1
        parts = split_qkv(t[0][:, None] if bias else t[0], heads, groups, dim)
        return [x[:, 0] for x in parts] if bias else list(parts)

    return Entry(ours, (mcore,), to_mcore, to_ours)


def _mlp_entries(m, src: str, dst: str, spec: str, experts: str, is_moe: bool, family: str) -> list:
    out = [_rename(src + "post_attention_layernorm.weight", _pre_mlp_norm_key(dst, spec, is_moe))]
    if not is_moe:
        return out + [_cat_halves((src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"), dst + "mlp.linear_fc1.weight"),
                      _rename(src + "mlp.down_proj.weight", dst + "mlp.linear_fc2.weight")]
    out.append(_rename(src + "mlp.router.weight", dst + "mlp.router.weight"))
    if family == "gpt_oss":
        out.append(_rename(src + "mlp.router.bias", dst + "mlp.router.bias"))
    if family == "deepseek_v3":  # HF's e_score_correction_bias; Megatron-Core's router buffer of the same role
        out.append(_rename(src + "mlp.router.expert_bias", dst + "mlp.router.expert_bias"))
    kinds = [("w13", "linear_fc1", "weight"), ("w2", "linear_fc2", "weight")]
    if family == "gpt_oss":
        kinds += [("b13", "linear_fc1", "bias"), ("b2", "linear_fc2", "bias")]
    for ours, fc, kind in kinds:
        out.append(_stacked_experts(f"{src}mlp.experts.{ours}",
                                    tuple(_expert_key(dst, fc, e, experts, kind) for e in range(m.num_experts))))
    if m.num_shared_experts:
        s = src + "mlp.shared_expert."
        out += [_cat_halves((s + "gate_proj.weight", s + "up_proj.weight"), dst + "mlp.shared_experts.linear_fc1.weight"),
                _rename(s + "down_proj.weight", dst + "mlp.shared_experts.linear_fc2.weight")]
    return out


def _attention_entries(m, src: str, dst: str, spec: str, family: str) -> list:
    att, ours = f"{dst}self_attention.", f"{src}self_attn."
    if family == "deepseek_v3":  # MLASelfAttention; the TE spec fuses the latent norms into the up-projections
        def norm(name, up):
            return f"{att}{up}.layer_norm_weight" if spec == "te" else f"{att}{name}.weight"
        out = [_rename(src + "input_layernorm.weight", dst + "input_layernorm.weight")]
        if m.q_lora_rank:
            out += [_rename(ours + "q_a_proj.weight", att + "linear_q_down_proj.weight"),
                    _rename(ours + "q_a_layernorm.weight", norm("q_layernorm", "linear_q_up_proj")),
                    _rename(ours + "q_b_proj.weight", att + "linear_q_up_proj.weight")]
        else:
            out.append(_rename(ours + "q_proj.weight", att + "linear_q_proj.weight"))
        return out + [_rename(ours + "kv_a_proj_with_mqa.weight", att + "linear_kv_down_proj.weight"),
                      _rename(ours + "kv_a_layernorm.weight", norm("kv_layernorm", "linear_kv_up_proj")),
                      _rename(ours + "kv_b_proj.weight", att + "linear_kv_up_proj.weight"),
                      _rename(ours + "o_proj.weight", att + "linear_proj.weight")]
    out = [_rename(src + "input_layernorm.weight", _input_norm_key(dst, spec)),
           _qkv(tuple(f"{ours}{x}_proj.weight" for x in "qkv"), att + "linear_qkv.weight", m),
           _rename(ours + "o_proj.weight", att + "linear_proj.weight")]
    if family == "gpt_oss":  # biases; the sinks are Megatron-Core's learnable softmax offset
        return out + [_qkv(tuple(f"{ours}{x}_proj.bias" for x in "qkv"), att + "linear_qkv.bias", m),
                      _rename(ours + "o_proj.bias", att + "linear_proj.bias"),
                      _rename(ours + "sinks", att + "core_attention.softmax_offset")]
    return out + [_rename(ours + "q_norm.weight", att + "q_layernorm.weight"),
                  _rename(ours + "k_norm.weight", att + "k_layernorm.weight")]


def name_map(model_cfg, spec: str = "te", experts: str = "sequential") -> list:
    """Every `Entry` of the family's model: the one table `to_mcore_state_dict` and
    `from_mcore_state_dict` both read (the module docstring's table; tp = pp = ep = 1)."""
    family = check_family(model_cfg)
    _check(spec, experts)
    m = model_cfg
    out = [_rename("embed_tokens.weight", "embedding.word_embeddings.weight")]
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"decoder.layers.{i}."
        out += _attention_entries(m, src, dst, spec, family)
        out += _mlp_entries(m, src, dst, spec, experts, i not in m.dense_layers, family)
    out.append(_rename("norm.weight", "decoder.final_layernorm.weight"))
    if not m.tie_embeddings:
        out.append(_rename("lm_head.weight", "output_layer.weight"))
    return out


def _convert(state_dict: Mapping, entries: list, to_mcore: bool, lacks: str, stray: str) -> dict:
    sd = dict(state_dict)
    out: dict[str, torch.Tensor] = {}
    for entry in entries:
        src, dst, fn = (entry.ours, entry.mcore, entry.to_mcore) if to_mcore else (entry.mcore, entry.ours, entry.to_ours)
        missing = [k for k in src if k not in sd]
        if missing:
            raise ValueError(lacks.format(key=missing[0]))
        out.update(zip(dst, fn([sd.pop(k) for k in src])))
    if sd:
        raise ValueError(stray.format(keys=sorted(sd)[:20]))
    return out


def to_mcore_state_dict(state_dict: Mapping[str, torch.Tensor], model_cfg, spec: str = "te",
                        experts: str = "sequential") -> dict[str, torch.Tensor]:
    """Megatron-Core names for our `state_dict` (as from `MoETransformer.state_dict()`).
    Concatenated tensors (qkv, fc1 of dense/shared MLPs) are new; the rest are the same tensors."""
    return _convert(state_dict, name_map(model_cfg, spec, experts), True,
                    "our state dict lacks {key!r} (does model_cfg match the model?)",
                    "our state dict has entries with no Megatron-Core name: {keys}")


def from_mcore_state_dict(mcore_sd: Mapping[str, torch.Tensor], model_cfg, spec: str = "te",
                          experts: str = "sequential") -> dict[str, torch.Tensor]:
    """Our state dict from Megatron-Core names (strict: a missing or unexpected weight raises;
    `_extra_state` entries are skipped). Experts are stacked into w13/w2 (new tensors)."""
    entries = name_map(model_cfg, spec, experts)
    sd = {k: v for k, v in mcore_sd.items() if not k.endswith("._extra_state")}
    return _convert(sd, entries, False,
                    "Megatron-Core state dict lacks {key!r} (spec=" + repr(spec) + ", experts=" + repr(experts)
                    + "; check they match how the checkpoint was written)",
                    "Megatron-Core state dict has entries this config does not explain: {keys}")


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")


def mcore_layer_index(name: str):
    """Layer index of a Megatron-Core parameter name, or None outside the decoder layers."""
    match = _LAYER_RE.match(name)
    return int(match.group(1)) if match else None


__all__ = ["SPECS", "EXPERT_LAYOUTS", "FAMILIES", "Entry", "name_map", "interleave_qkv", "split_qkv",
           "to_mcore_state_dict", "from_mcore_state_dict", "mcore_layer_index"]
