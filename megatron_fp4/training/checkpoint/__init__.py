"""Checkpoints: one directory format for every layout, atomic, checksummed, loaded as data only.

- `directory`: the format (``step_*`` directories, ``meta.json``, ``latest``), save/load/resume entry points
- `files`: the file-level crash-safety rules (temp dir, fsync, one rename, sha256)
- `dcp`: the tensors through torch.distributed.checkpoint, by global names, reshardable across layouts;
  `dcp_tp`, `dcp_etp`: tensor- and expert-tensor-parallel shards; `dcp_metadata`: DCP's `.metadata`
  read as data; `dcp_checks`: its sizes checked before anything is allocated
"""
