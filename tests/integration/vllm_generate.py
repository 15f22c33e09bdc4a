"""Greedy generation with plain `vllm.LLM(model=dir)` for tests/integration/test_vllm_plugin.py (run
in a subprocess: vLLM needs the `__main__` guard). Writes JSON: per prompt the generated tokens,
vLLM's log-prob of each, and (with the plugin) the experts its MoE layers picked at each position.

    python tests/integration/vllm_generate.py MODEL_DIR REQUEST.json OUT.json

REQUEST.json: {"prompts": [[ids...], ...], "max_tokens": N, "routing": true|false, "dtype": "float32",
"update_from": HF_DIR (optional), "enforce_eager": false (optional: vLLM's
torch.compile of the model, tests/integration/test_vllm_compiled.py)}. Requests run one at a time when routing is asked for, so each
forward step belongs to one request. With "update_from", the engine first generates on MODEL_DIR's
weights (filling the plugin's Q(W) cache), then takes HF_DIR's weights by a live update
(`integrations.vllm.live.update_weights`) and generates what is recorded.
"""
from __future__ import annotations

import json
import os
import sys
import time


def _plugin_configs(model):
    from megatron_fp4.integrations.vllm.live import plugin_layers

    return {id(method.config): method.config for _, method in plugin_layers(model)}


def _set_routing(model, on: bool):
    for cfg in _plugin_configs(model).values():
        cfg.routing_store = {} if on else None
    return True


def _take_routing(model):
    """{layer prefix: [positions, k] expert ids} of the forwards since the last call, emptied."""
    import torch

    out = {}
    for cfg in _plugin_configs(model).values():
        for prefix, steps in (cfg.routing_store or {}).items():
            out[prefix] = torch.cat(steps).tolist()
        if cfg.routing_store is not None:
            cfg.routing_store.clear()
    return out


def main(model_dir: str, request_file: str, out_file: str) -> None:
    from vllm import LLM, SamplingParams

    req = json.loads(open(request_file).read())
    routing = bool(req.get("routing"))
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=req.get("dtype", "float32"),
              enforce_eager=bool(req.get("enforce_eager", True)),
              enable_prefix_caching=False, max_model_len=256, max_num_seqs=max(len(req["prompts"]), 1), seed=0,
              kv_cache_memory_bytes=64 << 20)  # a fixed small KV cache: the CPU is shared
    params = SamplingParams(max_tokens=int(req["max_tokens"]), temperature=0.0, logprobs=0, detokenize=False,
                            ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in req["prompts"]]
    results = []
    if routing:
        llm.apply_model(lambda m: _set_routing(m, True))
        llm.apply_model(_take_routing)  # drop anything recorded before
    if req.get("update_from"):
        from megatron_fp4.integrations.hf import load_hf_checkpoint
        from megatron_fp4.integrations.vllm.live import update_weights

        llm.generate(prompts, params, use_tqdm=False)
        update_weights(llm, load_hf_checkpoint(req["update_from"])[1])
        llm.apply_model(_take_routing)
    start = time.perf_counter()
    batches = [[p] for p in prompts] if routing else [prompts]
    for batch in batches:
        outs = llm.generate(batch, params, use_tqdm=False)
        layers = llm.apply_model(_take_routing)[0] if routing else None
        for o in outs:
            c = o.outputs[0]
            results.append({"tokens": list(c.token_ids),
                            "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                            "routing": layers})
    seconds = time.perf_counter() - start
    with open(out_file, "w") as f:
        json.dump({"results": results, "seconds": seconds,
                   "plugin": bool(llm.apply_model(lambda m: bool(_plugin_configs(m)))[0]),
                   "compiled": llm.llm_engine.vllm_config.compilation_config.mode.name != "NONE"}, f)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # apply_model reaches the model in-process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(*sys.argv[1:4])
