"""GPU checks of the numerics: the portable code on CUDA must give what it gives on CPU.

    python tools/gpu_check.py [--json results.json] [--quick]

1. Portable quantizers (NVFP4 row/tensor/2-D, MXFP4 floor/rceil; fp32 and bf16 input) on CUDA vs
   CPU: codes, block-scale bytes and global scales **bit-equal**.
2. MoEResQ linear on CUDA vs CPU (modes fp4, fp4_resq; forward, dgrad, wgrad): the quantized
   operands are bit-equal (same definition), so only GEMM accumulation order differs. With TF32
   off, fp32 GEMMs over K terms differ by about K·2^-24·Σ|a·b|; we allow max|Δ| ≤ 1e-4·max|y_cpu|
   (K ≤ 1024 here gives ≈ 6e-5 worst case, far less typically).
3. Transformer Engine NVFP4 quantizer vs ours (`integrations.transformer_engine`), when TE with
   NVFP4 (sm_100+) is available; otherwise reported as skipped with the reason.
4. MoEResQ under ``torch.autocast(dtype=bfloat16)`` on the device: forward and grads bit-equal to
   no autocast (the simulation keeps its fp32 GEMMs).
5. GC-MoE's SM split: one green context for compute (``num_sms - transfer_sms`` SMs) whose stream
   runs a GEMM (within the GEMM tolerance of 2.; cuBLAS may pick other kernels for fewer SMs), or
   skipped with the reason (torch without green contexts, CUDA < 12.8).
6. The main job (`python -m megatron_fp4.train`, tiny model) for 50 steps on the device, in fp32
   and in bf16 (autocast): exits 0 with a finite last loss.
7. Megatron-Core GPTModel with `get_moeresq_layer_spec` on the device: forward and backward, logits
   finite with finite expert grads, and in bf16 mode within the GEMM tolerance of the plain local spec
   (needs megatron-core; subprocess, since its parallel state is process-global).
8. Triton FP4 kernels (`fp4/triton_fp4.py`, `tools/gpu_check_triton.py`): every format, rounding,
   layout (rows, strided, columnwise, 16x16 tiles) and input dtype **bit-equal** to the portable
   quantizers; the same errors and deferred NaN flags; moeresq_linear through the dispatch hook
   bit-equal to the portable path; kernel time vs a copy of the same bytes. With ``--device cpu``
   they run under Triton's interpreter if ``TRITON_INTERPRET=1`` is set, else are skipped. (Sections
   2 and 4 run through the hook too: on CUDA the MoEResQ operands come from the kernels.)
9. Triton kernels of the ``batch`` numerics level (`fp4/triton_batch.py`, `tools/gpu_check_triton_batch.py`):
   fixed-tile GEMM (fp32, bf16), grouped GEMM over experts and fixed-key-block attention (causal,
   GQA, left padding, window + sinks) give a row **the same bits** alone, in any batch, at any place
   in a tile, and a decode step over the KV cache the bits of the causal prefill; each within its
   derived fp32 bound of float64 and of the portable `tiled` ops; autograd through them; kernel
   time vs torch.mm / grouped / SDPA at hidden 1024, 64 experts top-8 (printed, never asserted).
   ``--device cpu`` runs them under Triton's interpreter with ``TRITON_INTERPRET=1``, as section 8.

Exit status 0 when nothing failed (skips are fine), 1 otherwise; 0 with "no CUDA device" on a
machine without CUDA. Sized for well under 5 minutes on one H200 (seconds in practice).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_fp4.fp4 import Recipe, moeresq_linear, quantize_mxfp4, quantize_nvfp4  # noqa: E402
from megatron_fp4.fp4.moeresq import resq_quantize  # noqa: E402
from tools.gpu_check_triton import run as check_triton  # noqa: E402
from tools.gpu_check_triton_batch import run as check_triton_batch  # noqa: E402

RESULTS: list[dict] = []


def record(name: str, status: str, detail: str = "") -> None:
    RESULTS.append({"check": name, "status": status, "detail": detail})
    print(f"[{status:4}] {name}" + (f" — {detail}" if detail else ""), flush=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    if t.dtype.is_floating_point and t.element_size() == 4:
        return t.view(torch.int32)
    if t.element_size() == 1:
        return t.view(torch.uint8)
    return t


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def check_quantizers(dev: torch.device, shapes) -> None:
    gen = torch.Generator().manual_seed(0)
    variants = [
        ("nvfp4 row/1d", lambda x: quantize_nvfp4(x, scale="row", block="1d")),
        ("nvfp4 tensor/1d", lambda x: quantize_nvfp4(x, scale="tensor", block="1d")),
        ("nvfp4 tensor/2d", lambda x: quantize_nvfp4(x, scale="tensor", block="2d")),
        ("mxfp4 floor", lambda x: quantize_mxfp4(x, scale_mode="floor")),
        ("mxfp4 rceil", lambda x: quantize_mxfp4(x, scale_mode="rceil")),
    ]
    for shape in shapes:
        base = torch.randn(*shape, generator=gen) * torch.logspace(-3, 3, shape[-1])  # wide dynamic range
        base[0, :32] = 0.0  # an all-zero block
        for dtype in (torch.float32, torch.bfloat16):
            x = base.to(dtype)
            for name, fn in variants:
                label = f"quantizer {name} {tuple(shape)} {str(dtype).replace('torch.', '')} {dev.type}==cpu"
                try:
                    a, b = fn(x), fn(x.to(dev))
                    bad = [f for f, u, v in (("codes", a.codes, b.codes), ("block_scales", a.block_scales, b.block_scales),
                                            ("global_scale", a.global_scale, b.global_scale)) if not _same(u, v)]
                    record(label, "FAIL" if bad else "PASS", f"differs in {bad}" if bad else "bit-equal")
                except Exception as e:  # report and go on: one broken variant must not hide the rest
                    record(label, "FAIL", f"{type(e).__name__}: {e}")


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.detach().cpu().double() - ref.detach().double()).abs().max() / ref.detach().double().abs().max().clamp_min(1e-30))


def check_moeresq(dev: torch.device, tokens: int, k: int, n: int) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * 0.05
    dy = torch.randn(tokens, n, generator=gen)
    tol = 1e-4
    for mode in ("fp4", "fp4_resq"):
        recipe = Recipe(mode=mode)
        fmt = recipe.input
        same_operand = _same(resq_quantize(x, fmt, recipe.compensated), resq_quantize(x.to(dev), fmt, recipe.compensated))
        record(f"moeresq {mode}: quantized input operand {dev.type}==cpu", "PASS" if same_operand else "FAIL",
               "bit-equal" if same_operand else "operands differ")
        outs = []
        for d in (torch.device("cpu"), dev):
            xx = x.to(d).detach().clone().requires_grad_(True)
            ww = w.to(d).detach().clone().requires_grad_(True)
            y = moeresq_linear(xx, ww, recipe=recipe)
            y.backward(dy.to(d))
            outs.append((y, xx.grad, ww.grad))
        for name, ref, a in zip(("forward", "dgrad", "wgrad"), *outs):
            err = _rel_err(a, ref)
            record(f"moeresq {mode} {name} ({tokens}x{k}->{n}) {dev.type} vs cpu", "PASS" if err <= tol else "FAIL",
                   f"max|Δ|/max|ref| = {err:.2e} (tol {tol:.0e})")


def check_te(shapes) -> None:
    from megatron_fp4.integrations.transformer_engine import compare_with_portable, te_available

    cap = te_available()
    if not cap:
        record("transformer engine NVFP4 vs portable", "SKIP", cap.reason)
        return
    gen = torch.Generator().manual_seed(2)
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(*shape, generator=gen) * 4).to(dtype).cuda()
            label = f"TE NVFP4 vs portable {tuple(shape)} {str(dtype).replace('torch.', '')} ({cap.reason})"
            try:
                rep = compare_with_portable(x)
                detail = {k: rep[k] for k in ("mismatched_codes", "mismatched_block_scales", "global_scale_equal",
                                              "dequantized_equal")}
                record(label, "PASS" if rep["equal"] else "FAIL", json.dumps(detail))
            except Exception as e:
                record(label, "FAIL", f"{type(e).__name__}: {e}")


def check_autocast(dev: torch.device) -> None:
    gen = torch.Generator().manual_seed(3)
    x0, w0, gy = torch.randn(32, 256, generator=gen), torch.randn(128, 256, generator=gen), torch.randn(32, 128, generator=gen)
    outs = []
    for enabled in (False, True):
        x, w = x0.to(dev).requires_grad_(True), w0.to(dev).requires_grad_(True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=enabled):
            y = moeresq_linear(x, w, recipe=Recipe(mode="fp4_resq"))
            y.backward(gy.to(dev))
        outs.append((y, x.grad, w.grad))
    bad = [n for n, a, b in zip(("y", "dx", "dw"), *outs) if not _same(a, b)]
    record(f"moeresq under autocast bf16 on {dev.type} == without", "FAIL" if bad else "PASS",
           f"differs in {bad}" if bad else "bit-equal")


def check_green_context(dev: torch.device) -> None:
    if dev.type != "cuda":
        record("gcmoe green-context SM split", "SKIP", "needs CUDA")
        return
    from megatron_fp4.parallel.moe.gcmoe_transfer import _green_streams

    split = _green_streams(dev, 20)
    if split is None:
        record("gcmoe green-context SM split", "SKIP", "torch.cuda.green_contexts unsupported here (CUDA >= 12.8 build "
               "and driver needed); GC-MoE falls back to a plain side stream")
        return
    _, compute, _ = split
    a = torch.randn(1024, 1024, device=dev)
    ref = a @ a
    with torch.cuda.stream(compute):
        got = a @ a
    torch.cuda.synchronize()
    err = _rel_err(got, ref.cpu())
    total = torch.cuda.get_device_properties(dev).multi_processor_count
    record(f"gcmoe compute green context ({total - 20} of {total} SMs) runs a GEMM", "PASS" if err <= 1e-4 else "FAIL",
           f"max|Δ|/max|ref| = {err:.2e}")


def _subprocess(args: list[str], timeout: int) -> tuple[int, str]:
    import subprocess
    env = dict(__import__("os").environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    try:
        p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)
        return p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout}s"


def check_train(dev: torch.device, steps: int) -> None:
    import re
    for dtype in ("fp32", "bf16"):
        label = f"main job {steps} steps on {dev.type} ({dtype})"
        rc, out = _subprocess(["-m", "megatron_fp4.train", "--steps", str(steps), "--set", f"device={dev.type}",
                               "--set", f"dtype={dtype}"], timeout=240)
        losses = [float(v) for v in re.findall(r"(?:loss|->) ([-+0-9.eE]+|nan|inf)", out)]
        ok = rc == 0 and losses and all(map(lambda v: v == v and abs(v) != float("inf"), losses[-1:]))
        record(label, "PASS" if ok else "FAIL", f"rc={rc}, last loss {losses[-1] if losses else None}"
               + ("" if ok else f"; tail: {out[-300:]!r}"))


_MCORE_SCRIPT = """
import json, os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29611")
dist.init_process_group("nccl", rank=0, world_size=1); torch.cuda.set_device(0)
from megatron.core import parallel_state, tensor_parallel
parallel_state.initialize_model_parallel(); tensor_parallel.model_parallel_cuda_manual_seed(0)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron_fp4.config import Config
from megatron_fp4.integrations.megatron_core import (build_transformer_config, get_moeresq_layer_spec,
                                                     name_moeresq_linears, split_megatron_kwargs, to_megatron_transformer_config)
