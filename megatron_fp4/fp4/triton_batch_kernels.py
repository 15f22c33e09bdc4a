"""Triton kernels of the ``batch`` numerics level: fixed-tile GEMMs and fixed-key-block attention.

Device code only; the host side (shapes, launch, autograd, where they serve) is ``triton_batch.py``.
As ``triton_kernels.py``, this module is compiled on CUDA and run by Triton's interpreter when
``TRITON_INTERPRET=1`` was set before triton was imported (CPU tensors: the tests).

Why a row's bits depend only on that row (the anchors' argument: vLLM's batch-invariant mode,
Thinking Machines' batch-invariant ops):

- every launch uses one compile-time configuration (BLOCK_M/N/K, warps, stages) chosen by the
  host from the input dtype alone, never from M, the batch or the row count; M and the row
  offsets are runtime arguments that Triton does not specialize on (``do_not_specialize``);
- an output element is reduced over K by one program, in one loop over K blocks in increasing
  order (``acc = dot(a, b, acc)``), never split over programs (no split-K, no atomics);
- a ``dot`` computes an output row from that row of its left operand (the MMA instruction's
  reduction order is fixed by the tile shape; masked rows are zeros and change nothing else).
  The position of a row inside its tile, and which tile it is in, therefore do not change it.

Attention keys are indexed by *position* (slot − left padding) and reduced in blocks of BLOCK_N
positions, block 0 first, by the online softmax. A block wholly in a query's future (or before
its window) leaves that query's running (max, sum, accumulator) bit-for-bit unchanged: its
scores are −inf, so its weights are exp(−inf) = +0 (also ``ex2.approx``'s result on a GPU), its max
leaves the running max as it was, and the rescale factor is then set to exactly 1 (not computed
as exp(0), whose exactness would rest on the GPU's approximate exp). So the number of blocks a program loops over (which depends on
the other queries of its tile) does not change a query's bits, and a decode step over a KV cache
reads the same blocks, in the same order, as the causal prefill of the same sequence.
"""
import triton
import triton.language as tl


