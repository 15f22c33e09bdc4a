"""A row-streaming fp32 GEMM for a ``batch``-level call of a few rows (a decode step's), compiled
from the C below on first use where a C compiler and AVX2/FMA are present.

Why: a decode step's GEMMs are weight-bandwidth bound (a realistic step's 64 experts read 302 MiB
a layer for ~2 rows each), and oneDNN's and MKL's fp32 kernels read a weight at 2-16 rows at
5-8 GB/s on an AVX2-only EPYC where one core streams ~13 GB/s (vLLM's CPU fused-MoE kernel reaches
~11.5 GB/s on the same experts). This kernel reads a weight packed in column blocks of 16
(:func:`stream_pack`: [ceil(N/16), K, 16], each block one sequential stream) once per 4 rows, with
16 columns of up to 4 rows in registers: 9-10.6 GB/s there (1.6-1.8× oneDNN's calls at 1-4 rows).

Its bits: each output element is one fused multiply-add per k, k = 0 .. K-1 in order, from +0 —
a row's result depends on that row alone, by construction. oneDNN's fp32 inner product at 2 rows
and more computes exactly that sequence on AVX2 (measured: every element of [2-96, K] · [K, N]
calls, K 64-1024, N 40-4096), so where `row_calls.row_plan`'s probe finds this kernel gives the
oneDNN plan's tile bits at every height up to ``RowPlan.stream`` (random rows, aligned and
misaligned), a rollout model's calls of so few rows run it instead (`tiled._row_products`): the
same bits as the oneDNN calls, fewer seconds. Where the probe finds otherwise (another vector unit,
another oneDNN) or nothing compiles, oneDNN keeps every call: the bits do not depend on it.

The library is compiled once per source and flags into the user's cache directory
(``$XDG_CACHE_HOME/megatron_fp4`` or ``~/.cache/megatron_fp4``; written to a temporary file and
renamed, so concurrent processes never load a half-written one), from this module's own source
only; a compiler that fails or is absent leaves :func:`available` False.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)

BLOCK = 16  # the packed weight's column block (two AVX2 vectors)
COMPILE_TIMEOUT_S = 120

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>

#define NBW 16

/* out[r, 0:ncols] = x[r, :] . wb[:, 0:ncols] for rows r < rows (at most 4): per element one fused
   multiply-add per k in order from +0. wb: one packed column block [K, 16]. */
static void block_rows(const float *x, int64_t ldx, const float *wb, int64_t K, float *out, int64_t ldo,
                       int64_t ncols, int rows) {
    __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps(), a10 = _mm256_setzero_ps(), a11 = _mm256_setzero_ps();
    __m256 a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps(), a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
    for (int64_t k = 0; k < K; ++k) {
        const float *w = wb + k * NBW;
        _mm_prefetch((const char *)(w + 16 * NBW), _MM_HINT_T0);
        __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
        __m256 b = _mm256_broadcast_ss(x0 + k);
        a00 = _mm256_fmadd_ps(b, w0, a00);
        a01 = _mm256_fmadd_ps(b, w1, a01);
        if (rows > 1) {
            b = _mm256_broadcast_ss(x1 + k);
            a10 = _mm256_fmadd_ps(b, w0, a10);
            a11 = _mm256_fmadd_ps(b, w1, a11);
        }
        if (rows > 2) {
            b = _mm256_broadcast_ss(x2 + k);
            a20 = _mm256_fmadd_ps(b, w0, a20);
            a21 = _mm256_fmadd_ps(b, w1, a21);
        }
        if (rows > 3) {
            b = _mm256_broadcast_ss(x3 + k);
            a30 = _mm256_fmadd_ps(b, w0, a30);
            a31 = _mm256_fmadd_ps(b, w1, a31);
        }
    }
    __m256 acc[4][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
    float tail[NBW];
    for (int r = 0; r < rows; ++r) {
        float *o = out + r * ldo;
        if (ncols == NBW) {
            _mm256_storeu_ps(o, acc[r][0]);
            _mm256_storeu_ps(o + 8, acc[r][1]);
        } else {
            _mm256_storeu_ps(tail, acc[r][0]);
            _mm256_storeu_ps(tail + 8, acc[r][1]);
            for (int64_t j = 0; j < ncols; ++j) o[j] = tail[j];
        }
    }
}

/* out [M, N] (row stride ldo) = x [M, K] (row stride ldx) times the weight packed [ceil(N/16), K, 16]. */
void mfp4_row_stream(const float *x, int64_t M, int64_t K, int64_t ldx, const float *wp, int64_t N,
                     float *out, int64_t ldo) {
    int64_t blocks = (N + NBW - 1) / NBW;
    for (int64_t b = 0; b < blocks; ++b) {
        const float *wb = wp + b * K * NBW;
        int64_t ncols = N - b * NBW < NBW ? N - b * NBW : NBW;
        for (int64_t m = 0; m < M; m += 4) {
            int rows = M - m < 4 ? (int)(M - m) : 4;
            block_rows(x + m * ldx, ldx, wb, K, out + m * ldo + b * NBW, ldo, ncols, rows);
        }
    }
}
"""
FLAGS = ("-O2", "-mavx2", "-mfma", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron_fp4"


def _compile(target: Path, compiler: str) -> None:
    """The library at ``target``: compiled in a temporary directory beside it, then renamed over it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".row_stream-") as tmp:
        src, lib = Path(tmp) / "row_stream.c", Path(tmp) / target.name
        src.write_text(SOURCE)
        subprocess.run([compiler, *FLAGS, "-o", str(lib), str(src)], check=True, capture_output=True,
                       timeout=COMPILE_TIMEOUT_S)
        os.replace(lib, target)


@functools.lru_cache(maxsize=None)
def _function():
    """The compiled ``mfp4_row_stream`` (a ctypes function), or None: not x86-64 Linux, no AVX2, no C
    compiler, or the compile or the load failed (logged)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        if not torch.cpu._is_avx2_supported():
            return None
    except AttributeError:
        return None
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return None
    digest = hashlib.sha256((SOURCE + " ".join(FLAGS)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"row_stream-{digest}.so"
    try:
        if not target.exists():
            _compile(target, compiler)
        fn = ctypes.CDLL(str(target)).mfp4_row_stream
    except (OSError, subprocess.SubprocessError) as err:
        log.info("megatron_fp4: the row-streaming GEMM is not built (%s); oneDNN serves every call", err)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64]
    fn.restype = None
    return fn


def available() -> bool:
    """Whether the kernel is compiled and loaded here (compiling it on the first ask)."""
    return _function() is not None


def stream_pack(w: torch.Tensor) -> torch.Tensor:
    """The row-major fp32 [N, K] weight ``w`` packed for :func:`stream_linear`: [ceil(N/16), K, 16],
    column block b holding columns 16b .. 16b+15 (zeros past N), each block contiguous."""
    N, K = w.shape
    blocks = -(-N // BLOCK)
    wp = w.new_zeros(blocks * BLOCK, K)
    wp[:N] = w
    return wp.view(blocks, BLOCK, K).transpose(1, 2).contiguous()


def stream_linear(x: torch.Tensor, wp: torch.Tensor, n: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` [M, K] (fp32 on CPU, each row contiguous) times the [n, K] weight packed as ``wp``
    (:func:`stream_pack`) into ``out`` [M, n] (each row contiguous; None: a fresh one), returned."""
    fn = _function()
    M, K = x.shape
    if fn is None:
        raise RuntimeError("megatron_fp4: the row-streaming GEMM is not available here (row_stream.available())")
    if x.dtype != torch.float32 or wp.dtype != torch.float32 or x.device.type != "cpu" or wp.device.type != "cpu" \
            or (K > 1 and x.stride(1) != 1) or not wp.is_contiguous() or wp.shape != (-(-n // BLOCK), K, BLOCK):
        raise ValueError(f"stream_linear: x {tuple(x.shape)} {x.dtype} stride {x.stride()} and a packed weight "
                         f"{tuple(wp.shape)} {wp.dtype} for {n} columns (want fp32 rows with unit stride and "
                         f"[{-(-n // BLOCK)}, {K}, {BLOCK}] from stream_pack)")
    out = x.new_empty(M, n) if out is None else out
    if out.shape != (M, n) or out.dtype != torch.float32 or out.device.type != "cpu" or (n > 1 and out.stride(1) != 1):
        raise ValueError(f"stream_linear: out {tuple(out.shape)} {out.dtype} stride {out.stride()} for [{M}, {n}] fp32")
    if M:
        fn(x.data_ptr(), M, K, x.stride(0), wp.data_ptr(), n, out.data_ptr(), out.stride(0))
    return out
