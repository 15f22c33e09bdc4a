"""verl rollout over our `RolloutEngine` (same model code and MoEResQ numerics as training).

`generate_sequences` follows verl's batch layout: in `input_ids` [B, P] left-padded prompts with
`attention_mask`; out `prompts`, `responses` [B, R] right-padded, `input_ids` = prompts|responses,
`attention_mask`, `position_ids`, `response_mask`, `rollout_log_probs` [B, R] (raw model
distribution, what the IS correction needs) and, with meta_info["return_routing"], `routed_experts`
[B, R, num_moe_layers, k].
"""
from __future__ import annotations

from typing import Optional

import torch
from verl import DataProto
from verl.workers.rollout.base import BaseRollout

from megatron_fp4.integrations.hf.qwen3_moe import ours_from_hf_state_dict
from megatron_fp4.rollout.engine import RolloutEngine, positions_from_mask
from megatron_fp4.rollout.sampling import SamplingParams


HF_PREFIX = "model."  # every HF Qwen3-MoE name but lm_head.weight; none of ours


class MegatronFP4Rollout(BaseRollout):
    def __init__(self, config=None, model_config=None, device_mesh=None, *args, engine: RolloutEngine,
                 response_length: int = 16, stop_token_ids: tuple = (), **kwargs):
        super().__init__(config, model_config, device_mesh)
        self.engine = engine
        self.response_length = int(getattr(self.config, "response_length", None) or response_length)
        self.stop_token_ids = tuple(stop_token_ids)
        self.resident = {"weights", "kv_cache"}

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
        version = getattr(weights, "version", None)
        version = version if version is not None else (global_steps if global_steps is not None else self.engine.version + 1)
        try:
            if hasattr(weights, "__aiter__"):
                staged = {n: t.clone() async for n, t in weights}
            else:
                staged = {n: t.clone() for n, t in weights}
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

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        if "weights" not in self.resident:
            raise RuntimeError("weights are released; call resume(['weights']) before generate_sequences")
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
        meta = prompts.meta_info
        greedy = not meta.get("do_sample", True)
        length = int(meta.get("response_length", self.response_length))
        seeds = meta.get("seeds")
        requests = [ids[i][mask[i].bool()].tolist() for i in range(ids.shape[0])]
        params = [SamplingParams(max_new_tokens=length, temperature=0.0 if greedy else float(meta.get("temperature", 1.0)),
                                 top_k=int(meta.get("top_k", 0) or 0), top_p=float(meta.get("top_p", 1.0)),
                                 stop_token_ids=self.stop_token_ids, seed=None if seeds is None else int(seeds[i]))
                  for i in range(len(requests))]
        routing = bool(meta.get("return_routing", False))
        out = self.engine.generate(requests, params, return_routing=routing)
        B, pad = len(requests), self.engine.pad_id
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
                    routed = torch.zeros((B, length) + tuple(out.routing[i].shape[1:]), dtype=torch.long)
                routed[i, :len(r)] = out.routing[i]
        attention_mask = torch.cat([mask.long(), response_mask], dim=1)
        batch = {"prompts": ids, "responses": responses, "input_ids": torch.cat([ids, responses], dim=1),
                 "attention_mask": attention_mask, "position_ids": positions_from_mask(attention_mask),
                 "response_mask": response_mask, "rollout_log_probs": log_probs}
        if routed is not None:
            batch["routed_experts"] = routed
        return DataProto.from_dict(tensors=batch, meta_info={"weight_version": out.version})
