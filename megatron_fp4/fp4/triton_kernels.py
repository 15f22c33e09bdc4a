"""Triton kernels of NVFP4/MXFP4 fake-quantization and the MoEResQ operand ``Q(x) + Q(x − Q(x))``.

Device code only; the host side (dispatch, launch, checks) is ``triton_fp4.py``, which loads this
file twice when needed: once as a normal module (compiled kernels, CUDA) and once with Triton's
interpreter switched on (CPU tensors, tests). A ``@triton.jit`` function is compiled or interpreted
depending on how it was decorated, and kernels call their helpers through module globals, so the two
modes need two module objects.

Every kernel works on a logical matrix (R rows, C columns), read through arbitrary strides (a
transposed view gives the columnwise variant for free) with columns ≥ ``c_valid`` read as zeros
(the token padding of wgrad). A tile is held as a 4-D block (row tiles, rows per tile, column
blocks, elements per block) so block and 16×16-tile maxima are plain reductions over axes 1 and 3.

Bit-exactness with the reference (``nvfp4.py``, ``mxfp4.py``, ``e2m1.py``) rests on:

- the same fp32 operations in the same order, each correctly rounded: ``tl.math.div_rn`` for every
  division (Triton's ``/`` is an approximate ``div.full.f32`` on NVIDIA GPUs), and launches with
  ``enable_fp_fusion=False`` so ``x − t·s`` is never contracted into one FMA rounding;
- rounding to the E2M1 and E4M3 grids computed from the fp32 exponent bits: the grid step is a power
  of two read off the exponent, ``v / step`` is exact, and the nearest-even integer of ``0 ≤ v < 2^22``
  is ``(v + 1.5·2^23) − 1.5·2^23`` (one correctly rounded add; no libdevice call, so the interpreter
  and the GPU run the same arithmetic);
- casts done on bits: bf16 in is ``bits << 16`` (exact), bf16 out is torch's round-to-nearest-even
  on the bits (the interpreter's own fp32→bf16 cast truncates).
"""
import triton
import triton.language as tl


@triton.jit
def _f32(bits):
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _i32(x):
    return x.to(tl.int32, bitcast=True)


