"""The ``batch`` level's Triton kernels (fp4/triton_batch.py, fp4/triton_batch_kernels.py).

No GPU here: the kernels run under Triton's interpreter, chosen when triton is imported, so the
checks run in one child process started with ``TRITON_INTERPRET=1``: the GPU check's own section
(``tools/gpu_check_triton_batch.py``, shapes that still cross every tile and key-block boundary)
plus the model-level entry points, reported as JSON. What they establish:

- batch invariance, bitwise: a GEMM row alone == among other rows == permuted into other tiles
  and places; a grouped GEMM's run == the dense kernel on that run alone; an attention query in a
  decode step over the KV cache == in the causal prefill == in its own unpadded prefill (causal,
  GQA, left padding; window + sinks). It holds by construction (one tile configuration per
  dtype, no split-K, keys in fixed position blocks; see triton_batch_kernels.py);
- agreement with float64 and with the portable ``tiled`` ops within the bounds derived in
  tools/gpu_check_triton_batch.py (fp32 accumulation: γ(K)·Σ|x·w| style);
- that the checks can fail: a GEMM whose BLOCK_K is chosen from M, and an attention whose KV
  split size is chosen from the query count, are caught;
- autograd: the kernels' forward with tiled.py's backward (GEMM gradients bitwise equal).

The compiled GPU code is checked here only for compiling (sm_90, no device needed) with tensor-core
MMAs for bf16; its bits on a GPU are gpu_check.py's section 9.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_fp4.fp4 import Numerics, invariant, tiled, triton_batch
from megatron_fp4.fp4.triton_fp4 import triton_importable

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(not triton_importable()[0], reason=triton_importable()[1])

_CHILD = r"""
import json, warnings
import torch
warnings.simplefilter("ignore", RuntimeWarning)
from megatron_fp4.fp4 import Numerics, invariant, tiled, triton_batch
from tools.gpu_check_triton_batch import run

results = []
def record(name, status, detail=""):
    results.append({"check": name, "status": status, "detail": detail})

run(torch.device("cpu"), record, quick=True, speed=False, model=False)

# The model's entry points (fp4/invariant.py) at the batch level with Numerics.triton="interpret":
# the kernels serve (launch count), with "off" the portable tiled ops do (tiled.py's bits).
g = torch.Generator().manual_seed(3)
x, w = torch.randn(20, 40, generator=g), torch.randn(24, 40, generator=g)
on, off = Numerics(invariance="batch", triton="interpret"), Numerics(invariance="batch", triton="off")
n = triton_batch.launches()
y_on = invariant.linear(x, w, None, on)
served = triton_batch.launches() == n + 1
y_off = invariant.linear(x, w, None, off)
record("entry: invariant.linear serves the kernel under triton=interpret, tiled under off", "PASS" if (
    served and torch.equal(y_on, triton_batch.gemm(x, w)) and torch.equal(y_off, tiled.tiled_linear(x, w))
    and triton_batch.launches() == n + 1) else "FAIL")
q, k, v = (torch.randn(1, 2, 5, 16, generator=g) for _ in range(3))
pos, pad = torch.arange(5)[None], torch.zeros(1, dtype=torch.long)
n = triton_batch.launches()
a_on = invariant.attention(q, k, v, pos, pad, on)
record("entry: invariant.attention serves the kernel", "PASS" if (
    triton_batch.launches() == n + 1 and torch.equal(a_on, triton_batch.attention_forward(q, k, v, pos, pad)[0]))
    else "FAIL")
ws = [torch.randn(24, 40, generator=g) for _ in range(3)]
n = triton_batch.launches()
gl = invariant.grouped_linear(x, ws, [7, 0, 13], on)
record("entry: invariant.grouped_linear serves the kernel", "PASS" if (
    triton_batch.launches() == n + 1 and torch.equal(gl[7:], triton_batch.gemm(x[7:], ws[2]))) else "FAIL")
with torch.autocast("cpu", dtype=torch.bfloat16):  # as torch.mm under autocast: bf16 operands, bf16 out
    y_ac = invariant.linear(x, w, None, on)
record("entry: invariant.linear under autocast takes the autocast dtype", "PASS" if (
    y_ac.dtype == torch.bfloat16 and torch.equal(y_ac, triton_batch.gemm(x.bfloat16(), w.bfloat16()))) else "FAIL")
