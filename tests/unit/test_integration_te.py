"""Transformer Engine backend: capability check, errors, and the storage conversion on CPU.

The TE-vs-portable bit comparison itself needs Transformer Engine and a Blackwell GPU; it is
skipped here and run by tools/gpu_check.py on such a machine.
"""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.fp4 import quantize_nvfp4
from megatron_fp4.integrations.transformer_engine import (compare_fp4_tensors, compare_with_portable,
                                                          fp4_tensor_from_te_storage, global_decode_scale,
                                                          te_available, te_quantize_nvfp4)

CAP = te_available()


def test_capability_is_false_with_a_reason_here():
    if CAP:
        pytest.skip(f"Transformer Engine NVFP4 is available here: {CAP.reason}")
    assert not CAP and CAP.ok is False
    assert isinstance(CAP.reason, str) and CAP.reason


@pytest.mark.skipif(bool(CAP), reason="TE is available; the unavailable-path error is not reachable")
def test_te_path_raises_clear_error_when_unavailable():
    with pytest.raises(RuntimeError, match="Transformer Engine NVFP4 backend unavailable.*quantize_nvfp4"):
        te_quantize_nvfp4(torch.randn(16, 32))
    with pytest.raises(RuntimeError, match="unavailable"):
        compare_with_portable(torch.randn(16, 32))


def _te_like_storage(x: torch.Tensor, row_pad: int = 128, col_pad: int = 4):
    """What TE's NVFP4Tensor holds for x, made from our quantizer: packed uint8 codes, E4M3 scale
    bytes padded to (multiple of 128 rows, multiple of 4 columns) with garbage, the global amax."""
    q = quantize_nvfp4(x, scale="tensor", block="1d")
    m, n = x.reshape(-1, x.shape[-1]).shape
    data = q.pack().view(torch.uint8).reshape(m, n // 2)
    rows, cols = -(-m // row_pad) * row_pad, -(-(n // 16) // col_pad) * col_pad
    scales = torch.full((rows, cols), 0x7E, dtype=torch.uint8)  # padding must be ignored
    scales[:m, : n // 16] = q.block_scales.reshape(m, n // 16).view(torch.uint8)
    return q, data, scales, x.abs().amax().reshape(1).float()


@pytest.mark.parametrize("shape", [(16, 32), (3, 5, 48), (130, 16)])
def test_storage_conversion_recovers_our_tensor_bitwise(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 3
    q, data, scales, amax = _te_like_storage(x)
    got = fp4_tensor_from_te_storage(data, scales, amax, x.shape)
    report = compare_fp4_tensors(q, got)
    assert report["equal"] and report["dequantized_equal"], report


def test_global_decode_scale_matches_our_definition():
    for x in (torch.randn(32, 64), torch.zeros(16, 16), torch.full((16, 16), 3e38)):
        assert torch.equal(global_decode_scale(x.abs().amax()).view(torch.int32),
                           quantize_nvfp4(x, scale="tensor").global_scale.view(torch.int32))


def test_comparison_reports_differences():
    x = torch.randn(16, 32)
    q, data, scales, amax = _te_like_storage(x)
    data = data.clone()
    data[0, 0] ^= 0x01  # flip one code bit
    report = compare_fp4_tensors(q, fp4_tensor_from_te_storage(data, scales, amax, x.shape))
    assert not report["equal"] and report["mismatched_codes"] == 1 and report["block_scales_equal"]


@pytest.mark.skipif(not CAP, reason=f"needs Transformer Engine with NVFP4 on a sm_100+ GPU ({CAP.reason})")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_te_matches_portable_quantizer(dtype):
    x = (torch.randn(256, 512, generator=torch.Generator().manual_seed(1)) * 4).to(dtype).cuda()
    report = compare_with_portable(x)
    assert report["equal"], report


def test_gpu_check_script_runs_here(capsys):
    """tools/gpu_check.py imports and exits cleanly without CUDA; its CPU dry run passes."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    if not torch.cuda.is_available():
        assert gpu_check.main([]) == 0
        assert "no CUDA device" in capsys.readouterr().out
    assert gpu_check.main(["--device", "cpu", "--quick"]) == 0
    assert "0 failed" in capsys.readouterr().out
