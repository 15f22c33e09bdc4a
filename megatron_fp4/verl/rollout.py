"""verl rollout over our `RolloutEngine` (same model code and MoEResQ numerics as training).

`generate_sequences` follows verl's batch layout: in `input_ids` [B, P] left-padded prompts with
`attention_mask`; out `prompts`, `responses` [B, R] right-padded, `input_ids` = prompts|responses,
`attention_mask`, `position_ids`, `response_mask`, `rollout_log_probs` [B, R] (raw model
distribution, what the IS correction needs) and, with meta_info["return_routing"] or verl's
``rollout.enable_rollout_routing_replay`` (R3), `routed_experts` [B, P+R, num_moe_layers, k] in verl's
layout (aligned with `input_ids`, as verl's agent loop lays out vLLM's routes): column P-1+t holds
the route behind response token t (the position that produced it); the engine records no other
prompt routes, so the rest is -1 (the trainer routes those positions live).
"""
from __future__ import annotations

from typing import Optional

import torch
from verl import DataProto
from verl.workers.rollout.base import _ROLLOUT_REGISTRY, BaseRollout

from megatron_fp4.integrations.hf.families import ours_from_hf_state_dict
from megatron_fp4.rollout.engine import RolloutEngine, positions_from_mask
from megatron_fp4.rollout.sampling import SamplingParams


HF_PREFIX = "model."  # every HF Qwen3-MoE name but lm_head.weight; none of ours


def _token_ids(value) -> tuple:
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