@triton.jit
def _rint(v):
    """Round half to even of fp32 0 <= v < 2^22 (exact: the add rounds once, the subtract is exact)."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def _round_e2m1(y, u, SR: tl.constexpr):
    """``e2m1.round_e2m1`` (RNE) or ``stochastic_round_e2m1`` (round up when u < frac) of y in [-6, 6].

    Works on |y| and puts y's sign bit back (copysign: −0 stays −0, a negative that rounds to zero
    gives −0, as the reference)."""
    yb = _i32(y)
    a = _f32(yb & 0x7FFFFFFF)
    step_bits = tl.maximum(yb & 0x7F800000, 127 << 23) - (1 << 23)  # 2^(max(E, 0) - 1)
    step = _f32(step_bits)
    v = a * _f32((254 << 23) - step_bits)  # a / step, exact (power of two)
    if SR:
        lo = tl.floor(v)
        m = tl.where(u < v - lo, lo + 1.0, lo) * step
    else:
        m = _rint(v) * step
    return _f32(_i32(m) | ((yb >> 31) << 31))


@triton.jit
def _e4m3(v):
    """fp32 0 <= v <= 448 rounded to nearest-even E4M3 (subnormals down to 2^-9), as fp32."""
    q_bits = tl.maximum(_i32(v) & 0x7F800000, (127 - 6) << 23) - (3 << 23)  # quantum 2^(max(E, -6) - 3)
    return _rint(v * _f32((254 << 23) - q_bits)) * _f32(q_bits)


@triton.jit
def _pow2(e):
    """2^e as fp32 for int32 e in [-127, 127] (``formats.pow2_fp32``; 2^-127 is subnormal)."""
    return _f32(tl.where(e > -127, (e + 127) << 23, 0x00400000))


@triton.jit
def _block_max(a, TILE_R: tl.constexpr):
    """Max of |values| per block (axis 3), and per 16-row tile when TILE_R > 1 (axis 1)."""
    m = tl.max(a, axis=3, keep_dims=True)
    if TILE_R > 1:
        m = tl.max(m, axis=1, keep_dims=True)
    return m


@triton.jit
def _nvfp4(x, amax, u, SR: tl.constexpr, TILE_R: tl.constexpr):
    """``fake_quantize_nvfp4`` of a 4-D tile, ``amax`` the (row or tensor) amax per row."""
    s_enc = tl.minimum(tl.math.div_rn(tl.full(amax.shape, 2688.0, tl.float32), amax), 3.4028234663852886e38)
    s_enc = tl.where(amax == 0.0, 1.0, s_enc)
    s_dec = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), s_enc)
    bmax = _block_max(tl.abs(x), TILE_R)
    s_blk = _e4m3(tl.minimum(bmax * (s_enc * 0.1666666716337204), 448.0))  # 0.16666667: fp32(1/6)
    prod = s_blk * s_dec
    enc = tl.minimum(tl.math.div_rn(tl.full(prod.shape, 1.0, tl.float32), prod), 3.4028234663852886e38)
    y = tl.minimum(tl.maximum(x * enc, -6.0), 6.0)
    return (_round_e2m1(y, u, SR) * s_blk) * s_dec


@triton.jit
def _mx_exponent(bmax, RCEIL: tl.constexpr):
    """``mxfp4.shared_exponent``: floor(log2 amax) − 2, or ceil(log2 fp32(amax / 6)), in [-127, 127]."""
    if RCEIL:
        t = tl.math.div_rn(bmax, tl.full(bmax.shape, 6.0, tl.float32))
        small = t < 1.1754943508222875e-38  # subnormal: scale by 2^64 (exact) to read its exponent
        bits = _i32(tl.where(small, t * 18446744073709551616.0, t))
        e = (bits >> 23) - 127 + tl.where((bits & 0x7FFFFF) == 0, 0, 1) - tl.where(small, 64, 0)
        e = tl.where(t == 0.0, -127, e)
    else:
        e = (_i32(bmax) >> 23) - 129  # zero / subnormal amax: below -127, clamped
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def _mxfp4(x, u, SR: tl.constexpr, RCEIL: tl.constexpr):
    e = _mx_exponent(tl.max(tl.abs(x), axis=3, keep_dims=True), RCEIL)
    y = tl.minimum(tl.maximum(x * _pow2(-e), -6.0), 6.0)
    return _round_e2m1(y, u, SR) * _pow2(e)


@triton.jit
def _fq(x, amax, u, MX: tl.constexpr, SR: tl.constexpr, RCEIL: tl.constexpr, TILE_R: tl.constexpr):
    if MX:
        return _mxfp4(x, u, SR, RCEIL)
    else:
        return _nvfp4(x, amax, u, SR, TILE_R)


@triton.jit
def _tile_index(pid_r, c0, BLOCK_R: tl.constexpr, TILE_R: tl.constexpr, BLOCK_C: tl.constexpr, BS: tl.constexpr):
    """(rows (RB, TILE_R, 1, 1) int64, cols (1, 1, CB, BS) int64) of one tile."""
    rr = tl.arange(0, BLOCK_R // TILE_R)[:, None, None, None] * TILE_R + tl.arange(0, TILE_R)[None, :, None, None]
    cc = tl.arange(0, BLOCK_C // BS)[None, None, :, None] * BS + tl.arange(0, BS)[None, None, None, :]
    return pid_r.to(tl.int64) * BLOCK_R + rr, cc + c0


@triton.jit
def _load_x(x_ptr, rows, cols, n_rows, c_valid, sxr, sxc, IN_BF16: tl.constexpr):
    mask = (rows < n_rows) & (cols < c_valid)
    ptrs = x_ptr + rows * sxr + cols.to(tl.int64) * sxc  # int64: a transposed read spans the whole tensor
    if IN_BF16:  # int16 view of bf16: the value is the bits shifted up (exact)
        return _f32((tl.load(ptrs, mask=mask, other=0).to(tl.int32) & 0xFFFF) << 16)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _nonfinite(x):
    """1 where x is NaN or ±Inf (exponent bits all ones), else 0, as int32."""
    return ((_i32(x) & 0x7F800000) == 0x7F800000).to(tl.int32)


@triton.jit(do_not_specialize=["n_rows", "c_valid", "s_amax"])  # token counts vary per expert and step
def row_amax_kernel(x_ptr, amax1_ptr, u1_ptr, out_ptr, bad_ptr, n_rows, n_cols, c_valid, sxr, sxc, s_amax,
                    RESIDUAL: tl.constexpr, SR: tl.constexpr, TILE_R: tl.constexpr, IN_BF16: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Per row: max |x| (or max |x − Q(x)| with RESIDUAL, NVFP4 with amax1) and a non-finite flag."""
    pid = tl.program_id(0)
    rows, cols0 = _tile_index(pid, 0, BLOCK_R, TILE_R, BLOCK_C, 16)
    row_ok = rows < n_rows
    if RESIDUAL:
        amax1 = tl.load(amax1_ptr + rows * s_amax, mask=row_ok, other=1.0)
    acc = tl.zeros((BLOCK_R // TILE_R, TILE_R, 1, 1), tl.float32)
    bad = tl.zeros((BLOCK_R // TILE_R, TILE_R, 1, 1), tl.int32)
    for c0 in range(0, n_cols, BLOCK_C):
        cols = cols0 + c0
        v = _load_x(x_ptr, rows, cols, n_rows, c_valid, sxr, sxc, IN_BF16)
        if RESIDUAL:
            u = v
            if SR:
                u = tl.load(u1_ptr + rows * n_cols + cols, mask=row_ok & (cols < n_cols), other=0.0)
            v = v - _fq(v, amax1, u, False, SR, False, TILE_R)
        bad = tl.maximum(bad, tl.max(tl.max(_nonfinite(v), axis=3, keep_dims=True), axis=2, keep_dims=True))
        acc = tl.maximum(acc, tl.max(tl.max(tl.abs(v), axis=3, keep_dims=True), axis=2, keep_dims=True))
    tl.store(out_ptr + rows, acc, mask=row_ok)
    tl.store(bad_ptr + rows, bad, mask=row_ok)


@triton.jit(do_not_specialize=["n_rows", "c_valid", "s_amax"])
def fake_quant_kernel(x_ptr, out_ptr, amax1_ptr, amax2_ptr, u1_ptr, u2_ptr, bad_ptr,
                      n_rows, n_cols, c_valid, sxr, sxc, s_amax,
                      MX: tl.constexpr, BS: tl.constexpr, TILE_R: tl.constexpr, SR: tl.constexpr,
                      RCEIL: tl.constexpr, RESQ: tl.constexpr, CHECK: tl.constexpr, IN_BF16: tl.constexpr,
                      OUT_BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """out = Q(x), or Q(x) + Q(x − Q(x)) with RESQ, into a contiguous (n_rows, n_cols) output.

    NVFP4 reads the per-row amax of x (amax1) and of the residual (amax2) at stride ``s_amax``
    (0: one per-tensor value). CHECK writes two non-finite flags per program, of x and of x − Q(x)
    (MXFP4 has no amax pass)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows, cols = _tile_index(pid_r, pid_c * BLOCK_C, BLOCK_R, TILE_R, BLOCK_C, BS)
    inside = (rows < n_rows) & (cols < n_cols)
    x = _load_x(x_ptr, rows, cols, n_rows, c_valid, sxr, sxc, IN_BF16)
    flat = rows * n_cols + cols
    amax1 = x
    amax2 = x
    u1 = x
    u2 = x
    if not MX:
        amax1 = tl.load(amax1_ptr + rows * s_amax, mask=rows < n_rows, other=1.0)
        if RESQ:
            amax2 = tl.load(amax2_ptr + rows * s_amax, mask=rows < n_rows, other=1.0)
    if SR:
        u1 = tl.load(u1_ptr + flat, mask=inside, other=0.0)
        if RESQ:
            u2 = tl.load(u2_ptr + flat, mask=inside, other=0.0)
    q = _fq(x, amax1, u1, MX, SR, RCEIL, TILE_R)
    if CHECK:  # flags of x and of its residual, as the portable path checks each quantizer input
        flag = bad_ptr + 2 * (pid_r * tl.num_programs(1) + pid_c)
        tl.store(flag, tl.max(_nonfinite(x)))
    if RESQ:
        r = x - q
        if CHECK:
            tl.store(flag + 1, tl.max(_nonfinite(r)))
        q = q + _fq(r, amax2, u2, MX, SR, RCEIL, TILE_R)
    if OUT_BF16:  # torch's fp32 -> bf16 round-to-nearest-even on the bits (finite values)
        b = _i32(q)
        tl.store(out_ptr + flat, ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16), mask=inside)
    else:
        tl.store(out_ptr + flat, q, mask=inside)
