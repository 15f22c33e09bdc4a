"""bench_transposed_copy.py: its generation part computes with and without the transposed copies
(the same tokens and log-prob bits: it asserts them) and puts the process's plans back, with
``--flag tall`` also the scoring of the generated sequences; its GEMM part times both operands at
every shape and height."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_transposed_copy as bench  # noqa: E402

from megatron_fp4.fp4 import row_calls  # noqa: E402


def test_generation_with_and_without_the_copies_gives_the_same_bits_and_restores_the_plans(capsys):
    bench.main(["--only", "generate", "--hidden", "128", "--ffn", "256", "--layers", "1", "--vocab", "256",
                "--batch", "3", "--prompt-len", "5", "--new-tokens", "3", "--repeats", "1", "--modes", "bf16"])
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| bf16 |")]
    plans = dict(row_calls._PLANS)  # as the machine's probes gave them again (the view-only table was swapped out)
    kept = sorted(f"[{k[1]}, {k[0]}]" for k, p in plans.items() if p.transposed_copy)
    assert row.rstrip(" |").endswith(", ".join(kept) or "—")
    assert any(k[:2] == (128, 512) for k in plans)  # the model's w13 was planned


def test_generation_with_and_without_batched_runs_gives_the_same_bits(capsys):
    bench.main(["--only", "generate", "--flag", "batched", "--hidden", "64", "--ffn", "128", "--layers", "1",
                "--vocab", "256", "--batch", "4", "--prompt-len", "5", "--new-tokens", "3", "--repeats", "1",
                "--modes", "bf16"])
    out = capsys.readouterr().out
    assert "| mode (`batch`) | part | per run ms | batched ms | batched ÷ per run | weights with `batched` |" in out
    (row,) = [line for line in out.splitlines() if line.startswith("| bf16 |")]
    kept = sorted(f"[{k[1]}, {k[0]}]" for k, p in row_calls._PLANS.items() if p.batched)
    assert row.rstrip(" |").endswith(", ".join(kept) or "—")


def test_generation_and_scoring_with_and_without_tall_calls_give_the_same_bits(capsys):
    bench.main(["--only", "generate", "--flag", "tall", "--hidden", "512", "--ffn", "512", "--layers", "1",
                "--experts", "4", "--heads", "8", "--kv-heads", "2", "--vocab", "512", "--batch", "3",
                "--prompt-len", "40", "--new-tokens", "2", "--repeats", "2", "--modes", "bf16"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| bf16 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["generation", "scoring"]
    kept = sorted(f"[{k[1]}, {k[0]}]" for k, p in row_calls._PLANS.items() if p.dense)
    assert all(row.rstrip(" |").endswith(", ".join(kept) or "—") for row in rows)
    assert not row_calls._onednn_usable() or kept  # [512, 512] and wider: oneDNN's plans, heights past the probed ones


def test_generation_and_scoring_in_place_and_padded_give_the_same_bits(capsys):
    """``--flag in_place``: the padded layout (``tiled.IN_PLACE_ROWS`` raised) against grouped runs read
    in place, generation and a scoring pass of more than IN_PLACE_ROWS expert rows, the same bits
    (the benchmark asserts them); the threshold is put back."""
    from megatron_fp4.fp4 import tiled
    before = tiled.IN_PLACE_ROWS
    bench.main(["--only", "generate", "--flag", "in_place", "--hidden", "512", "--ffn", "512", "--layers", "1",
                "--experts", "4", "--heads", "8", "--kv-heads", "2", "--vocab", "512", "--batch", "3",
                "--prompt-len", "60", "--new-tokens", "2", "--repeats", "2", "--modes", "bf16"])
    out = capsys.readouterr().out
    assert "| mode (`batch`) | part | padded layout ms | in place ms | in place ÷ padded layout |" in out
    rows = [line for line in out.splitlines() if line.startswith("| bf16 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["generation", "scoring"]
    kept = sorted(f"[{k[1]}, {k[0]}]" for k, p in row_calls._PLANS.items() if p.kernel == "onednn")
    assert all(row.rstrip(" |").endswith(", ".join(kept) or "—") for row in rows)
    assert tiled.IN_PLACE_ROWS == before


def test_generation_with_and_without_the_row_streaming_kernel_gives_the_same_bits(capsys):
    """``--flag stream``: oneDNN's calls against the row-streaming kernel for a decode step's few rows
    (where this machine's probe kept it, one thread), the same tokens and log-prob bits (asserted by
    the benchmark); the rows name the weights whose plans have it."""
    from megatron_fp4.fp4 import row_stream
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bench.main(["--only", "generate", "--flag", "stream", "--hidden", "512", "--ffn", "512", "--layers", "1",
                    "--experts", "4", "--heads", "8", "--kv-heads", "2", "--vocab", "512", "--batch", "3",
                    "--prompt-len", "20", "--new-tokens", "3", "--repeats", "2", "--modes", "bf16"])
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert "| mode (`batch`) | part | oneDNN calls ms | row-streaming ms | row-streaming ÷ oneDNN calls |" in out
    rows = [line for line in out.splitlines() if line.startswith("| bf16 |")]
    kept = sorted(f"[{k[1]}, {k[0]}]" for k, p in row_calls._PLANS.items() if p.stream)
    assert len(rows) == 1 and rows[0].rstrip(" |").endswith(", ".join(kept) or "—")
    assert not kept or (row_calls._onednn_usable() and row_stream.available())  # kept only where the probe agreed


def test_the_gemm_rows_time_both_operands():
    with torch.inference_mode():
        rows = bench.gemm_rows([4, 8], mib=0.5, repeats=1)
    assert [(shape, h) for shape, h, *_ in rows] == [(f"[{n}, {k}]", h) for n, k in bench.SHAPES for h in (4, 8)]
    assert all(view > 0 and copy > 0 and isinstance(bitwise, bool) for _, _, view, copy, bitwise in rows)
