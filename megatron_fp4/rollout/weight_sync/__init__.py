"""Trainer → rollout weight updates with two completion points (snapshot ready, then loaded).

- `publisher`: `WeightPublisher`, `WeightReceiver`, `InProcessTransport`, `PublishHandle`, `WeightSyncError`
- `distributed`: the same protocol across processes (`DistributedTransport`, `DistributedReceiver`:
  JSON headers + byte buckets on a process group)
- `sharded`: publishing from a sharded trainer (pipeline stages and expert shards, bucket by bucket)
- `buckets`: the (name, shape, dtype, bytes) wire format
- `peer_group`, `peer_store`: the token-authenticated process group between a publisher and its rollouts
"""
