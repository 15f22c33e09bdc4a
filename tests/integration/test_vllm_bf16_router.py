"""A bf16 model served with the plugin routes as the trainer's fp32 router does (model.py,
`route_in_fp32`): every MoE gate reads the fp32 output of its norm (over the fp32 residual stream),
with its weight held in fp32 (the checkpoint's values), and only the experts get the input rounded
to bf16. Before, the gate read the experts' bf16-rounded input: one more rounding of the router's
input than the trainer has (the fp32 logits came from a bf16 activation).

One prefill of plain `vllm.LLM(model=dir, dtype="bfloat16")` over an `export_for_vllm` directory of
fp32 weights, in a subprocess (this file run as a script: vLLM needs the `__main__` guard); forward
hooks record, per MoE layer, the norm's output, the gate's input and logits and the experts' input.
The logits are checked against an independent float64 product (tolerance: fp32 rounding of a sum
of 128 products, bounded by 2^-22 · Σ|x·w|).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.test_vllm_plugin import ROOT, needs_vllm, tiny_cfg

PROMPT = [(5 * j + 2) % 120 + 1 for j in range(11)]


def probe(model_dir: str, out_dir: str) -> None:
    """The subprocess: serve `model_dir` in bf16, record one prefill's router tensors per MoE layer."""
    from safetensors.torch import save_file
    from vllm import SamplingParams

    from megatron_fp4.integrations.vllm import build_vllm_llm

    llm = build_vllm_llm(model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
                         enable_prefix_caching=False, max_model_len=64, max_num_seqs=1, seed=0,
                         kv_cache_memory_bytes=64 << 20)
    rec: dict = {}

    def keep(key: str, t: torch.Tensor) -> None:  # a hook returning None leaves the module's output
        rec.setdefault(key, t.detach().clone())

    def hooks(model):
        for name, mod in model.named_modules():
            if not name.endswith(".mlp") or not hasattr(mod, "experts"):
                continue
            layer = name.removesuffix(".mlp")
            norm = dict(model.named_modules())[f"{layer}.post_attention_layernorm"]
            norm.register_forward_hook(lambda m, i, o, n=layer: keep(f"{n}.norm_out", o[0]))
            mod.gate.register_forward_pre_hook(lambda m, i, n=layer: keep(f"{n}.gate_in", i[0]))
            mod.gate.register_forward_hook(lambda m, i, o, n=layer: keep(f"{n}.logits", o[0]))
            mod.experts.register_forward_pre_hook(
                lambda m, a, kw, n=layer: keep(f"{n}.experts_in", kw["hidden_states"]), with_kwargs=True)
            rec[f"{layer}.gate_weight"] = mod.gate.weight.detach().clone()
        return True

    llm.apply_model(hooks)
    llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, temperature=0.0, detokenize=False),
                 use_tqdm=False)
    save_file({k: v.contiguous() for k, v in rec.items()}, str(Path(out_dir) / "router.safetensors"))


def run_probe(model_dir: Path, tmp_path: Path) -> dict:
    from safetensors.torch import load_file

    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HOME": str(tmp_path), "VLLM_LOGGING_LEVEL": "ERROR"}
    env.update({k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR") if k in os.environ})  # kernel choice
    run = subprocess.run([sys.executable, __file__, str(model_dir), str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=900, cwd=str(ROOT))
    assert run.returncode == 0, run.stderr[-4000:]
    return load_file(str(tmp_path / "router.safetensors"))


@needs_vllm
@pytest.mark.parametrize("scope", ["none", "experts"])
def test_bf16_router_reads_the_fp32_norm_output(tmp_path, scope):
    from megatron_fp4.integrations.hf import load_hf_checkpoint
    from megatron_fp4.integrations.vllm import export_for_vllm
    from megatron_fp4.model import build_model

    cfg = tiny_cfg(scope)  # layer 0 dense (its MLP keeps the bf16 norm output), layers 1..3 MoE
    export = export_for_vllm(build_model(cfg, seed=0), cfg, tmp_path / "hf", dtype=None)
    ckpt = load_hf_checkpoint(export)[1]
    rec = run_probe(export, tmp_path)
    layers = sorted({k.rsplit(".", 1)[0] for k in rec})
    assert layers == [f"model.layers.{i}" for i in range(1, cfg.model.num_layers)]
    for layer in layers:
        w = rec[f"{layer}.gate_weight"]
        assert w.dtype == torch.float32 and torch.equal(w, ckpt[f"{layer}.mlp.gate.weight"]), layer
        x, norm_out = rec[f"{layer}.gate_in"], rec[f"{layer}.norm_out"]
        assert x.shape == (len(PROMPT), cfg.model.hidden_size)
        assert x.dtype == torch.float32, f"{layer}: the gate reads a {x.dtype} input, not the fp32 norm output"
        assert norm_out.dtype == torch.float32 and torch.equal(x, norm_out), layer
        assert x.to(torch.bfloat16).float().ne(x).any(), f"{layer}: the router input is not finer than bf16"
        experts_in = rec[f"{layer}.experts_in"]
        assert experts_in.dtype == torch.bfloat16 and torch.equal(experts_in, x.to(torch.bfloat16)), layer
        logits = rec[f"{layer}.logits"]
        want = x.double() @ w.double().T
        bound = 2.0 ** -22 * (x.double().abs() @ w.double().abs().T)
        assert logits.dtype == torch.float32 and bool(((logits.double() - want).abs() <= bound).all()), layer


@needs_vllm
def test_a_block_the_plugin_cannot_route_from_fp32_is_named_and_kept():
    from torch import nn

    from megatron_fp4.integrations.vllm.model import route_in_fp32

    block = nn.Module()
    block.gate, block.experts = nn.Linear(4, 2), nn.Module()  # the runner does not hold the gate
    forward = block.forward
    with pytest.warns(RuntimeWarning, match=r"model\.layers\.3\.mlp is not a plain Qwen3-MoE block.*dtype='float32'"):
        assert route_in_fp32(block, torch.bfloat16, "model.layers.3.mlp") is False
    assert block.forward == forward  # vLLM's own routing stays


if __name__ == "__main__":
    probe(sys.argv[1], sys.argv[2])
