"""One vLLM attention-layer step over a paged KV cache, as vLLM's `Attention` layer runs an impl
(the plugin's `TrainerAttentionImpl` family): the step's keys and values written through its slot
mapping (`do_kv_cache_update`), then `forward` with the step's metadata. Shared by the no-vLLM tests
of the plugin's attention pieces (test_vllm_mla.py, test_vllm_gpt_oss_attention.py)."""
from __future__ import annotations

import torch


def paged_step(impl, cache, table, chunks, block: int, q, k, v, out):
    """`chunks` [(request, first position, rows)] of this step; `table[request]` its block ids; k and v
    [T, kv_heads, head_dim]; `out` the output vLLM allocates. Returns what the impl wrote into it."""
    slots = torch.tensor([table[r][p // block] * block + p % block for r, p0, xs in chunks
                          for p in range(p0, p0 + len(xs))])
    impl.do_kv_cache_update(None, k, v, cache, slots)
    meta = type("Meta", (), {})()
    meta.causal = True
    meta.query_start_loc = torch.tensor([0] + torch.tensor([len(xs) for _, _, xs in chunks]).cumsum(0).tolist())
    meta.seq_lens = torch.tensor([p0 + len(xs) for _, p0, xs in chunks])
    width = max(map(len, table))
    meta.block_table = torch.tensor([table[r] + [0] * (width - len(table[r])) for r, _, _ in chunks])
    return impl.forward(None, q, None, None, cache, meta, out)
