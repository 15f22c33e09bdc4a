"""vLLM rollout worker: generate with `vllm.LLM` + the `megatron_fp4` plugin, return tokens, log-probs,
full next-token distributions and the routed experts of every response position.

    python -m megatron_fp4.integrations.vllm.worker SPEC.json OUT_DIR     # in the vLLM environment

or in-process (`run_spec(spec, out_dir)`) where vllm is importable. SPEC.json (JSON only):

    {"jobs": [{"name": "experts/MoEResQ", "model": HF_DIR}, ...],      # export_for_vllm directories
     "prompts": [[ids...], ...], "max_tokens": 8, "temperature": 1.0, "seeds": [s0, s1, ...],
     "stop_token_ids": [2], "dtype": "float32", "routing": true, "distributions": true,
     "ignore_eos": false}

OUT_DIR/results.json: {"jobs": {name: {"tokens": [[...]], "logprobs": [[...]], "plugin": bool,
"file": "job_K.safetensors"}}}; that safetensors file holds per request i `routing.i` [N, L_moe, k]
(int64, the experts of the position that predicts response token t, the trainer scoring's alignment)
and `dist.i` [N, V] (float32 log-softmax rows). Nothing is pickled.

Routed experts: the plugin's `MegatronFP4Config.routing_store` (set to `{}`) collects every MoE
forward's `[tokens, k]` ids under its layer's name. Requests therefore run one per `generate` call
(each forward belongs to one request) with prefix caching off; rows 0..P+N-2 are prefill and decode
positions, of which rows P-1.. predict the N response tokens.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

RESULTS = "results.json"


def _configs(model):
    from megatron_fp4.integrations.vllm.live import plugin_layers

    return {id(method.config): method.config for _, method in plugin_layers(model)}


def set_routing(model, on: bool) -> bool:
    """Turn the plugin's routed-experts recording on (an empty store) or off in `model`."""
    for cfg in _configs(model).values():
        cfg.routing_store = {} if on else None
    return True


def take_routing(model) -> dict:
    """{layer prefix: [positions, k] expert ids} recorded since the last call; the store is emptied."""
    import torch

    out = {}
    for cfg in _configs(model).values():
        for prefix, steps in (cfg.routing_store or {}).items():
            out[prefix] = torch.cat(steps)
        if cfg.routing_store is not None:
            cfg.routing_store.clear()
    return out


def _layer_index(prefix: str) -> int:
    m = re.search(r"layers\.(\d+)\.", prefix)
    return int(m.group(1)) if m else -1


def stack_routing(layers: dict, prompt_len: int):
    """[N, L_moe, k] experts predicting the response tokens, MoE layers in model order."""
    import torch

    names = sorted(layers, key=_layer_index)
    return torch.stack([layers[n][prompt_len - 1:] for n in names], dim=1).long()


def build_llm(model_dir: str, spec: dict):
    from megatron_fp4.integrations.vllm import build_vllm_llm

    hf = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = hf["vocab_size"]
    return build_vllm_llm(model_dir, skip_tokenizer_init=True, dtype=spec.get("dtype", "float32"),
                          enforce_eager=True, enable_prefix_caching=False,
                          max_model_len=int(spec.get("max_model_len", hf["max_position_embeddings"])), max_num_seqs=1,
                          seed=0,
                          max_logprobs=vocab, kv_cache_memory_bytes=64 << 20), vocab


def generate(llm, vocab: int, spec: dict) -> tuple:
    """(json part, tensors) of one job on a built engine (module doc)."""
    import torch
    from vllm import SamplingParams

    routing, dists = bool(spec.get("routing", True)), bool(spec.get("distributions", True))
    plugin = bool(llm.apply_model(lambda m: bool(_configs(m)))[0])
    if routing and not plugin:
        raise ValueError("routing asked for but the export has no megatron_fp4 quantization_config (stock vLLM "
                         "serves it and records no experts)")
    if routing:
        llm.apply_model(lambda m: set_routing(m, True))
        llm.apply_model(take_routing)
    out = {"tokens": [], "logprobs": [], "plugin": plugin}
    tensors = {}
    seeds = spec.get("seeds") or [None] * len(spec["prompts"])
    for i, (prompt, seed) in enumerate(zip(spec["prompts"], seeds)):
        params = SamplingParams(max_tokens=int(spec["max_tokens"]), temperature=float(spec.get("temperature", 1.0)),
                                seed=seed, logprobs=vocab if dists else 0, detokenize=False,
                                stop_token_ids=list(spec.get("stop_token_ids", [])),
                                ignore_eos=bool(spec.get("ignore_eos", False)))
        c = llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False)[0].outputs[0]
        toks = list(c.token_ids)
        out["tokens"].append(toks)
        out["logprobs"].append([lp[t].logprob for t, lp in zip(toks, c.logprobs)])
        if dists:
            tensors[f"dist.{i}"] = torch.tensor([[lp[v].logprob for v in range(vocab)] for lp in c.logprobs],
                                                dtype=torch.float32).reshape(len(toks), vocab)
        if routing:
            tensors[f"routing.{i}"] = stack_routing(llm.apply_model(take_routing)[0], len(prompt))
    return out, tensors


def run_spec(spec: dict, out_dir) -> dict:
    """Run every job of `spec` (one engine each, built, used, released) and write OUT_DIR (module doc)."""
    import gc

    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for k, job in enumerate(spec["jobs"]):
        llm, vocab = build_llm(job["model"], spec)
        res, tensors = generate(llm, vocab, spec)
        del llm
        gc.collect()
        res["file"] = f"job_{k}.safetensors"
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(out_dir / res["file"]))
        results[job["name"]] = res
    (out_dir / RESULTS).write_text(json.dumps({"jobs": results}))
    return results


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m megatron_fp4.integrations.vllm.worker SPEC.json OUT_DIR", file=sys.stderr)
        return 2
    try:
        spec = json.loads(Path(argv[0]).read_text())
        if not isinstance(spec, dict) or not spec.get("jobs") or not isinstance(spec.get("prompts"), list):
            raise ValueError(f"{argv[0]}: needs 'jobs' (a non-empty list) and 'prompts' (a list of id lists)")
    except (OSError, ValueError) as e:
        print(f"vllm worker: {e}", file=sys.stderr)
        return 2
    run_spec(spec, argv[1])
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # apply_model reaches the model in-process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
