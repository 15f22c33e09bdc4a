"""The plugin's numeric ops as one opaque torch op, so vLLM's torch.compile runs them as written.

Without `enforce_eager`, vLLM on CPU traces the model's forward once with Dynamo and compiles it
with inductor. The plugin's layers are Python over the project's own code (`fp4`, `model.moe`,
`model.layers`): Dynamo cannot trace parts of it (a `SimpleNamespace` built per call, the Q(W)
cache dicts, the routing record, the compiled-ResQ kernel of `fp4.fused_resq`), and what it can
trace inductor would re-fuse, so the bits would no longer be the trainer's (the batch-invariant
mode's point) nor the eager engine's. So every numeric piece of the plugin computes through one custom op,
``torch.ops.megatron_fp4.call(tensors, key)`` (`make_layers_opaque`, when the plugin's model class
is built): ``key`` is the module's name in the model, registered in the engine's
`static_forward_context` (where vLLM's own opaque ops find their layers by name, so a graph that
vLLM's compile cache hands to another engine of the same model calls that engine's layers); the
graph holds only the call, and the piece's own eager code runs at call time, reading the layer's
weights and Q(W) cache then (a live weight update is seen by the next step, as in eager mode). The
op's fake (meta) implementation gives each output's shape and dtype from the registered shape
function, which the real call checks. So the compiled engine computes the eager engine's bits.

vLLM's own attention and KV-cache update are already such ops (`vllm.unified_attention_with_output`),
so the plugin's attention impl (attention.py) runs eagerly inside them.
"""
from __future__ import annotations

import weakref
from typing import Callable, Sequence

import torch

_LIB = torch.library.Library("megatron_fp4", "FRAGMENT")  # the op's lifetime: this module's
_PREFIX = "megatron_fp4:"
OUTSIDE_MODEL = ("megatron_fp4: {what} of the plugin is traced by vLLM's torch.compile outside the plugin's model "
                 "class (Qwen3MoeForCausalLM), so it cannot run compiled: serve with enforce_eager=True")
# entries by key for calls outside a vLLM forward (the last one built; held by its engine's config only)
_OUTSIDE: "weakref.WeakValueDictionary[str, Entry]" = weakref.WeakValueDictionary()


class Entry:
    """What a key names: the eager function and its shape function (see `register`). Kept in the
    engine's `static_forward_context` (vLLM's place for layers its custom ops look up by name), so a
    graph compiled once (or loaded from vLLM's compile cache) calls this engine's layers."""

    def __init__(self, fn: Callable, shape: Callable):
        self.fn, self.shape = fn, shape


def _entry(key: str) -> Entry:
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if is_forward_context_available():
        entry = get_forward_context().no_compile_layers.get(key)
        if entry is not None:
            return entry
    return _OUTSIDE[key]