res = {}
for mode in ("fp4_resq", "bf16"):
    cfg = Config(); cfg.model.num_layers, cfg.model.dense_layers = 3, [0]; cfg.fp4.train_mode = mode
    tc = build_transformer_config(cfg, use_cpu_initialization=True, moe_token_dispatcher_type="allgather",
                                  attention_dropout=0.0, hidden_dropout=0.0)
    _, kw = split_megatron_kwargs(to_megatron_transformer_config(cfg))
    torch.manual_seed(0); gpt = GPTModel(config=tc, transformer_layer_spec=get_moeresq_layer_spec(tc, cfg), **kw)
    torch.manual_seed(0); plain = GPTModel(config=tc, transformer_layer_spec=get_gpt_decoder_block_spec(tc, False), **kw)
    name_moeresq_linears(gpt); gpt.cuda(); plain.cuda()
    tok = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)).cuda()
    pos = torch.arange(16, device="cuda").expand(2, 16)
    mask = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool, device="cuda"), 1)
    logits = gpt(tok, pos, mask); logits.float().logsumexp(-1).mean().backward()
    g = [p.grad for n, p in gpt.named_parameters() if "local_experts" in n and p.grad is not None]
    res[mode] = dict(finite=bool(torch.isfinite(logits).all()), grads=len(g) > 0 and all(bool(torch.isfinite(x).all()) for x in g),
                     rel_vs_plain=float((logits - plain(tok, pos, mask)).abs().max() / logits.abs().max()))
