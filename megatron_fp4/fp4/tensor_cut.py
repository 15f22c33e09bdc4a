"""FP4 on a linear that tensor parallelism cut: which operand's amax spans the cut, and its reduction.

A column-parallel linear holds rows ``[r·out/tp, (r+1)·out/tp)`` of ``W`` (out, in) and sees its
whole input; a row-parallel one holds columns ``[r·in/tp, (r+1)·in/tp)`` and sees that slice of
the input's features. Each 2-D quantizer input of the MoEResQ linear (``moeresq.py``) is then a
slice of the single process's operand, cut along its rows or its columns (the last dim, where the
blocks run):

    operand (quantizer input)             column-parallel        row-parallel
    weight        W (out, in)             rows                   columns
    input         X (tokens, in)          -                      columns
    grad_output   dY (tokens, out)        columns                -
    grad_output   dYᵀ (out, tokens)       rows                   -
      (columnwise, wgrad)
    input         Xᵀ (in, tokens)         -                      rows
      (columnwise, wgrad)

A slice quantizes to the single process's codes and scales when (1) its blocks lie inside it: the
local size along a cut last dim is a multiple of the block (1×16 NVFP4, 1×32 MXFP4), and along cut
rows a multiple of 16 for NVFP4's 16×16 tiles (`TensorCut.check`); and (2) every amax that spans
the cut is the whole tensor's: NVFP4's per-tensor global amax on either cut, its per-row amax on
a column cut. `TensorCut.reducer` gives that max over the group (``reduce_max``), applied to
``Q(x)``'s amax and again to the residual ``x − Q(x)``'s, forward and backward. MXFP4 has no
global scale: its blocks are local once aligned. The GEMM partial sums then add the single
process's products in another order (the tensor-parallel all-reduce), so a cut linear equals the
single process up to sum order (``tests/distributed/test_tensor_parallel_fp4.py``).

Not layout-invariant: stochastic rounding (a slice draws its own stream, as under expert
parallelism) and the batch-invariant exact GEMMs (refused: a partial sum cannot be rounded once).
The module knows no process group: ``reduce_max`` is the caller's collective
(``parallel/tp_comm.all_reduce_max`` over the tp group), so every rank must quantize the same
operands in the same order; a cached ``Q(W)`` (``Numerics.cached_weights``) is reused only while
the local shard's version is unchanged, which holds on every rank together as long as the
optimizer steps all shards at once (every tensor-parallel trainer does).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from megatron_fp4.fp4.recipe import OperandFormat, Recipe

KINDS = ("column", "row")
_CUT = {  # operand -> which dim of its 2-D quantizer input the cut runs along (None: whole)
    "column": {"weight": "rows", "input": None, "grad_output": "cols",
               "grad_output (columnwise)": "rows", "input (columnwise)": None},
    "row": {"weight": "cols", "input": "cols", "grad_output": None,
            "grad_output (columnwise)": None, "input (columnwise)": "rows"},
}


@dataclass(frozen=True)
class TensorCut:
    """How tensor parallelism cut one FP4 linear (``kind``: column | row, over ``size`` ranks) and the
    group's element-wise max (``reduce_max``: tensor -> tensor, no gradient)."""

    kind: str
    size: int
    reduce_max: Callable = field(compare=False, repr=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"TensorCut.kind={self.kind!r} is not one of {KINDS}")
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"TensorCut.size={self.size!r} must be a positive int")

    def cut_dim(self, operand: str) -> Optional[str]:
        """'rows', 'cols' or None: where the cut runs through ``operand``'s quantizer input."""
        base = operand.split(" segment ")[0]  # wgrad runs ("... (columnwise) segment i") cut alike
        if base not in _CUT[self.kind]:
            raise ValueError(f"TensorCut: unknown operand {operand!r}")
        return _CUT[self.kind][base]

    def reducer(self, fmt: OperandFormat, operand: str) -> Optional[Callable]:
        """``reduce_max`` where ``fmt``'s global amax of ``operand`` spans the cut, else None."""
        dim = self.cut_dim(operand)
        if dim is None or fmt.format != "nvfp4":
            return None
        return self.reduce_max if fmt.scale == "tensor" or dim == "cols" else None

    def check(self, recipe: Recipe, out_local: int, in_local: int, name: str) -> None:
        """Raise unless every quantized operand's blocks lie inside this rank's slice (local weight
        ``out_local`` × ``in_local``)."""
        if not recipe.quantized:
            return
        operands = [("weight", recipe.weight), ("input", recipe.input), ("input (columnwise)", recipe.input)]
        if recipe.quantize_backward:
            operands += [("grad_output", recipe.grad_output), ("grad_output (columnwise)", recipe.grad_output)]
        for operand, fmt in operands:
            dim = self.cut_dim(operand)
            # the cut dim counts output features (W rows, dY) or input features (W columns, X)
            is_out = operand.startswith("grad_output") or (operand == "weight" and dim == "rows")
            local, feat = (out_local, "output") if is_out else (in_local, "input")
            need = fmt.block_size if dim == "cols" else 16 if dim == "rows" and fmt.block == "2d" else 1
            if local % need:
                raise ValueError(
                    f"{name}: FP4 under tensor parallel {self.size} ({self.kind}-parallel) leaves {local} {feat} "
                    f"features per rank, not a multiple of the {fmt.format} block ({need}) of its {operand}: "
                    f"its blocks would straddle ranks; choose sizes whose per-rank share is a multiple of {need} "
                    "or keep FP4 off this layer")
