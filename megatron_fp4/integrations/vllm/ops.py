"""Out-of-tree vLLM custom ops of the `megatron_fp4` plugin: vLLM's norms and SiLU as the trainer's.

`register_ops()` (from `plugin.register`, in every vLLM process) registers `TrainerRMSNorm` for
vLLM's `RMSNorm` (`CustomOp.register_oot`): every RMSNorm vLLM builds from then on is this class.
In a model served with the plugin (the `megatron_fp4` quantization config current at build time)
it computes the trainer's `model.layers.RMSNorm` in the plugin's numerics mode (the batch-invariant
mean square when the recipe block asks for it), and vLLM's fused residual add as the trainer's
``h + f(h)``; any other model keeps vLLM's own kernels. Found by comparing the two sides op by op
(`benchmarks/bench_vllm_goals.py --only layers`): vLLM's RMSNorm was the first op whose bits differ
from the trainer's (q_norm, ~5e-7 in fp32). RoPE and attention are not ops here: `get_rope` shares
one rotary instance between all models of a process with equal parameters, so a build-time switch
like this one would leak into stock models; the plugin's model class (model.py) replaces them per
layer instead. `TrainerSiluAndMul` likewise makes vLLM's `SiluAndMul` (dense and shared-expert MLPs)
the trainer's SwiGLU activation in plugin models. In the plugin's model class each is one opaque op
under vLLM's torch.compile (opaque.py), so the compiled engine computes the eager engine's bits.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm

from megatron_fp4.fp4 import invariant
from megatron_fp4.integrations.vllm import opaque
from megatron_fp4.model.layers import RMSNorm as _Trainer


def _plugin_config():
    from vllm.config import get_current_vllm_config

    from megatron_fp4.integrations.vllm.quant import MegatronFP4Config

    qc = getattr(get_current_vllm_config(), "quant_config", None)
    return qc if isinstance(qc, MegatronFP4Config) else None


class TrainerRMSNorm(RMSNorm):
    """vLLM's RMSNorm; computed as the trainer's RMSNorm in a model served with the plugin."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        own = self.has_weight and self.variance_size_override is None
        self.mfp4_config = _plugin_config() if own else None
        self.mfp4_key = None  # set by the plugin's model class: the norm is then one opaque op (opaque.py)

    def mfp4_opaque(self):
        """(eager function, shape function) of the norm for `opaque.make_layers_opaque` (None: vLLM's)."""
        if self.mfp4_config is None:
            return None
        return self._norm, lambda x: [opaque.like(x, dtype=torch.promote_types(x.dtype, self.weight.dtype))]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            raise NotImplementedError(opaque.OUTSIDE_MODEL.format(what="an RMSNorm"))
        # the trainer's forward on vLLM's weight in the plugin's numerics (one numeric definition)
        return _Trainer.forward(SimpleNamespace(eps=self.variance_epsilon, weight=self.weight,
                                                numerics=self.mfp4_config.values), x)

    def _trainer(self, x: torch.Tensor, residual: Optional[torch.Tensor]):
        if residual is not None:  # vLLM's fused add: the trainer's h = h + f(h), then the norm of h
            x = residual + x
            residual = x
        out = self._norm(x) if self.mfp4_key is None else opaque.call(self.mfp4_key, x)[0]
        return out if residual is None else (out, residual)

    def forward_native(self, x, residual=None):
        return super().forward_native(x, residual) if self.mfp4_config is None else self._trainer(x, residual)

    def forward_cpu(self, x, residual=None):
        return super().forward_cpu(x, residual) if self.mfp4_config is None else self._trainer(x, residual)

    def forward_cuda(self, x, residual=None):
        return super().forward_cuda(x, residual) if self.mfp4_config is None else self._trainer(x, residual)

    def forward_xpu(self, x, residual=None):
        return super().forward_xpu(x, residual) if self.mfp4_config is None else self._trainer(x, residual)


class TrainerSiluAndMul(SiluAndMul):
    """vLLM's SiluAndMul (the dense and shared-expert MLPs); in a model served with the plugin the
    trainer's SwiGLU activation ``invariant.silu(gate) * up`` in the plugin's numerics mode, one
    opaque op: under vLLM's torch.compile vLLM's own would be inductor's code, not ATen's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mfp4_config = _plugin_config()
        self.mfp4_key = None  # set by the plugin's model class (opaque.py)

    def mfp4_opaque(self):
        if self.mfp4_config is None:
            return None
        return self._trainer, lambda x: [opaque.like(x, x.shape[-1] // 2)]

    def _trainer(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return invariant.silu(x[..., :d], self.mfp4_config.values) * x[..., d:]

    def forward_native(self, x):
        if self.mfp4_config is None:
            return SiluAndMul.forward_native(x)
        if self.mfp4_key is None:
            if torch.compiler.is_compiling():
                raise NotImplementedError(opaque.OUTSIDE_MODEL.format(what="a SiluAndMul"))
            return self._trainer(x)
        return opaque.call(self.mfp4_key, x)[0]

    def forward_cpu(self, x):
        return super().forward_cpu(x) if self.mfp4_config is None else self.forward_native(x)

    def forward_cuda(self, x):
        return super().forward_cuda(x) if self.mfp4_config is None else self.forward_native(x)

    def forward_xpu(self, x):
        return super().forward_xpu(x) if self.mfp4_config is None else self.forward_native(x)


def register_ops() -> None:
    """Register the plugin's out-of-tree ops once per process (idempotent)."""
    from vllm.model_executor.custom_op import op_registry_oot

    for op in (TrainerRMSNorm, TrainerSiluAndMul):
        name = op.__mro__[1].__name__
        if op_registry_oot.get(name) is not op:
            CustomOp.register_oot(op, name=name)