# A failed launch raises (naming numerics.triton: off) and does not switch the process to the
# portable ops: the next call serves the kernel again (no process-wide state decides a GEMM).
real_gemm = triton_batch.gemm
def broken_gemm(*a, **kw):
    raise RuntimeError("simulated compiler failure")
triton_batch.gemm = broken_gemm
try:
    invariant.linear(x, w, None, on)
    raised = ""
except triton_batch.TritonBatchLaunchError as err:
    raised = str(err)
finally:
    triton_batch.gemm = real_gemm
n = triton_batch.launches()
y_again = invariant.linear(x, w, None, on)
record("entry: a failed launch raises, naming the fix, and the next call serves the kernel", "PASS" if (
    "simulated compiler failure" in raised and "numerics.triton: off" in raised
    and triton_batch.launches() == n + 1 and torch.equal(y_again, y_on)) else "FAIL", raised[:200])
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def interpreted():
    """{check name: (status, detail)} from one interpreter child."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert p.returncode == 0 and lines, f"child failed (rc={p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return {r["check"]: (r["status"], r["detail"]) for r in json.loads(lines[-1][8:])}


CHECKS = {  # what each group of the child's checks shows: (a pattern of their names, how many)
    "GEMM rows are batch invariant": (r"^triton batch gemm (float32|bfloat16) .*do not depend on its batch", 2),
    "a grouped run is the dense kernel on it alone": (r"^triton batch grouped gemm .*dense kernel on it alone", 2),
    "attention: decode == prefill == the row alone": (r"^triton batch attention (float32|bfloat16) .*decode == prefill", 3),
    "within the derived bounds": (r"within (the|twice the) bound", 2 * 2 + 2 + 3 + 2),
    "a GEMM tile chosen from M is caught": (r"chosen from M: the invariance check catches it", 1),
    "a KV split chosen from Tq is caught": (r"KV split chosen from Tq: the decode == prefill check catches it", 1),
    "autograd: kernel forward, tiled backward": (r"with autograd", 3),
    "the model's entry points serve the kernels": (r"^entry: ", 5),
}


@needs_triton
@pytest.mark.parametrize("what", list(CHECKS))
def test_interpreted_checks(interpreted, what):
    pattern, count = CHECKS[what]
    picked = {k: v for k, v in interpreted.items() if re.search(pattern, k)}
    assert len(picked) == count, (pattern, sorted(picked))
    bad = {k: v for k, v in picked.items() if v[0] != "PASS"}
    assert not bad, bad


@needs_triton
def test_every_interpreted_check_passed(interpreted):
    assert not {k: v for k, v in interpreted.items() if v[0] != "PASS"}
    assert len(interpreted) == sum(count for _, count in CHECKS.values())


def test_cpu_tensors_take_the_portable_ops():
    """Without the interpreter (this process), the batch level on CPU is tiled.py's, whatever the mode."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(20, 40, generator=g), torch.randn(24, 40, generator=g)
    for mode in ("auto", "off") if triton_batch._interpreting() else ("auto", "interpret", "off"):
        nx = Numerics(invariance="batch", triton=mode)
        assert torch.equal(invariant.linear(x, w, None, nx), tiled.tiled_linear(x, w))
    assert not triton_batch.serves("auto", x, w)
    with pytest.raises(ValueError, match="not one of"):
        triton_batch.serves("fast", x, w)


@needs_triton
def test_kernels_compile_for_sm90_with_tensor_cores():
    """Compile for sm_90 without a device: every kernel compiles (the interpreter is laxer than the
    compiler), bf16 products on tensor cores (wgmma), fp32 ones as IEEE FMAs (no TF32)."""
    if triton_batch._interpreting():
        pytest.skip("this process runs Triton's interpreter")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = triton_batch.kernels()
    for dt, bf in (("*fp32", False), ("*bf16", True)):
        bm, bn, bk, warps, stages = triton_batch.GEMM_CONFIG[torch.bfloat16 if bf else torch.float32]
        sig = {"x_ptr": dt, "w_ptr": dt, "out_ptr": "*i16" if bf else "*fp32",
               **{n: "i32" for n in ("M", "N", "K", "sxm", "sxk", "swn", "swk", "som")}}
        const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION="ieee", OUT_BF16=bf, UPCAST=False)
        src = ASTSource(k.gemm_kernel, {**sig, **{n: "constexpr" for n in const}}, constexprs=const)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False}).asm["ptx"]
        if bf:
            assert "wgmma.mma_async" in ptx
        else:
            assert "wgmma" not in ptx and "fma.rn.f32" in ptx and "tf32" not in ptx
