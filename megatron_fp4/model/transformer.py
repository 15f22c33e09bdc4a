"""The decoder of every model family: embedding → N × decoder layer → norm → LM head.

The layers are the family's (`model.registry`, chosen by ``model.family``: Qwen3-MoE's in
`model/decoder.py`, GPT-OSS's in `model/gpt_oss.py`); embedding, norm and head are shared.

The forward is three pieces, `embed` / `run_layers` / `head`, and `forward` is nothing but them in
a row: `parallel/pipeline.py` runs the same pieces on its stages (the first stage embeds, every
stage runs its own layers, the last applies the head), so every layout shares this one forward and
the model knows nothing about pipelines.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_fp4.fp4 import MoEResQLinear, Numerics, apply_numerics, invariant, name_quant_sites
from megatron_fp4.model import recompute
from megatron_fp4.model.decoder import DecoderLayer  # noqa: F401 (its old home: importers keep working)
from megatron_fp4.model.layers import Attention, Embedding, KVCache, LayerCache, RMSNorm, SwiGLU, upcast  # noqa: F401
from megatron_fp4.model.moe import GroupedExperts, MoELayer
from megatron_fp4.model.registry import get_family


# model.recompute_modules names -> (module class, indices of its side-effect output arguments)
SELECTIVE_TARGETS = {"attention": (Attention, ()), "experts": (GroupedExperts, ()), "mlp": (SwiGLU, ()),
                     "moe": (MoELayer, (1,))}


@dataclass
class ModelOutput:
    logits: torch.Tensor
    routing: Optional[list] = None  # per layer: expert indices [B, T, k] (None for dense layers)


class MoETransformer(nn.Module):
    """`numerics`: the `fp4.Numerics` every layer computes with (default: one of its own, the standard
    kernels on `fp4_cfg.triton`'s backend); the trainer passes its own (`specs.numerics_from_config`)."""

    def __init__(self, cfg, fp4_cfg, numerics: Optional[Numerics] = None):
        super().__init__()
        self.cfg, self.fp4_cfg = cfg, fp4_cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.fuse_weight_grad = not cfg.tie_embeddings  # tied: the LM head's GEMM claims the buffer
        layer = get_family(getattr(cfg, "family", "qwen3_moe")).decoder_layer
        self.layers = nn.ModuleList([layer(cfg, fp4_cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        name_quant_sites(self)  # global names for FP4 SR streams and errors, kept by pp/ep splitting
        own = Numerics(triton=getattr(fp4_cfg, "triton", "auto")) if numerics is None else numerics
        self.numerics = apply_numerics(self, own)

    # -- the forward's pieces (the pipeline's stages call them too) -----------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)

    def run_layers(self, h: torch.Tensor, positions: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                   layers: Optional[range] = None, kv_cache: Optional[KVCache] = None,
                   routing_out: Optional[list] = None, routing_in: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Decoder layers `layers` (default: all) in order, on hidden states h [B, T, hidden].
        `routing_in` [B, T, num_moe_layers, k]: router replay, the expert ids each MoE layer uses at
        each position (a position's own routes, not shifted like log-probs); -1 rows route live."""
        layers = range(len(self.layers)) if layers is None else layers
        slots = self.moe_slots() if routing_in is not None else {}
        if routing_in is not None and tuple(routing_in.shape) != (*h.shape[:2], len(slots), self.cfg.top_k):
            raise ValueError(f"routing_in of shape {tuple(routing_in.shape)} for hidden states {tuple(h.shape)}: "
                             f"expected [B, T, num_moe_layers={len(slots)}, top_k={self.cfg.top_k}]")

        def replay(i: int) -> Optional[torch.Tensor]:
            return routing_in[:, :, slots[i]] if i in slots else None

        mode = getattr(self.cfg, "recompute", "none")
        if mode == "full" and recompute.active(mode, kv_cache):  # model/recompute.py
            return recompute.run_blocks(lambda i, h, *rest: self.layers[i](h, *rest, replay(i)), layers, h,
                                        self.cfg.recompute_num_layers, lambda i: self.layers[i],
                                        (positions, attention_mask, None), routing_out)
        for i in layers:
            cache = kv_cache.layers[i] if kv_cache is not None else None
            with recompute.selective(self.layers[i], self.cfg.recompute_modules if mode == "selective" else (),
                                     SELECTIVE_TARGETS):
                h = self.layers[i](h, positions, attention_mask, cache, routing_out, replay(i))
        return h

    def moe_slots(self) -> dict:
        """Global layer index -> its index among the MoE layers (routing tensors' layer axis)."""
        moe = [i for i in range(self.cfg.num_layers) if i not in self.cfg.dense_layers]
        return {i: n for n, i in enumerate(moe)}

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head (the embedding matrix when the embeddings are tied)."""
        h = self.norm(h)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return invariant.linear(h, weight, None, self.numerics)

    @staticmethod
    def default_positions(tokens: torch.Tensor, past: int = 0) -> torch.Tensor:
        B, T = tokens.shape[:2]
        return torch.arange(past, past + T, device=tokens.device).expand(B, T)

    # -- full forward ---------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, kv_cache: Optional[KVCache] = None,
                return_routing: bool = False, routing_in: Optional[torch.Tensor] = None) -> ModelOutput:
        """tokens [B, T]. positions default to past_len + arange(T). attention_mask [B, T_total]
        marks real tokens (for left-padded batched generation); kv_cache is extended in place.
        routing_in: replayed routes (`run_layers`)."""
        if positions is None:
            positions = self.default_positions(tokens, kv_cache.length if kv_cache is not None else 0)
        routing = [] if return_routing else None
        h = self.run_layers(self.embed(tokens), positions, attention_mask, kv_cache=kv_cache, routing_out=routing,
                             routing_in=routing_in)
        return ModelOutput(self.head(h), routing)

    # -- FP4 and MoE controls -------------------------------------------------------------------
    def fp4_modules(self):
        """Every module whose recipe the FP4 config controls (scope-dependent)."""
        for m in self.modules():
            if isinstance(m, (MoEResQLinear, GroupedExperts)) and (self.fp4_cfg.scope != "none"):
                yield m

    def set_fp4_mode(self, mode: str) -> None:
        """Switch every FP4 linear to `mode` (bf16 | fp4 | fp4_resq): train vs rollout forward."""
        for m in self.fp4_modules():
            m.recipe = m.recipe.with_mode(mode)

    @property
    def fp4_mode(self) -> Optional[str]:
        modes = {m.recipe.mode for m in self.fp4_modules()}
        assert len(modes) <= 1, modes
        return modes.pop() if modes else None

    def moe_layers(self):
        return [layer.mlp for layer in self.layers if layer.is_moe]

    def set_aux_loss_scale(self, scale: float) -> None:
        for moe in self.moe_layers():
            moe.aux_loss_scale = scale

    def set_record_stats(self, on: bool) -> None:
        for moe in self.moe_layers():
            moe.record_stats = on
            moe.stats.clear()


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in fp32 (fp64 for an fp64 model) over labels != -100."""
    return F.cross_entropy(upcast(logits).reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def param_generator(seed: int, name: str, expert: Optional[int] = None) -> torch.Generator:
    """The CPU generator of one parameter (or one expert's slice of a stacked expert weight), seeded
    from (seed, global parameter name, global expert index) alone: a shard draws the same bits
    whichever rank builds it and whatever else that rank holds (sha256, not Python's salted hash)."""
    key = f"{seed}/{name}" if expert is None else f"{seed}/{name}/{expert}"
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1)


def init_weights(model: MoETransformer, seed: int) -> None:
    """Deterministic init of whatever part of the model this process holds (a full model, pipeline
    chunks, local experts): N(0, std), output projections (o_proj, down_proj, experts' w2) scaled
    by 1/sqrt(2·num_layers) as in Megatron, norms 1. Every parameter, and every expert of a
    stacked expert weight (global id ``expert_offset + e``), draws from its own `param_generator`,
    so each rank's shard equals the same slice of the single-process model bit for bit."""
    cfg = model.cfg
    std, out_std = cfg.init_std, cfg.init_std / (2 * cfg.num_layers) ** 0.5
    offsets = {f"{name}.": m.expert_offset for name, m in model.named_modules()
               if isinstance(m, GroupedExperts)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
                continue
            scale = out_std if name.endswith(("o_proj.weight", "down_proj.weight", ".experts.w2")) else std
            prefix = name[:name.rindex(".") + 1]
            if prefix in offsets:  # stacked experts [E_local, ...]: one stream per global expert
                for e in range(p.shape[0]):
                    g = param_generator(seed, name, offsets[prefix] + e)
                    p[e].copy_(torch.randn(p.shape[1:], generator=g, device="cpu") * scale)
            else:
                p.copy_(torch.randn(p.shape, generator=param_generator(seed, name), device="cpu") * scale)


def materialize(model: nn.Module, device, seed: int) -> nn.Module:
    """Give a model built on ``torch.device("meta")`` (and cut to what this process holds) real
    storage on `device` and `init_weights` it: only the parameters still in the model are ever
    allocated. Parameters are replaced by new ones that keep their Python attributes (e.g. the
    ``is_expert`` marks expert parallelism set)."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is None:
                continue
            if id(p) not in new:
                q = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
                q.__dict__.update(p.__dict__)
                new[id(p)] = q
            module._parameters[key] = new[id(p)]
        for key, b in module._buffers.items():
            if b is not None and b.is_meta and key in getattr(module, "zero_buffers", ()):
                b = module._buffers[key] = torch.zeros(b.shape, dtype=b.dtype, device=device)
            assert b is None or not b.is_meta, f"buffer {key} would be left uninitialised"
    init_weights(model, seed)
    return model


def build_model(cfg, seed: Optional[int] = None, device=None) -> MoETransformer:
    """Build and initialise the model of `cfg` (a full `Config`) in fp32 on `device` (default: torch's
    default device, CPU; under ``with torch.device("meta")`` shapes only, nothing initialised).
    Constructed on the meta device, then materialised: the same bits as any sharded build."""
    device = torch.device(device) if device is not None else torch.get_default_device()
    with torch.device("meta"):
        model = MoETransformer(cfg.model, cfg.fp4)
    return model if device.type == "meta" else materialize(model, device, cfg.schedule.seed if seed is None else seed)
