"""The vLLM rollout process of the GRPO example (`--rollout vllm`): a `vllm.LLM` with the
`megatron_fp4` plugin, fed weights by the trainer's publisher, asked for generations by trainer rank 0.

    VENV/bin/python -m megatron_fp4.rl.rollouts.vllm_server '<JSON spec>'   # MEGATRON_FP4_SYNC_TOKEN set

Started by `rl.rollouts.vllm.VLLMRollout`. The transport and the control loop are the
project's own rollout process (`rl.rollouts.worker.serve`): two token-authenticated `PeerGroup`s,
weights under HF names through `weight_sync.distributed`'s JSON-header protocol (a `DistributedReceiver`
on a background thread), requests and generations as JSON + tensors (`rl.rollouts.wire`); nothing is
unpickled. Only the engine differs: `VLLMEngine` checks a manifest against the served checkpoint
(names, shapes; every tensor of it, a whole version at a time) and loads it through the plugin's live
update path (`live.update_weights`) under a lock that generation takes too, so a batch sees one
version. `digests` reads the weights back from vLLM's own parameters (fused q/k/v, gate/up and
expert tensors split back into HF names), so the trainer can compare what vLLM serves bit for bit.
A request batch is one `llm.generate` call (`integrations.vllm.worker.generate_batch`), routes for
R3 split per request from vLLM's per-step layout.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import torch

from megatron_fp4.integrations.vllm.readback import digests_of, hf_tensors_of  # noqa: F401

MAX_NUM_SEQS = 64  # requests vLLM runs in one step (a batch's others queue); its KV cache bounds it too
SPEC_KEYS = {"model", "dtype", "addr", "weights_port", "control_port", "name", "timeout_s", "threads", "pad_id"}


class VLLMEngine:
    """What `rl.rollouts.worker.serve` and `WeightReceiver` ask of an engine, over a `vllm.LLM`."""

    def __init__(self, llm, name: str, pad_id: int):
        from megatron_fp4.integrations.vllm.live import served_shapes

        self.llm, self.name, self.pad_id, self.version = llm, name, pad_id, 0
        self.hf_cfg = json.loads((Path(llm.llm_engine.model_config.model) / "config.json").read_text())
        self.served = served_shapes(llm)
        self.lock = threading.Lock()

    def check_weights(self, manifest: dict) -> None:
        """ValueError unless `manifest` (name -> (shape, dtype)) is exactly the served checkpoint's tensors."""
        missing = sorted(set(self.served) - set(manifest))
        unknown = sorted(set(manifest) - set(self.served))
        bad = [f"{n!r} {tuple(s)} (served {tuple(self.served[n])})" for n, (s, _) in manifest.items()
               if n in self.served and tuple(s) != tuple(self.served[n])]
        bad += [f"{n!r} is {d}, not floating point" for n, (_, d) in manifest.items() if not d.is_floating_point]
        if missing or unknown or bad:
            raise ValueError(f"vLLM rollout {self.name!r} rejects the weights: missing {missing[:4]}, unknown "
                             f"{unknown[:4]}, {'; '.join(bad[:4])} (publish the whole model under HF names)")

    def load_weights(self, named: dict, version: int) -> None:
        from megatron_fp4.integrations.vllm.live import update_weights

        self.check_weights({n: (tuple(t.shape), t.dtype) for n, t in named.items()})
        with self.lock:
            update_weights(self.llm, named)
            self.version = int(version)

    def weight_digests(self) -> dict:
        with self.lock:
            return self.llm.apply_model(lambda m: digests_of(hf_tensors_of(m, self.hf_cfg)))[0]

    def generate(self, prompts, params, return_routing: bool = False):
        """One `llm.generate` of the whole batch (vLLM schedules the requests together) under the
        weights lock (one version for the batch). With routes (R3), the worker's recorder logs every
        forward's router picks with vLLM's per-step request layout and cuts them per request
        (`worker.generate_batch`): [N, L_moe, k] each, the positions that predict its response tokens."""
        from megatron_fp4.integrations.vllm.worker import generate_batch
        from megatron_fp4.rollout.engine import GenerationOutput

        sampling = [vllm_params(p) for p in params]
        with self.lock:
            completions, routing = generate_batch(self.llm, prompts, sampling, return_routing)
            version = self.version
        out = {"response_ids": [], "log_probs": [], "sampled_log_probs": [], "finish_reasons": []}
        for c, p in zip(completions, params):
            toks = list(c.token_ids)
            lp = torch.tensor([d[t].logprob for t, d in zip(toks, c.logprobs)], dtype=torch.float32)
            out["response_ids"].append(toks)
            out["log_probs"].append(lp)
            out["sampled_log_probs"].append(torch.zeros_like(lp) if p.temperature == 0 else lp.clone())
            out["finish_reasons"].append("stop" if c.finish_reason == "stop" else "length")
        return GenerationOutput(prompt_ids=[list(map(int, q)) for q in prompts], version=version, routing=routing,
                                **out)


def check_params(p) -> None:
    """ValueError unless `p` is greedy or plain temperature-1 sampling (what vLLM's raw log-probs equal)."""
    if p.temperature not in (0.0, 1.0) or p.top_k or p.top_p < 1.0:
        raise ValueError(f"vLLM rollout: temperature {p.temperature}, top_k {p.top_k}, top_p {p.top_p}: only greedy "
                         "or plain sampling at temperature 1 is wired (sampled log-probs need vLLM's "
                         "processed_logprobs mode)")


def vllm_params(p):
    """vLLM's SamplingParams for ours. vLLM reports raw log-probs (temperature 1, no filtering): our
    `log_probs`; the sampled distribution's equal them only at temperature 1 without top-k/top-p."""
    from vllm import SamplingParams

    check_params(p)
    return SamplingParams(max_tokens=int(p.max_new_tokens), temperature=float(p.temperature), seed=p.seed,
                          stop_token_ids=list(p.stop_token_ids), logprobs=0, detokenize=False)


def main(argv=None) -> None:
    from megatron_fp4.integrations.vllm.worker import build_llm
    from megatron_fp4.rl.rollouts.worker import serve
    from megatron_fp4.rollout.weight_sync.peer_group import sync_token_from_env
    from megatron_fp4.rollout.weight_sync.publisher import WeightReceiver

    argv = sys.argv[1:] if argv is None else argv
    token = sync_token_from_env()
    if len(argv) != 1 or token is None:
        raise SystemExit("usage: MEGATRON_FP4_SYNC_TOKEN=... python -m megatron_fp4.rl.rollouts.vllm_server "
                         "'<JSON spec>' (started by rl.rollouts.vllm.VLLMRollout)")
    spec = json.loads(argv[0])
    if not isinstance(spec, dict) or set(spec) != SPEC_KEYS:
        raise SystemExit(f"the vLLM rollout server's spec must be a JSON object with keys {sorted(SPEC_KEYS)}")
    llm, _ = build_llm(spec["model"], {"dtype": spec["dtype"], "max_num_seqs": MAX_NUM_SEQS})
    engine = VLLMEngine(llm, spec["name"], int(spec["pad_id"]))
    serve(spec, token, engine=engine, receiver=WeightReceiver(engine))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # apply_model reaches the model in-process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