def _call(tensors: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    entry = _entry(key)
    outs = entry.fn(*tensors)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    want = entry.shape(*tensors)
    assert len(outs) == len(want), key
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    for i, (out, (size, dtype)) in enumerate(zip(outs, want)):
        assert tuple(out.shape) == tuple(size) and out.dtype == dtype, \
            f"megatron_fp4 op {key}: output {i} is {tuple(out.shape)} {out.dtype}, its shape function: {size} {dtype}"
        if out.untyped_storage().data_ptr() in storages:  # an op's output must not alias its inputs
            outs[i] = out.clone()
    return outs


def _fake(tensors: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    device = tensors[0].device
    return [torch.empty(size, dtype=dtype, device=device) for size, dtype in _entry(key).shape(*tensors)]


_LIB.define("call(Tensor[] tensors, str key) -> Tensor[]")
_LIB.impl("call", _call, "CompositeExplicitAutograd")
_LIB._register_fake("call", _fake)


def register(name: str, fn: Callable, shape: Callable, vllm_config=None) -> str:
    """Register ``fn(*tensors)`` (a tensor or a tuple of them) under the layer name ``name`` (unique
    in its model: a graph holds the name, a cached graph is reused by a new engine of the same model)
    with ``shape(*tensors) -> [(size, dtype), ...]`` of its outputs; returns the key for `call`."""
    from vllm.config import get_current_vllm_config

    key, entry = _PREFIX + name, Entry(fn, shape)
    config = vllm_config if vllm_config is not None else get_current_vllm_config()
    config.compilation_config.static_forward_context[key] = entry
    _OUTSIDE[key] = entry
    return key


def call(key: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """The function registered under ``key`` on ``tensors``, as one op Dynamo does not look into.
    In an eager engine (nothing is being traced) the function itself, without the op's dispatch and
    its output checks (about 8 us a call, some 40 calls a decode step): the same eager code, so
    the same bits; the op is what a graph holds."""
    if not torch.compiler.is_compiling():
        outs = _entry(key).fn(*tensors)
        return list(outs) if isinstance(outs, (tuple, list)) else [outs]
    return torch.ops.megatron_fp4.call(list(tensors), key)


def like(x: torch.Tensor, last: int | None = None, dtype: torch.dtype | None = None):
    """(size, dtype) of a tensor like ``x`` with last dim ``last`` and ``dtype`` when given."""
    size: Sequence[int] = tuple(x.shape) if last is None else (*x.shape[:-1], last)
    return size, x.dtype if dtype is None else dtype


def _out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype)  # the router gate's fp32 weight: fp32 logits


def _opaque_linear(name: str, owner: torch.nn.Module, method, vllm_config) -> None:
    """``method.apply(layer, x, bias)`` (a plugin linear, the router gate, the LM head) through the op."""
    inner = method.apply

    def fn(x, *bias):
        return inner(owner, x, bias[0] if bias else None)

    def shape(x, *bias):
        return [like(x, owner.weight.shape[0], _out_dtype(x, owner.weight))]

    key = register(name, fn, shape, vllm_config)

    def apply(layer, x, bias=None):
        assert layer is owner, f"megatron_fp4: {name}'s method applied to another layer"
        return call(key, x, *(() if bias is None else (bias,)))[0]

    method.apply = apply


def _opaque_moe(name: str, owner: torch.nn.Module, method, vllm_config) -> None:
    """``method.apply_monolithic(layer, x, router_logits)`` (the plugin's MoE method) through the op."""
    inner = method.apply_monolithic
    key = register(name, lambda x, logits: inner(owner, x, logits), lambda x, logits: [like(x)], vllm_config)

    def apply_monolithic(layer, x, router_logits, input_ids=None):
        assert layer is owner, f"megatron_fp4: {name}'s MoE method applied to another layer"
        return call(key, x, router_logits)[0]

    method.apply_monolithic = apply_monolithic


def keep_kernel(vllm_config, op: str) -> None:
    """Run vLLM's own kernel of the custom op ``op`` under vLLM's torch.compile too (vLLM's default
    there is inductor's code for its `forward_native`, which may round unlike the eager engine's
    kernel), unless the user chose; set before the model's layers are built."""
    ops = vllm_config.compilation_config.custom_ops
    if f"+{op}" not in ops and f"-{op}" not in ops:
        ops.append(f"+{op}")


def make_layers_opaque(model: torch.nn.Module, vllm_config) -> int:
    """Route every numeric piece of the plugin in ``model`` through the op, keyed by module name: the
    plugin's quantization methods (their `apply` / `apply_monolithic`) and the modules that name their
    own eager code (``mfp4_opaque() -> (fn, shape)``: the trainer's RMSNorm, SiLU, RoPE). Returns how many.
    Called once, when the plugin's model class is built."""
    from megatron_fp4.integrations.vllm.quant import MegatronFP4Config, MoEResQMoEMethod

    count = 0
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if hasattr(module, "mfp4_opaque"):
            fn_shape = module.mfp4_opaque() if module.mfp4_key is None else None
            if fn_shape is not None:
                module.mfp4_key = register(name, *fn_shape, vllm_config)
                count += 1
        elif isinstance(getattr(method, "config", None), MegatronFP4Config):
            (_opaque_moe if isinstance(method, MoEResQMoEMethod) else _opaque_linear)(name, module, method, vllm_config)
            count += 1
    return count
