"""The bf16 rows of bench_vllm_goals.py: vLLM + the plugin and stock vLLM (no quantization_config)
side by side on one model (the tiny config, FP4 off) and one prompt set, each scored by two trainers:

- the fp32 trainer on the fp32 weights (the precision gap: weights and activations in bf16);
- the fp32 trainer on the weights that engine holds (the checkpoint rounded to each vLLM parameter's
  dtype: bf16, the plugin's MoE gates fp32; the plugin's parameters are read back and checked to be
  exactly that): the engine gap.

and, to split the precision gap, both engines in fp32 on the bf16-rounded weights (fp32
activations, the same weights the bf16 engines hold): vs the trainer on those weights it is the
engine gap at fp32 activations, vs the fp32 trainer the weights' rounding alone.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=$PWD /work/venv-verlvllm/bin/python benchmarks/bench_vllm_goals.py \\
        --only bf16 [--bf16-prompts 128]

Engines in this process, each generating all prompts as one batch through the rollout's path
(`integrations.vllm.worker.generate`: one `llm.generate`, routes cut per request). Experts: the
plugin's recorded routes; stock vLLM records none, so the worker's recorder takes the top-k of its MoE
gates' logits as its CPU router does (`gate_top_k`: `torch.topk` of the logits,
`fused_moe.router.cpu_router._softmax_topk`).
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

# engine -> (the plugin?, vLLM dtype); the "fp32 act" ones serve the bf16-rounded weights
ENGINES = {"plugin": (True, "bfloat16"), "stock": (False, "bfloat16"),
           "plugin fp32 act": (True, "float32"), "stock fp32 act": (False, "float32")}


def stock_copy(export: Path, out: Path) -> Path:
    """`export` (an `export_for_vllm` directory) without its quantization_config: stock vLLM serves it."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(export, out)
    hf = json.loads((out / "config.json").read_text())
    hf.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    return out


def held_gate_dtypes(model) -> dict:
    """{HF name of every MoE gate's weight: the dtype vLLM holds it in} (vLLM's prefixes are the HF names)."""
    return {f"{name}.weight": mod.weight.dtype for name, mod in model.named_modules() if name.endswith("mlp.gate")}


def engine_rollout(export: Path, ps: list, seeds: list, tokens: int, dtype: str) -> tuple:
    """(flat rollout for `rescore`, {HF name of each MoE gate: the dtype vLLM holds it in}, the plugin's
    parameters read back under HF names in fp32, or None for stock, which prepacks its CPU weights)
    of one vLLM engine on `export`; sampling at temperature 1 with one seed per request, the prompts
    in one batch."""
    import torch

    from megatron_fp4.integrations.vllm.readback import hf_tensors_of
    from megatron_fp4.integrations.vllm.worker import build_llm, generate

    hf = json.loads((export / "config.json").read_text())
    plugin = "quantization_config" in hf
    spec = {"prompts": ps, "seeds": seeds, "max_tokens": tokens, "temperature": 1.0, "ignore_eos": True,
            "dtype": dtype, "distributions": True, "routing": True,
            "gate_top_k": 0 if plugin else hf["num_experts_per_tok"], "max_num_seqs": max(1, min(64, len(ps)))}
    llm, vocab = build_llm(str(export), spec)
    dtypes = llm.apply_model(held_gate_dtypes)[0]
    res, tensors = generate(llm, vocab, spec)
    flat = {"prompt_ids": ps, "response_ids": res["tokens"],
            "log_probs": [torch.tensor(lp, dtype=torch.float32) for lp in res["logprobs"]],
            "routing": [tensors[f"routing.{i}"] for i in range(len(ps))],
            "distributions": [tensors[f"dist.{i}"] for i in range(len(ps))]}
    readback = llm.apply_model(lambda m: {n: t.float().clone() for n, t in hf_tensors_of(m, hf).items()})[0] \
        if plugin else None
    del llm
    return flat, dtypes, readback


def held_weights(ckpt: dict, gate_dtypes: dict, dtype) -> dict:
    """The checkpoint as vLLM holds it: every tensor rounded to the model `dtype`, each MoE gate to
    the dtype vLLM's gate weight has (fp32 with the plugin), back in fp32."""
    return {n: t.to(gate_dtypes.get(n, dtype)).float() for n, t in ckpt.items()}


def _rounded_export(model, cfg, ckpt: dict, gate_dtype, work: Path, name: str) -> Path:
    """An fp32 export of `model` on the weights a bf16 engine holds (gates in `gate_dtype`)."""
    import torch

    from megatron_fp4.integrations.hf.qwen3_moe import from_hf_state_dict
    from megatron_fp4.integrations.vllm import export_for_vllm

    rounded = copy.deepcopy(model)
    from_hf_state_dict(rounded, held_weights(ckpt, {n: gate_dtype for n in ckpt if n.endswith("mlp.gate.weight")},
                                             torch.bfloat16))
    return export_for_vllm(rounded, cfg, work / name, dtype=None, overwrite=True)


