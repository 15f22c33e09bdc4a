"""How the compiled fake-quant path (``fused.py``) serves the reference quantizers without them importing it.

``nvfp4.py`` and ``mxfp4.py`` ask their module global ``fused`` (``fused.use_fused(...)``, then
``fused.fake_quantize_*_fused(...)``). It starts as :data:`NONE`, no compiled path (the eager
reference runs), and ``fused.py`` installs itself there when it is imported, which ``fp4/__init__``
does: the accelerator imports the reference and registers itself, never the other way round (no
import circle).
"""
from __future__ import annotations


class _NoCompiledPath:
    """Before ``fused.py`` is installed: every call runs the eager reference."""

    @staticmethod
    def use_fused(x, rounding: str, mode: str | None = None, kernels=None) -> bool:
        return False


NONE = _NoCompiledPath()