@triton.jit
def _f32(bits):
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _store_rows(out_ptr, acc, rows, cols, row_ok, col_ok, som, OUT_BF16: tl.constexpr):
    """acc (fp32) into rows × cols of a row-major output: fp32 as is; bf16 rounded to nearest even
    on the bits (torch's rounding; the interpreter's own cast truncates), NaN kept NaN."""
    ptrs = out_ptr + rows[:, None].to(tl.int64) * som + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if OUT_BF16:
        b = acc.to(tl.int32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(acc != acc, 0x7FC0, r)
        tl.store(ptrs, r.to(tl.int16), mask=mask)
    else:
        tl.store(ptrs, acc, mask=mask)


@triton.jit
def _tile_dot(x_ptr, w_ptr, rows, cols, row_ok, col_ok, K, sxm, sxk, swn, swk,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
              UPCAST: tl.constexpr):
    """One output tile: Σ_k x[rows, k] · w[cols, k] over K blocks in increasing order, fp32 accumulation.
    Rows and columns outside (masked) and the K tail read zeros: their products are exact zeros."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * sxm
    w_cols = w_ptr + cols[None, :].to(tl.int64) * swn
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        a = tl.load(x_rows + k[None, :] * sxk, mask=row_ok[:, None] & (k[None, :] < K), other=0.0)
        b = tl.load(w_cols + k[:, None] * swk, mask=col_ok[None, :] & (k[:, None] < K), other=0.0)
        if UPCAST:  # the interpreter's dot cannot multiply bf16 (it holds them as uint16): exact fp32 copies
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


# Sizes and strides are not specialized on (Triton would compile a variant for a size of 1 or a
# multiple of 16): a decode step's call and a prefill's run the same compiled code.
@triton.jit(do_not_specialize=["M", "N", "K", "sxm", "sxk", "swn", "swk", "som"])
def gemm_kernel(x_ptr, w_ptr, out_ptr, M, N, K, sxm, sxk, swn, swk, som,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PRECISION: tl.constexpr, OUT_BF16: tl.constexpr, UPCAST: tl.constexpr):
    """out[M, N] = x[M, K] · w[N, K]ᵀ, one program per (row tile, column tile)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = _tile_dot(x_ptr, w_ptr, rows, cols, row_ok, col_ok, K, sxm, sxk, swn, swk,
                    BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST)
    _store_rows(out_ptr, acc, rows, cols, row_ok, col_ok, som, OUT_BF16)


@triton.jit(do_not_specialize=["N", "K", "sxm", "sxk", "swe", "swn", "swk", "som"])
def grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, N, K,
                        sxm, sxk, swe, swn, swk, som,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr, OUT_BF16: tl.constexpr, UPCAST: tl.constexpr):
    """Rows sorted by expert: program (t, n) computes row tile t, which holds rows
    [tile_start[t], tile_end[t]) of expert tile_expert[t] (a tile never spans two experts; each
    expert's tiles start at its first row), times that expert's w[e] [N, K]ᵀ — the inner loop of
    :func:`gemm_kernel`, so a row gets the bits of the dense kernel on its expert's rows alone."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_t).to(tl.int64)
    start = tl.load(tile_start_ptr + pid_t)
    end = tl.load(tile_end_ptr + pid_t)
    rows = start + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < end, cols < N
    acc = _tile_dot(x_ptr, w_ptr + e * swe, rows, cols, row_ok, col_ok, K, sxm, sxk, swn, swk,
                    BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST)
    _store_rows(out_ptr, acc, rows, cols, row_ok, col_ok, som, OUT_BF16)


@triton.jit(do_not_specialize=["H", "Tq", "Tk", "D", "Dv", "window", "sqb", "sqh", "sqt", "skb", "skh", "skt",
                               "svb", "svh", "svt", "spb", "sob", "soh", "sot"])
def attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, pad_ptr, sink_ptr, out_ptr, lse_ptr,
                     H, Tq, Tk, D, Dv, scale, window,
                     sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, spb, sob, soh, sot,
                     REP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, WINDOW: tl.constexpr, SINKS: tl.constexpr,
                     PRECISION: tl.constexpr, OUT_BF16: tl.constexpr, UPCAST: tl.constexpr):
    """Causal attention by position, one program per (query tile, batch row · query head).

    q [B, H, Tq, D], k [B, KV, Tk, D], v [B, KV, Tk, Dv] (strided; head h reads kv head h // REP);
    the key in slot s of row b has position s − pad[b], a query at positions[b, t] sees the keys at
    positions ≤ its own (and > its own − window with WINDOW). Keys in blocks of BLOCK_N positions,
    combined in block order by the online softmax in fp32; out [B, H, Tq, Dv] and the log-sum-exp
    lse [B, H, Tq] (fp32, the sink's term included) for the backward."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    g = (h // REP).to(tl.int64)
    t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t_ok = t < Tq
    qpos = tl.load(pos_ptr + b * spb + t, mask=t_ok, other=0).to(tl.int32)
    pad = tl.load(pad_ptr + b).to(tl.int32)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * sqb + h * sqh + t[:, None].to(tl.int64) * sqt + d[None, :],
                mask=t_ok[:, None] & (d[None, :] < D), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = k_ptr + b * skb + g * skh
    v_base = v_ptr + b * svb + g * svh
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    # Blocks 0 .. (the tile's last position) // BLOCK_N, and none past the last key: any extra
    # block is wholly masked for a query and leaves its state unchanged (module docstring).
    last = tl.max(tl.where(t_ok, qpos, 0))
    hi = tl.minimum(last // BLOCK_N + 1, (Tk - pad + BLOCK_N - 1) // BLOCK_N)
    lo = 0
    if WINDOW:
        first = tl.min(tl.where(t_ok, qpos, last)) - window + 1
        lo = tl.maximum(first, 0) // BLOCK_N
    kn = tl.arange(0, BLOCK_N)
    for j in range(lo, hi):
        kpos = j * BLOCK_N + kn
        slot = pad + kpos
        k_ok = slot < Tk
        kt = tl.load(k_base + slot[None, :].to(tl.int64) * skt + d[:, None],
                     mask=k_ok[None, :] & (d[:, None] < D), other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * scale
        seen = k_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        if WINDOW:
            seen = seen & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: weights 0, not NaN
        p = tl.exp(s - m_ref[:, None])
        corr = tl.where(m_new == m, 1.0, tl.exp(m - m_ref))  # exactly 1 when the block raised no max
        vt = tl.load(v_base + slot[:, None].to(tl.int64) * svt + dv[None, :],
                     mask=k_ok[:, None] & (dv[None, :] < Dv), other=0.0)
        pv = p.to(vt.dtype)  # the weights in the values' dtype for the product (bf16: tensor cores)
        if UPCAST:
            pv = pv.to(tl.float32)
            vt = vt.to(tl.float32)
        l = l * corr + tl.sum(p, axis=1)
        acc = tl.dot(pv, vt, acc * corr[:, None], input_precision=PRECISION)
        m = m_new
    if SINKS:  # a per-head logit in every row's softmax, without a value
        sink = tl.load(sink_ptr + h).to(tl.float32)
        m_all = tl.maximum(m, sink)
        corr = tl.exp(m - m_all)
        l = l * corr + tl.exp(sink - m_all)
        acc = acc * corr[:, None]
        m = m_all
    o = tl.math.div_rn(acc, tl.broadcast_to(l[:, None], acc.shape))  # correctly rounded (``/`` is approximate on GPUs)
    o_rows = out_ptr + b * sob + h * soh
    _store_rows(o_rows, o, t, dv, t_ok, dv < Dv, sot, OUT_BF16)
    tl.store(lse_ptr + (b * H + h) * Tq + t, m + tl.log(l), mask=t_ok)
