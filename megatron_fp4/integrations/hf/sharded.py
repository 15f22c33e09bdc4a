"""HF names (of the model's family) of one rank's shard (pipeline chunk, local experts), for publishing from a
sharded trainer: the names are global (a stage's layers keep their indices; a local expert e of an
expert-parallel rank is published as expert ``expert_offset + e``), so the shards of all ranks
together are exactly `to_hf_state_dict` of the single-process model."""
from __future__ import annotations

import torch

from megatron_fp4.integrations.hf.families import for_model, to_hf_state_dict
from megatron_fp4.model.experts import GroupedExperts


def local_hf_state_dict(model, layout: str = "checkpoint") -> dict[str, torch.Tensor]:
    out = to_hf_state_dict(model, layout)
    offsets = {f"model.{name}.": module.expert_offset for name, module in model.named_modules()
               if isinstance(module, GroupedExperts) and module.expert_offset}
    if not offsets:
        return out
    if for_model(model).HF_MODEL_TYPE != "qwen3_moe":  # GPT-OSS: experts are fused tensors, a rank holds rows
        raise ValueError(f"publishing the HF weights of an expert-parallel {model.cfg.family} shard is not supported "
                         "(its HF expert tensors are fused over experts, which this rank holds only rows of); "
                         "publish from parallel.ep=1")
    if layout == "fused":
        raise ValueError("layout='fused' publishes each layer's experts as one tensor, which an expert-parallel "
                         "rank holds only part of; use layout='checkpoint' (per-expert tensors)")
    renamed = {}
    for key, value in out.items():
        prefix = key[:key.index(".experts.") + len(".experts.")] if ".experts." in key else None
        if prefix in offsets:
            expert, rest = key[len(prefix):].split(".", 1)
            key = f"{prefix}{int(expert) + offsets[prefix]}.{rest}"
        renamed[key] = value
    return renamed
