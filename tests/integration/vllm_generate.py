"""Greedy generation with plain `vllm.LLM(model=dir)` for tests/integration/test_vllm_plugin.py (run
in a subprocess: vLLM needs the `__main__` guard). Writes JSON: per prompt the generated tokens,
vLLM's log-prob of each, and (with the plugin) the experts its MoE layers picked at the positions
that predict them.

    python tests/integration/vllm_generate.py MODEL_DIR REQUEST.json OUT.json

REQUEST.json: {"prompts": [[ids...], ...], "max_tokens": N, "routing": true|false, "dtype": "float32",
"update_from": HF_DIR (optional), "enforce_eager": false (optional: vLLM's
torch.compile of the model, tests/integration/test_vllm_compiled.py)}. All prompts run as one batch
through the rollout's own path (`integrations.vllm.worker.generate_batch`: one `llm.generate`, the
routes recorded per forward and cut per request: [N, L_moe, k] each, the trainer scoring's
alignment). With "update_from", the engine first generates on MODEL_DIR's weights (filling the
plugin's Q(W) cache; written as "before_update": what a fresh engine on them serves), then takes HF_DIR's weights by a live update
(`integrations.vllm.live.update_weights`) and generates what is recorded as "results".
"""
from __future__ import annotations

import json
import os
import sys
import time


def _generate(llm, prompts, params, routing: bool) -> list:
    """[{"tokens", "logprobs", "routing": [N][L_moe][k] or None}] of the prompts, one batch."""
    from megatron_fp4.integrations.vllm.worker import generate_batch

    completions, routes = generate_batch(llm, prompts, [params] * len(prompts), routing)
    return [{"tokens": list(c.token_ids), "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
             "routing": routes[i].tolist() if routing else None} for i, c in enumerate(completions)]


def main(model_dir: str, request_file: str, out_file: str) -> None:
    from vllm import LLM, SamplingParams

    from megatron_fp4.integrations.vllm.live import plugin_layers

    req = json.loads(open(request_file).read())
    routing = bool(req.get("routing"))
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype=req.get("dtype", "float32"),
              enforce_eager=bool(req.get("enforce_eager", True)),
              enable_prefix_caching=False, max_model_len=256, max_num_seqs=max(len(req["prompts"]), 1), seed=0,
              kv_cache_memory_bytes=64 << 20)  # a fixed small KV cache: the CPU is shared
    params = SamplingParams(max_tokens=int(req["max_tokens"]), temperature=0.0, logprobs=0, detokenize=False,
                            ignore_eos=True)
    out = {}
    if req.get("update_from"):
        from megatron_fp4.integrations.hf import load_hf_checkpoint
        from megatron_fp4.integrations.vllm.live import update_weights

        start = time.perf_counter()
        out["before_update"] = _generate(llm, req["prompts"], params, routing)
        out["before_update_seconds"] = time.perf_counter() - start
        update_weights(llm, load_hf_checkpoint(req["update_from"])[1])
    start = time.perf_counter()
    out["results"] = _generate(llm, req["prompts"], params, routing)
    out["seconds"] = time.perf_counter() - start
    with open(out_file, "w") as f:
        json.dump({**out, "plugin": bool(llm.apply_model(lambda m: bool(plugin_layers(m)))[0]),
                   "compiled": llm.llm_engine.vllm_config.compilation_config.mode.name != "NONE"}, f)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # apply_model reaches the model in-process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(*sys.argv[1:4])