class MegatronFP4Rollout(BaseRollout):
    """Constructed as verl constructs rollouts, `MegatronFP4Rollout(config=RolloutConfig,
    model_config=HFModelConfig, device_mesh=...)` (the model at model_config.path, FP4 recipe from its
    `megatron_fp4_quant.json` sidecar), or over an existing engine with `engine=RolloutEngine(...)`."""

    def __init__(self, config=None, model_config=None, device_mesh=None, *args, engine: Optional[RolloutEngine] = None,
                 response_length: int = 16, stop_token_ids: tuple = (), **kwargs):
        super().__init__(config, model_config, device_mesh)
        hf_config = getattr(self.model_config, "hf_config", None)
        if engine is None:
            engine = self._engine_from_model_config(getattr(hf_config, "pad_token_id", None))
        self.engine = engine
        self.response_length = int(getattr(self.config, "response_length", None) or response_length)
        self.stop_token_ids = tuple(stop_token_ids) or _token_ids(getattr(hf_config, "eos_token_id", None))
        self.resident = {"weights", "kv_cache"}

    def _engine_from_model_config(self, pad_id) -> RolloutEngine:
        from megatron_fp4.integrations.hf import build_model_from_hf
        from megatron_fp4.verl.construct import checkpoint_numerics_level, fp4_config_for, model_dir

        if self.model_config is None:
            raise ValueError("MegatronFP4Rollout needs model_config (verl's HFModelConfig of a Qwen3-MoE checkpoint) "
                             "or engine=RolloutEngine(...)")
        path = model_dir(self.model_config)
        fp4 = fp4_config_for(path)
        model = build_model_from_hf(path, fp4)
        return RolloutEngine(model, mode=fp4.rollout_mode, pad_id=int(pad_id or 0),
                             seed=int(getattr(self.config, "seed", 0) or 0),
                             invariance=checkpoint_numerics_level(path, model.cfg.family))

    def _sampling(self, meta: dict, key: str, default):
        value = meta.get(key, None)
        return getattr(self.config, key, default) if value is None else value

    async def resume(self, tags: list[str]):
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"resume(tags={tags}): unknown tags {sorted(unknown)}; use 'weights' and/or 'kv_cache'")
        self.resident |= set(tags)  # CPU/tiny models: nothing was offloaded; the KV cache is per request

    async def release(self):
        self.resident.clear()

    async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps: Optional[int] = None,
                             **kwargs):
        """Stage every tensor, then swap them in under the engine's write lock (whole version)."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"wire_format={wire_format!r}: MegatronFP4Rollout loads full tensors only; "
                                      "use checkpoint_engine.backend='megatron_fp4' or another full-tensor backend")
        if hasattr(weights, "claim_ack"):
            weights.claim_ack()
        try:
            if hasattr(weights, "__aiter__"):
                staged = {n: t.clone() async for n, t in weights}
            else:
                staged = {n: t.clone() for n, t in weights}
            version = getattr(weights, "version", None)  # known once a stream's version has arrived
            version = version if version is not None else (global_steps if global_steps is not None
                                                           else self.engine.version + 1)
            self.engine.load_weights(self._our_names(staged), version)
        except Exception as err:
            if hasattr(weights, "ack"):
                weights.ack(f"{type(err).__name__}: {err}")
            raise
        if hasattr(weights, "ack"):
            weights.ack(None)

    def _our_names(self, staged: dict) -> dict:
        """HF Qwen3-MoE names (what verl engines publish, `MegatronFP4Engine` included) -> the
        engine's own parameter names; tensors already under our names pass through."""
        if not any(n.startswith(HF_PREFIX) for n in staged):
            return staged
        try:
            return ours_from_hf_state_dict(self.engine.model, staged)
        except ValueError as err:
            raise ValueError(f"rollout {self.engine.name!r} rejects the weights: {err}") from err

    def generate_tokens(self, prompt_ids: list[int], sampling_params: dict, seed: Optional[int] = None):
        """One request in token-in/token-out form, as verl's agent loop sends it to a rollout server
        (`MegatronFP4Server.generate`): verl's sampling dict in, verl's `TokenOutput` out."""
        from verl.workers.rollout.replica import TokenOutput

        from megatron_fp4.verl.sampling import sampling_from_verl

        if "weights" not in self.resident:
            raise RuntimeError("weights are released; call resume(['weights']) before generating")
        params = sampling_from_verl(sampling_params, self.response_length, self.stop_token_ids, seed)
        out = self.engine.generate([list(prompt_ids)], params)
        return TokenOutput(token_ids=list(out.response_ids[0]), log_probs=[float(x) for x in out.log_probs[0]],
                           stop_reason="completed", extra_fields={"global_steps": out.version})

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        if "weights" not in self.resident:
            raise RuntimeError("weights are released; call resume(['weights']) before generate_sequences")
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
        meta = prompts.meta_info
        greedy = not self._sampling(meta, "do_sample", True)
        length = int(meta.get("response_length", self.response_length))
        seeds = meta.get("seeds")
        stop = _token_ids(meta.get("eos_token_id")) or self.stop_token_ids
        pad = meta.get("pad_token_id")
        pad = self.engine.pad_id if pad is None else int(pad)
        temperature = 0.0 if greedy else float(self._sampling(meta, "temperature", 1.0))
        top_k, top_p = max(0, int(self._sampling(meta, "top_k", 0) or 0)), float(self._sampling(meta, "top_p", 1.0))
        requests = [ids[i][mask[i].bool()].tolist() for i in range(ids.shape[0])]
        params = [SamplingParams(max_new_tokens=length, temperature=temperature, top_k=top_k, top_p=top_p,
                                 stop_token_ids=stop, seed=None if seeds is None else int(seeds[i]))
                  for i in range(len(requests))]
        routing = bool(meta.get("return_routing", False)) or \
            bool(getattr(self.config, "enable_rollout_routing_replay", False))
        out = self.engine.generate(requests, params, return_routing=routing)
        B, P = len(requests), ids.shape[1]
        responses = torch.full((B, length), pad, dtype=torch.long)
        response_mask = torch.zeros((B, length), dtype=torch.long)
        log_probs = torch.zeros((B, length), dtype=torch.float32)
        routed = None
        for i, r in enumerate(out.response_ids):
            responses[i, :len(r)] = torch.tensor(r)
            response_mask[i, :len(r)] = 1
            log_probs[i, :len(r)] = out.log_probs[i]
            if routing:
                if routed is None:
                    routed = torch.full((B, P + length) + tuple(out.routing[i].shape[1:]), -1, dtype=torch.long)
                routed[i, P - 1:P - 1 + len(r)] = out.routing[i]
        attention_mask = torch.cat([mask.long(), response_mask], dim=1)
        batch = {"prompts": ids, "responses": responses, "input_ids": torch.cat([ids, responses], dim=1),
                 "attention_mask": attention_mask, "position_ids": positions_from_mask(attention_mask),
                 "response_mask": response_mask, "rollout_log_probs": log_probs}
        if routed is not None:
            batch["routed_experts"] = routed
        return DataProto.from_dict(tensors=batch, meta_info={"weight_version": out.version})


_ROLLOUT_REGISTRY[("megatron_fp4", "async")] = f"{__name__}.MegatronFP4Rollout"  # rollout.name: megatron_fp4
