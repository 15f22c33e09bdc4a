"""The saved-activation terms of the memory planner (`training/memory_plan.py`, docs/memory.md
"Planning"): the bytes autograd saves for one micro-batch of a chunk, term by term from the forward
(layers.py, moe.py, moeresq.py, each family's attention; at the ``batch`` numerics level the block
attention, the tiled GEMMs' padded rows and the level's kernels), under tensor and context parallel
and for packed rows. Each term is checked against ``saved_tensors_hooks`` in
tests/unit/test_memory_plan*.py and tests/unit/test_cp_memory_plan*.py.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron_fp4.config import Config
from megatron_fp4.fp4.row_calls import MIN_COLUMNS, row_plan
from megatron_fp4.model import MoETransformer
from megatron_fp4.model.layers import wide_dtype
from megatron_fp4.model.moe import GroupedExperts

_INDEX_BYTES = 8  # int64 indices (top-k ids, permutations)


def param_dtype(cfg: Config) -> torch.dtype:
    """The dtype of the trainer's parameters (`Trainer._build_model`): bf16 only on CPU (CUDA autocasts)."""
    if cfg.dtype == "fp64":
        return torch.float64
    if cfg.dtype == "bf16" and cfg.device == "cpu":
        return torch.bfloat16
    return torch.float32


def activation_dtype(cfg: Config) -> torch.dtype:
    """The activations' dtype: the params', or bf16 under CUDA autocast (norms and router stay wide:
    the ``w`` terms)."""
    return torch.bfloat16 if cfg.dtype == "bf16" else param_dtype(cfg)


def _tp_layout(cfg: Config) -> tuple:
    """(tp, rows of the norms/residuals, rows each MoE layer routes) per micro-batch token: sequence
    parallel cuts the norms' rows 1/tp; ``moe_tp_tokens=local`` routes 1/tp of the tokens."""
    p = cfg.parallel
    if p.tp == 1:
        return 1, 1, 1
    return p.tp, p.tp if p.sequence_parallel else 1, p.tp if p.moe_tp_tokens == "local" else 1


def _norm_bytes(rows: int, dim: int, a: int, w: int) -> int:
    """RMSNorm of `rows` × `dim` (layers.py): its upcast input, ``x·rsqrt`` (saved by the gain's
    product, in the activations' dtype) and the per-row rsqrt."""
    return rows * dim * (w + a) + rows * w


def _input_linears(m) -> int:
    """The linears reading the attention's input: q, k, v (GQA, GPT-OSS); q_a (or q) and kv_a (MLA)."""
    return 2 if getattr(m, "family", "qwen3_moe") == "deepseek_v3" else 3


def block_attention_bytes(groups: int, rep: int, seq: int, dv: int, a: int) -> int:
    """Bytes `tiled.block_attention` (the ``batch`` numerics level's attention, the trainer's
    default) saves for autograd beyond its q, k and v on `groups` = batch × kv heads of `rep` query
    heads each, `seq` tokens, value dim `dv`, in an `a`-byte dtype: its output and each query row's
    log-sum-exp (float32, or float64 for float64 activations) — O(seq), the flash-style backward
    recomputes the scores (`fp4/block_attention_grad.py`). The callers count q, k and v, which it
    saves as they are (tests/unit/test_memory_plan_families_activations.py checks it against the
    saved tensors)."""
    return groups * rep * seq * (dv * a + max(a, 4))


def row_invariant(cfg: Config) -> bool:
    """Whether the trainer's layers run a row-invariant level (``batch`` or ``exact``; never for
    float64 activations, `invariant.enabled`): its row-local norms, softmax and sigmoid formulas."""
    return cfg.numerics.invariance in ("batch", "exact") and activation_dtype(cfg) != torch.float64


def gemms_are_tiled(cfg: Config) -> bool:
    """Whether the trainer's GEMMs run over fixed row tiles (`tiled.tiled_mm`: the ``batch`` level)."""
    return cfg.numerics.invariance == "batch" and activation_dtype(cfg) != torch.float64


def quantized_linears(cfg: Config, attention: bool = False) -> bool:
    """Whether the MLP's (`attention`: the attention's) linears are MoEResQ linears that quantize
    (``fp4.train_mode`` other than bf16, where `moeresq_linear` is the plain `invariant.linear`)."""
    scope = cfg.fp4.scope
    return cfg.fp4.train_mode != "bf16" and scope != "none" and (not attention or scope == "experts+attention")


