"""The weights a vLLM Qwen3-MoE serves, read back from its parameters under HF names (fused q/k/v,
gate/up and expert tensors split back; vLLM's padded vocabulary rows cut), and their SHA-256 digests
(the format `rl.rollouts.worker.weight_digests` gives for the trainer), so a trainer can compare what
vLLM serves bit for bit. Plain torch: no vllm import."""
from __future__ import annotations

import hashlib

import torch


def hf_tensors_of(model, hf_cfg: dict) -> dict:
    """{HF Qwen3-MoE name: tensor} of a vLLM Qwen3-MoE model's parameters (views, no copies)."""
    hd = hf_cfg["head_dim"]
    q, kv = hf_cfg["num_attention_heads"] * hd, hf_cfg["num_key_value_heads"] * hd
    out = {}
    for name, p in model.named_parameters():
        base = name.rsplit(".", 1)[0]
        if name.endswith("self_attn.qkv_proj.weight"):
            for part, t in zip("qkv", p.detach().split([q, kv, kv])):
                out[base.replace("qkv_proj", f"{part}_proj") + ".weight"] = t
        elif name.endswith("mlp.gate_up_proj.weight"):
            gate, up = p.detach().chunk(2)
            out[base.replace("gate_up_proj", "gate_proj") + ".weight"] = gate
            out[base.replace("gate_up_proj", "up_proj") + ".weight"] = up
        elif name.endswith("w13_weight") or name.endswith("w2_weight"):
            prefix = name[:name.index("mlp.experts.") + len("mlp.experts.")]
            for e, w in enumerate(p.detach()):
                if name.endswith("w13_weight"):
                    gate, up = w.chunk(2)
                    out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate, up
                else:
                    out[f"{prefix}{e}.down_proj.weight"] = w
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = p.detach()[:hf_cfg["vocab_size"]]  # vLLM pads the vocabulary rows (to 64)
        else:
            out[name] = p.detach()
    return out


def digests_of(named: dict) -> dict:
    """SHA-256 of each tensor's bytes (the format `rl.rollouts.worker.weight_digests` gives)."""
    return {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()
            for n, t in named.items()}