def side_by_side(args, work: Path, consistency, tiny_config, log) -> dict:
    """{engine (ENGINES): {"fp32" | "held": consistency metrics + positions, layers}} (module doc)."""
    import torch

    from megatron_fp4.fp4 import Numerics, apply_numerics
    from megatron_fp4.integrations.hf import load_hf_checkpoint
    from megatron_fp4.integrations.hf.qwen3_moe import from_hf_state_dict
    from megatron_fp4.integrations.vllm import export_for_vllm
    from megatron_fp4.model import build_model
    from megatron_fp4.training.data import ArithmeticTokenizer

    prompts, train_side = consistency()
    tok = ArithmeticTokenizer()
    n = args.bf16_prompts
    ps, seeds = prompts(n, 0, tok), list(range(n))
    cfg = tiny_config("none", "bf16", "bf16")
    model = build_model(cfg, seed=0)
    fp32 = export_for_vllm(model, cfg, work / "bf16_plugin", dtype=None, overwrite=True)
    ckpt = load_hf_checkpoint(fp32)[1]
    exports = {"plugin": fp32, "stock": stock_copy(fp32, work / "bf16_stock"),
               "plugin fp32 act": _rounded_export(model, cfg, ckpt, torch.float32, work, "bf16w_plugin"),
               "stock fp32 act": stock_copy(_rounded_export(model, cfg, ckpt, torch.bfloat16, work, "bf16w"),
                                            work / "bf16w_stock")}
    apply_numerics(model, Numerics(invariance="exact"))  # the references score at `exact` (fixed at build)
    out = {}
    for name, (plugin, dtype) in ENGINES.items():
        log(f"bf16: {name} vLLM ({dtype}), {n} prompts x {args.tokens} tokens")
        flat, gate_dtypes, readback = engine_rollout(exports[name], ps, seeds, args.tokens, dtype)
        weights = held_weights(load_hf_checkpoint(exports[name])[1], gate_dtypes, getattr(torch, dtype))
        if plugin and (set(readback) != set(weights) or not all(torch.equal(readback[k], weights[k]) for k in weights)):
            raise RuntimeError(f"bf16: {name}'s parameters are not its checkpoint rounded to the dtypes vLLM holds")
        held = copy.deepcopy(model)
        from_hf_state_dict(held, weights)
        out[name] = {ref: {**train_side(m, flat, tok, "bf16", "exact", 6),
                           "positions": sum(len(t) for t in flat["response_ids"]),
                           "layers": int(flat["routing"][0].shape[1])}
                     for ref, m in (("fp32", model), ("held", held))}
    return out


def bf16_rows(args, work: Path, consistency, tiny_config, row, log) -> list:
    m = side_by_side(args, work, consistency, tiny_config, log)
    p = m["plugin"]["fp32"]
    pairs = f"FP4 off, {p['layers']} MoE layers × {p['positions']} positions"

    def cell(a: str, b: str, ref: str) -> str:
        return f"{m[a][ref]['expert_agreement']:.2%} (stock {m[b][ref]['expert_agreement']:.2%})"

    def delta(a: str, b: str, ref: str) -> str:
        return f"max \\|Δ\\| {m[a][ref]['max_abs_diff']:.1e}, stock {m[b][ref]['max_abs_diff']:.1e}"

    bf, act = ("plugin", "stock"), ("plugin fp32 act", "stock fp32 act")
    return [
        row(f"bf16 vLLM + plugin expert agreement vs the fp32 trainer (the precision gap), {pairs}; stock bf16 vLLM "
            f"beside ({delta(*bf, 'fp32')})", cell(*bf, "fp32"), "≥ 99.9 %",
            m["plugin"]["fp32"]["expert_agreement"] >= 0.999),
        row(f"bf16 vLLM + plugin expert agreement vs the trainer on the weights vLLM holds (bf16-rounded, the plugin's "
            f"gates fp32: the engine gap), {pairs}; stock beside ({delta(*bf, 'held')})", cell(*bf, "held"),
            "≥ 99.9 %", m["plugin"]["held"]["expert_agreement"] >= 0.999),
        row(f"split: vLLM + plugin in fp32 on those bf16-rounded weights vs the trainer on them (the engine gap at "
            f"fp32 activations); stock beside ({delta(*act, 'held')})", cell(*act, "held"), "100 %",
            m["plugin fp32 act"]["held"]["expert_agreement"] == 1.0),
        row(f"split: the same vs the fp32 trainer (the weights' bf16 rounding alone); stock beside "
            f"({delta(*act, 'fp32')})", cell(*act, "fp32"), "(bound for bf16 weights)", "—"),
    ]