def tiled_rows(cfg: Config, rows: int, k: int, n: int, fp4: bool = False, dtype: Optional[torch.dtype] = None) -> int:
    """Rows of the storage behind a bias-free linear's [rows, n] output (`k` inputs) that a later op
    saves: at the ``batch`` level `tiled._tiled_forward` returns the first `rows` of a buffer padded to
    a height of the GEMM's row plan (`row_calls.row_plan`: this machine's, at the GEMM's `dtype`, by
    default the activations', and the current thread count; `tiled._padded_rows`), and a saved view
    keeps the whole buffer.
    `fp4`: a quantizing MoEResQ linear's (`quantized_linears`), which is that buffer unless cast from its fp32 accumulation to
    narrower activations. A bias add, a cast or a gather makes a fresh compact tensor instead (the
    biased GPT-OSS linears, the experts' grouped tiles: their per-expert padding is a transient of
    the forward, `tiled._grouped_tiles`, not saved; a weight of fewer than MIN_COLUMNS outputs, whose
    first columns of a zero-padded copy's product are copied out), so the count depends on the token
    count alone."""
    if not gemms_are_tiled(cfg) or (fp4 and activation_dtype(cfg).itemsize < 4) or n < MIN_COLUMNS:
        return rows
    return row_plan(k, n, dtype or activation_dtype(cfg), gemm_device(cfg)).height(rows)


def gemm_device(cfg: Config) -> torch.device:
    """The device type the trainer's GEMMs will run on (``cfg.device``; ``auto``: CUDA where this
    process sees one), without claiming it (a plan may be made for a GPU job on a CPU machine)."""
    on_gpu = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if on_gpu else "cpu")


def attention_is_blocked(cfg: Config) -> bool:
    """Whether the trainer's attention is `tiled.block_attention`, the ``batch`` numerics level's
    (`fp4/invariant.py`: not for fp64, which runs the standard kernels), on whole sequences, on a cp
    rank's queries against the gathered keys (`cp_attention_bytes`) and on packed rows unpacked by
    length (`packed_attention_bytes`)."""
    return gemms_are_tiled(cfg)