print("RESULT " + json.dumps(res))
"""


def check_megatron_spec(dev: torch.device) -> None:
    import importlib.util
    if dev.type != "cuda":
        record("megatron-core GPTModel with MoEResQ experts", "SKIP", "needs CUDA (CPU: tests/unit/test_integration_megatron_core_spec.py)")
        return
    if importlib.util.find_spec("megatron") is None:
        record("megatron-core GPTModel with MoEResQ experts", "SKIP", "megatron-core not installed")
        return
    rc, out = _subprocess(["-c", _MCORE_SCRIPT], timeout=240)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if rc != 0 or not lines:
        record("megatron-core GPTModel with MoEResQ experts", "FAIL", f"rc={rc}; tail: {out[-400:]!r}")
        return
    res = json.loads(lines[-1][7:])
    for mode, r in res.items():
        # bf16 mode is F.linear where mcore calls matmul: same GEMM up to cuBLAS kernel choice (tolerance of 2.)
        ok = r["finite"] and r["grads"] and (mode != "bf16" or r["rel_vs_plain"] <= 1e-4)
        record(f"megatron-core GPTModel MoEResQ spec fwd/bwd on cuda ({mode})", "PASS" if ok else "FAIL", json.dumps(r))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the results to this JSON file")
    ap.add_argument("--quick", action="store_true", help="smaller shapes")
    ap.add_argument("--device", default="cuda",
                    help="device to compare against the CPU (default cuda; 'cpu' only dry-runs this script)")
    args = ap.parse_args(argv)
    RESULTS.clear()
    dev = torch.device(args.device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device: nothing to check here (run tools/gpu_check.py on a GPU machine)")
            return 0
        print(f"device: {torch.cuda.get_device_name(dev)} (sm_{''.join(map(str, torch.cuda.get_device_capability(dev)))})"
              f", torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    else:
        print(f"dry run on {dev} (compares {dev} with cpu: checks the script, not a GPU)", flush=True)
    start = time.time()
    shapes = [(64, 256)] if args.quick else [(64, 256), (512, 1024)]
    check_quantizers(dev, shapes)
    check_moeresq(dev, *((64, 256, 128) if args.quick else (256, 1024, 512)))
    check_triton(dev, record, args.quick)
    check_triton_batch(dev, record, args.quick)
    check_te(shapes)
    check_autocast(dev)
    check_green_context(dev)
    check_megatron_spec(dev)
    check_train(dev, 5 if args.quick else 50)
    counts = {s: sum(r["status"] == s for r in RESULTS) for s in ("PASS", "FAIL", "SKIP")}
    print(f"\nsummary: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
          f"in {time.time() - start:.1f}s")
    for r in RESULTS:
        if r["status"] == "FAIL":
            print(f"  FAILED: {r['check']} — {r['detail']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": RESULTS, "counts": counts}, indent=2) + "\n")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
