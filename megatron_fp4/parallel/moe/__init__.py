"""Expert parallelism: the MoE layer's tokens and experts over ranks.

- `expert_parallel`: expert placement and the ep dispatcher choice (all-to-all or GC-MoE)
- `alltoall`: dispatch / combine by all-to-all
- `gcmoe`, `gcmoe_transfer`, `gcmoe_round`: GC-MoE (token transfer and expert compute on separate
  workers, a chunked ring buffer with per-chunk ready signals, double-buffered receive counters,
  deterministic combine order); `gcmoe_decode`: its decode-time path for the rollout engine
- `expert_tensor_parallel`: experts' ffn dim cut over etp ranks; `tp_moe`: MoE layers under tensor
  parallelism (tokens local or gathered over tp)
"""