def attention_activation_bytes(cfg: Config, tokens: int, batch: int = 0) -> int:
    """Bytes one attention layer's autograd graph saves for `tokens` = batch × seq tokens beyond its
    input (counted by the caller), by family (each term the forward's own tensor;
    tests/unit/test_memory_plan_families_activations.py checks them against the saved tensors and a
    hand count). ``a`` the activation dtype, ``w`` the wide one; tensor parallel cuts the heads.
    `batch`: the micro-batch's rows (default one row of `tokens`). At the ``batch`` numerics level
    (`attention_is_blocked`) the attention saves q, k and v as they are (k and v on the kv heads, not
    repeated; GPT-OSS: no mask, no softmax) and `block_attention_bytes` (output, log-sum-exp).

    - GQA (qwen3_moe): q_norm/k_norm, RoPE's cos and sin, SDPA's q, k and v (repeated to every
      query head), output and logsumexp, o_proj's input;
    - MLA (deepseek_v3): the q low-rank path (q_a's output normed, q_b's input) or nothing more
      (``q_lora_rank`` 0: q_proj reads the input); kv_a's whole output (its latent part upcast by
      the norm: a view of it unless the activations are narrower) and its norm, kv_b's input; cos and
      sin of the rotary dims; SDPA's q and k (``qk_nope + qk_rope`` per head), v (a view of kv_b's
      whole output: ``qk_nope + v`` per head), its output (``v_head_dim``) and logsumexp; o_proj's input;
    - GPT-OSS (eager sink attention): cos and sin of half the head dim; q, k and v repeated to every
      head; the boolean mask [1, 1, T, T] of the causal (and sliding-window) keys; the row max's
      int64 indices; the softmax over ``T + 1`` logits (the sink); o_proj's input."""
    m, a = cfg.model, activation_dtype(cfg).itemsize
    w = wide_dtype(activation_dtype(cfg)).itemsize
    tp = _tp_layout(cfg)[0]
    nh, family = m.num_heads // tp, getattr(m, "family", "qwen3_moe")
    rows = batch or 1
    seq = tokens // rows
    blocked = attention_is_blocked(cfg)
    fp4 = quantized_linears(cfg, attention=True)

    def pad(n: int, k: int = m.hidden_size) -> int:  # a bias-free projection's saved output: its tile padding
        return (tiled_rows(cfg, tokens, k, n, fp4) - tokens) * n * a

    if family == "deepseek_v3":
        qk, rope, kvr, qr = m.qk_nope_head_dim + m.qk_rope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.q_lora_rank
        b = _norm_bytes(tokens, qr, a, w) + tokens * qr * a if qr else 0  # q_a's output normed; q_b's input
        # the outputs saved whole (their tile padding): q_a's and kv_a's by their norms' upcast (a view
        # when the activations are wide), kv_b's as v's storage
        b += (pad(qr) if qr else 0) + pad(kvr + rope) if a == w else 0
        b += pad(nh * (m.qk_nope_head_dim + m.v_head_dim), kvr)
        # kv_a's output [kvr | rope]: the norm's upcast of its latent part is a view of the whole output
        # when the activations are wide already, else a wide copy of the latent part
        b += tokens * (kvr + rope) * a if a == w else tokens * kvr * w
        b += tokens * w + 2 * tokens * kvr * a  # the norm's rsqrt and x·rsqrt; kv_b's input
        b += 2 * tokens * rope * a  # cos, sin
        b += 2 * tokens * nh * qk * a + tokens * nh * (m.qk_nope_head_dim + m.v_head_dim) * a  # q, k; v's storage
        if blocked:  # the block attention's output and log-sum-exp; o_proj's input
            return b + block_attention_bytes(rows * nh, 1, seq, m.v_head_dim, a) + tokens * nh * m.v_head_dim * a
        return b + 2 * tokens * nh * m.v_head_dim * a + tokens * nh * w  # SDPA's output, o_proj's input; logsumexp
    d = m.head_dim
    if family == "gpt_oss":
        b = tokens * d * a  # cos, sin: half the head dim each
        if blocked:  # q, k, v (kv heads); the block attention's output and log-sum-exp; o_proj's input
            nkv = m.num_kv_heads // tp if m.num_kv_heads % tp == 0 else 1
            b += tokens * (nh + 2 * nkv) * d * a + block_attention_bytes(rows * nkv, nh // nkv, seq, d, a)
            return b + tokens * nh * d * a
        b += 3 * tokens * nh * d * a  # q; k and v repeated to every head
        b += seq * seq + tokens * nh * _INDEX_BYTES  # the visible-keys mask (bool); the row max's indices
        b += tokens * nh * (seq + 1) * a  # the softmax over the keys and the sink
        return b + tokens * nh * d * a  # o_proj's input
    nkv = m.num_kv_heads // tp if m.num_kv_heads % tp == 0 else 1
    b = _norm_bytes(tokens * nh, d, a, w) + _norm_bytes(tokens * nkv, d, a, w)  # q_norm, k_norm
    b += pad(nh * d) + pad(nkv * d) if a == w else 0  # their upcast: q_proj's, k_proj's output (tile padded)
    b += 2 * tokens * d * a  # rope cos, sin
    if blocked:  # q, k, v (kv heads: no repeat; v is v_proj's padded output); the block attention's output
        b += tokens * (nh + 2 * nkv) * d * a + pad(nkv * d)  # and log-sum-exp; o_proj's input
        return b + block_attention_bytes(rows * nkv, nh // nkv, seq, d, a) + tokens * nh * d * a
    b += 4 * tokens * nh * d * a + tokens * nh * w  # SDPA: q, k and v (repeated to nh heads), out; logsumexp
    return b + tokens * nh * d * a  # o_proj input (contiguous copy)


def layer_activation_bytes(cfg: Config, is_moe: bool, tokens: int, routed_rows: int, local_experts: int = 0,
                           grouped_experts: bool = False, batch: int = 0) -> int:
    """Bytes autograd saves in one decoder layer for `tokens` = batch × seq tokens (``routed_rows``:
    rows this rank's experts receive). Terms follow the forward (layers.py, moe.py, moeresq.py);
    ``a`` is the activation dtype, ``w`` the wide (norm/router) one. Excludes Q(W) (`fp4_weight_bytes`).
    Tensor parallel (`parallel/tensor_parallel.py`): the attention and dense-MLP regions see every
    token (all-gathered in under sequence parallel) with this rank's heads / ffn slice; the norms see
    ``tokens / tp`` rows under sequence parallel; MoE layers route every token or ``tokens / tp``."""
    m, a = cfg.model, activation_dtype(cfg).itemsize
    w = wide_dtype(activation_dtype(cfg)).itemsize
    tp, sp, local = _tp_layout(cfg)
    H, k = m.hidden_size, m.top_k
    rows = tokens // sp  # the norms' and residuals' rows
    norm = lambda n, dim: _norm_bytes(n, dim, a, w)  # noqa: E731
    # input norm, its output: the attention's input linears' input; under SP all-gathered along the
    # sequence into a non-contiguous [B, T, H] (`tp_comm._gather`), which each of them copies to save
    b = norm(rows, H) + tokens * H * a * (_input_linears(m) if sp > 1 else 1)
    b += attention_activation_bytes(cfg, tokens, batch)
    b += norm(rows, H)  # post-attention norm
    shared = is_moe and m.num_shared_experts > 0
    moe_tokens = tokens // local
    # the MLP's linears save their input: the norm's output, all-gathered under SP (dense, whole MoE
    # tokens) or by the local-token shared expert; the router its fp32 upcast of the MoE's input
    mlp_in = tokens * H * a if not is_moe or shared else 0
    mlp_in *= 2 if sp > 1 and not is_moe else 1  # gate and up each copy the non-contiguous gathered input
    router_in = moe_tokens * H * w if is_moe else 0
    same = a == w and (local == 1 or not shared)  # one tensor: the shared expert's input is the router's
    b += max(mlp_in, router_in) if same else mlp_in + router_in
    def swiglu(rows: int, ffn: int, fp4: bool) -> int:  # gate, up (their outputs, tile padded), silu, product
        return 2 * (tiled_rows(cfg, rows, H, ffn, fp4) + rows) * ffn * a

    if not is_moe:
        return b + swiglu(tokens, m.dense_ffn_hidden_size // tp, quantized_linears(cfg))
    tokens = moe_tokens
    E, F = m.num_experts, m.moe_ffn_hidden_size // cfg.parallel.etp
    b += 0 if param_dtype(cfg) == wide_dtype(param_dtype(cfg)) else E * H * w  # the router weight's fp32 upcast
    gpt_oss = getattr(m, "family", "qwen3_moe") == "gpt_oss"
    if gpt_oss:  # top-k of the logits, softmax over the chosen ones; the softmax over all only for the aux loss
        b += tokens * k * w + (tokens * E * w if m.router_aux_loss_coef else 0)
    else:  # softmax (Qwen3) or sigmoid (DeepSeek-V3) scores; top-k sum, raw/normalized weights
        b += tokens * E * w + tokens * w + tokens * k * 2 * w
        # DeepSeek-V3's sigmoid at a row-invariant level (`gpt_oss.sigmoid`): exp's output and the reciprocal too
        b += 2 * tokens * E * w if getattr(m, "family", "qwen3_moe") == "deepseek_v3" and row_invariant(cfg) else 0
    b += 4 * tokens * k * _INDEX_BYTES  # top-k ids, token_of_row, two un-permute orders
    b += routed_rows * H * a + 4 * routed_rows * F * a  # x_sorted; per expert w13 out (2F), silu, product
    # GPT-OSS's clamped SwiGLU: the clamped gate, the sigmoid, clamp(up) + 1 (the product's other factor)
    b += 3 * routed_rows * F * a if gpt_oss else 0
    # at a row-invariant level its sigmoid is ``1 / (1 + exp(−z))`` (`gpt_oss.sigmoid`): exp's output and
    # the reciprocal are saved too (the sigmoid itself, ``1 × reciprocal``, is the tensor counted above)
    b += 2 * routed_rows * F * a if gpt_oss and row_invariant(cfg) else 0
    # combine: the slots in expert order (one tensor: `weighted_sum_of_slots` takes them by unbind), their weights
    b += tokens * k * H * a + tokens * k * a
    if grouped_experts:  # FP4 off: one grouped GEMM (moe.can_group) saves its int32 group offsets
        b += local_experts * 4
    if m.router_aux_loss_coef or m.router_z_loss_coef:  # the aux losses' graph, kept by AuxLossAutoScaler
        # logits (z-loss: the router GEMM's tile-padded output unless biased), token fractions, logsumexp, the loss
        router_rows = tokens if gpt_oss else tiled_rows(cfg, tokens, H, E, dtype=wide_dtype(activation_dtype(cfg)))
        b += router_rows * E * w + E * 4 + tokens * w + w
        b += tokens * w + w if local > 1 else 0  # tp-shared statistics (`MoELayer.token_sum`): token weights, count
        # DeepSeek-V3's router: the aux losses' probs are its sigmoid scores over their row sum (saved)
        b += tokens * w if getattr(m, "family", "qwen3_moe") == "deepseek_v3" and m.router_aux_loss_coef else 0
    if shared:  # whole MoE tokens: uncut; local: cut like a dense MLP, on every token (`_shared_expert`)
        b += swiglu(tokens * local, m.shared_expert_ffn_hidden_size * m.num_shared_experts // local,
                    quantized_linears(cfg))
    return b


def cp_attention_bytes(cfg: Config, batch: int, seq: int) -> int:
    """What one attention layer saves beyond `layer_activation_bytes` of its 1/cp of the tokens under
    context parallel (`parallel/context.py`): against the same layer on its ``L = T/cp`` local tokens
    alone, the keys and values it attends to cover the whole gathered sequence, and its mask is
    [B, 1, L, T] from the global positions. By family (measured per module in
    tests/unit/test_cp_memory_plan_families.py):

    - GQA (qwen3_moe): SDPA saves K and V repeated to every query head, and the boolean mask
      converted to the activations' dtype;
    - MLA (deepseek_v3): SDPA saves the per-head keys (nope + the shared rotary key, expanded to
      every head: ``qk_nope + qk_rope`` wide) and the values, a view of the whole gathered buffer
      (`context.gather_kv`: per token the per-head ``[k_nope | v]`` and the one rotary key), plus
      the mask as GQA's;
    - GPT-OSS (eager sink attention, any sliding window: the mask has the same shape): the keys and
      values repeated to every head, the softmax over ``T + 1`` logits instead of ``L + 1``, and the
      boolean masked-fill mask [B, 1, L, T] (1 byte) instead of the shared causal [1, 1, L, L]."""
    cp = getattr(cfg.parallel, "cp", 1)
    if cp == 1:
        return 0
    m, a = cfg.model, activation_dtype(cfg).itemsize
    local = seq // cp
    extra_keys = batch * (seq - local)  # key positions attended beyond the local ones
    family = getattr(m, "family", "qwen3_moe")
    if attention_is_blocked(cfg):
        return _blocked_cp_attention_bytes(cfg, batch, seq, local)
    if family == "deepseek_v3":
        width = 2 * m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim
        return extra_keys * m.num_heads * width * a + batch * seq * m.qk_rope_head_dim * a + batch * local * seq * a
    if family == "gpt_oss":
        return (2 * extra_keys * m.num_heads * m.head_dim * a + batch * m.num_heads * local * (seq - local) * a
                + batch * local * seq - local * local)
    return 2 * extra_keys * m.num_heads * m.head_dim * a + batch * local * seq * a


def _blocked_cp_attention_bytes(cfg: Config, batch: int, seq: int, local: int) -> int:
    """`cp_attention_bytes` at the ``batch`` level: the block attention (`tiled.block_attention`:
    output and log-sum-exp by query, on the local tokens as without cp) saves the gathered K/V of
    the whole sequence (`context.gather_kv`: one buffer) instead of the local k (RoPE's output) and
    v (its projection's output, tile padded unless biased: `tiled_rows`), which the gather's
    concatenation reads without saving. MLA: the buffer holds per token the heads' ``[k_nope | v]``
    and the one rotary key; its per-head keys (``qk_nope + qk_rope``) are built from it for the
    whole sequence."""
    m, a = cfg.model, activation_dtype(cfg).itemsize
    tp = _tp_layout(cfg)[0]
    nh, tokens, whole = m.num_heads // tp, batch * local, batch * seq
    fp4 = quantized_linears(cfg, attention=True)
    if getattr(m, "family", "qwen3_moe") == "deepseek_v3":
        per_head = m.qk_nope_head_dim + m.v_head_dim
        gathered = whole * (nh * per_head + m.qk_rope_head_dim) * a
        keys = (whole - tokens) * nh * (m.qk_nope_head_dim + m.qk_rope_head_dim) * a
        return gathered + keys - tiled_rows(cfg, tokens, m.kv_lora_rank, nh * per_head, fp4) * nh * per_head * a
    nkv = m.num_kv_heads // tp if m.num_kv_heads % tp == 0 else 1
    kv = nkv * m.head_dim
    v_rows = tokens if getattr(m, "family", "qwen3_moe") == "gpt_oss" else tiled_rows(cfg, tokens, m.hidden_size, kv, fp4)
    return 2 * whole * kv * a - (tokens + v_rows) * kv * a


def packed_attention_bytes(cfg: Config, tokens: int) -> int:
    """A bound on what one attention layer saves beyond `layer_activation_bytes` for a packed
    micro-batch of `tokens` tokens (`model/packing.py`): its sequences unpacked by length class hold
    at most 2 × tokens slots, so the attention's per-slot tensors cover at most `tokens` padding
    slots more (an upper bound: the padding depends on the lengths). Standard level: SDPA's q, k, v
    (repeated to every head) and output. ``batch`` level (`_blocked_packed_attention_bytes`): the
    block attention's q, k, v (kv heads), output and log-sum-exp per slot, plus what the unpacking
    saves."""
    if attention_is_blocked(cfg):
        return _blocked_packed_attention_bytes(cfg, tokens)
    m, a = cfg.model, activation_dtype(cfg).itemsize
    return 4 * tokens * m.num_heads * m.head_dim * a


def _blocked_packed_attention_bytes(cfg: Config, tokens: int) -> int:
    """`packed_attention_bytes` at the ``batch`` level, per layer: the padding slots (at most
    `tokens`) of the block attention's q, k, v, output and log-sum-exp; `SequenceLayout.repack`'s
    ``index_copy`` saves its source, the per-slot outputs of the real tokens (``tokens × heads ×
    head_dim``); the index tensors: `unpack`'s int64 slot indices (at most one copy for each of q, k
    and v per class: 24 bytes a slot), its boolean mask and `repack`'s two int64 indices of the real
    tokens. The index and mask terms count ``N × L`` (sequences × the longest) as at most 2 × tokens
    slots, which holds when every sequence is at least half the longest (their exact size depends on
    the lengths: many short sequences beside one long one hold more)."""
    m, a = cfg.model, activation_dtype(cfg).itemsize
    tp = _tp_layout(cfg)[0]
    nh = m.num_heads // tp
    nkv = m.num_kv_heads // tp if m.num_kv_heads % tp == 0 else 1
    d = m.head_dim
    slot = (nh + 2 * nkv) * d * a + nh * (d * a + max(a, 4))  # q, k, v, output, log-sum-exp
    return tokens * (slot + nh * d * a) + 2 * tokens * (3 * _INDEX_BYTES + 1) + 2 * tokens * _INDEX_BYTES


def chunk_activation_bytes(cfg: Config, model: MoETransformer, layers, is_first: bool, is_last: bool,
                           batch: int, seq: int, packed: bool = False) -> int:
    """Saved bytes of one micro-batch through one chunk (`layers`, the embedding, the head). Context
    parallel (``parallel.cp``): a rank's 1/cp of the sequence, plus what its attention saves of the
    whole sequence (`cp_attention_bytes`). `packed`: one packed row (`packed_attention_bytes`)."""
    cp = getattr(cfg.parallel, "cp", 1)
    tokens, m = batch * seq // cp, cfg.model
    a, w = activation_dtype(cfg).itemsize, wide_dtype(activation_dtype(cfg)).itemsize
    tp, sp, local = _tp_layout(cfg)
    b = tokens * _INDEX_BYTES if is_first else 0  # the embedding's token ids (tp: its local ids)
    b += tokens * a if is_first and tp > 1 else 0  # tp: the mask of this rank's vocabulary slice
    for i in layers:
        layer = model.layers[i]
        experts = layer.mlp.experts if layer.is_moe else None
        rows = tokens // local * m.top_k
        grouped = experts is not None and experts.grouped and experts.recipe.mode == "bf16" \
            and param_dtype(cfg) != torch.float64 and not gemms_are_tiled(cfg) \
            and rows <= GroupedExperts.max_group_rows * experts.num_experts
        b += layer_activation_bytes(cfg, layer.is_moe, tokens, rows, experts.num_experts if experts else 0, grouped,
                                    batch)
        b += cp_attention_bytes(cfg, batch, seq) + (packed_attention_bytes(cfg, tokens) if packed else 0)
    if is_last and tp == 1:  # final norm, LM-head input, log-softmax output (fp32), loss scalar
        b += tokens * m.hidden_size * (w + 2 * a) + tokens * w + tokens * m.vocab_size * w + w
    elif is_last:  # final norm (S/tp under SP), the gathered head input; `vocab_parallel_cross_entropy`:
        rows = tokens // sp  # exp, sum of exp, local ids, in-slice mask; the label mask (wide), its count
        b += rows * m.hidden_size * (w + a) + rows * w + tokens * m.hidden_size * a
        b += tokens * m.vocab_size // tp * w + tokens * (w + _INDEX_BYTES + 1) + tokens * w + _INDEX_BYTES
    return b
