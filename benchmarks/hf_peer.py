"""The peer users would pick instead: HF transformers' `Qwen3MoeForCausalLM` with our model's config
and weights (through the project's HF exporter, `integrations.hf`), for the side-by-side benchmarks.

Nothing is downloaded: the HF model is built in memory from `hf_config_from_ours` and loaded with
`to_hf_state_dict(layout="fused")` (strict), so both sides compute the same function.
"""
from __future__ import annotations

import resource
import sys

import torch
import torch.nn.functional as F


def hf_model_like(model):
    """A `Qwen3MoeForCausalLM` (fp32, transformers' default kernels) holding `model`'s weights."""
    import transformers

    from megatron_fp4.integrations.hf import hf_config_from_ours, to_hf_state_dict

    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**hf_config_from_ours(model.cfg)))
    sd = {k: v.detach().clone().float() for k, v in to_hf_state_dict(model, layout="fused").items()}
    if model.cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    hf.load_state_dict(sd, strict=True)
    return hf.float()


def hf_generate(hf, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy `generate()` with its default KV cache, exactly `new_tokens` new tokens per row."""
    with torch.no_grad():
        out = hf.eval().generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, prompts.shape[1]:]


class HFTrainStep:
    """Forward + backward (next-token cross entropy, its router load-balancing loss) + gradient
    clipping + `torch.optim.AdamW` on the HF model: the training step a transformers user runs."""

    def __init__(self, hf, opt_cfg):
        self.hf = hf.train()
        self.clip = opt_cfg.clip_grad
        self.opt = torch.optim.AdamW(hf.parameters(), lr=opt_cfg.lr, betas=(opt_cfg.beta1, opt_cfg.beta2),
                                     eps=opt_cfg.eps, weight_decay=opt_cfg.weight_decay)

    def load_from(self, model) -> None:
        """Copy `model`'s current weights in (optimizer state kept)."""
        from megatron_fp4.integrations.hf import to_hf_state_dict
        with torch.no_grad():
            params = dict(self.hf.named_parameters())
            for k, v in to_hf_state_dict(model, layout="fused").items():
                if k in params:
                    params[k].copy_(v)

    def __call__(self, micro_batches) -> float:
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb in micro_batches:
            out = self.hf(input_ids=mb["tokens"], output_router_logits=True)
            logits = out.logits.float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mb["labels"].reshape(-1), ignore_index=-100)
            if out.aux_loss is not None:
                loss = loss + self.hf.config.router_aux_loss_coef * out.aux_loss
            (loss / len(micro_batches)).backward()
            total += loss.item() / len(micro_batches)
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.hf.parameters(), self.clip)
        self.opt.step()
        return total


def peak_rss_mib() -> float:
    """This process's peak resident set (the high-water mark since it started), MiB."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2 ** 20
