"""One way to get a rollout: `make_rollout(kind, trainer, pad_id, bucket_bytes, **options)`.

| kind | what serves the rollout |
|---|---|
| ``engine`` | the own engine: in this process for a single-process trainer (`InProcessRollout`), in a process of its own for a sharded one (`RemoteRollout`) |
| ``engine-process`` | the own engine in a process of its own, also for a single-process trainer (it generates while this one trains) |
| ``vllm`` | vLLM + the plugin in a process (and environment) of its own (`VLLMRollout`) |
| ``vllm-serve`` | a `vllm serve` process fed through vLLM's weight-transfer API (`VLLMServeRollout`) |

verl's rollout is verl's to build (its registry name ``megatron_fp4``: `megatron_fp4.verl.rollout`).
Every kind is a `megatron_fp4.rollout.protocol.Rollout`; constructing one is collective under torchrun.
"""
from __future__ import annotations

from megatron_fp4.rl.rollouts.client import InProcessRollout, RemoteRollout

ROLLOUT_KINDS = ("engine", "engine-process", "vllm", "vllm-serve")
_REMOTE_OPTIONS = {"addr", "name", "timeout_s", "threads"}
_VLLM_OPTIONS = _REMOTE_OPTIONS | {"python", "work_dir"}
_OPTIONS = {"engine": _REMOTE_OPTIONS, "engine-process": _REMOTE_OPTIONS, "vllm": _VLLM_OPTIONS,
            "vllm-serve": (_VLLM_OPTIONS - {"threads"}) | {"max_num_seqs"}}


def make_rollout(kind: str, trainer, pad_id: int, bucket_bytes: int, **options):
    """The rollout of `kind` (module doc) for `trainer`; `options` are the kind's (addr, name,
    timeout_s, threads; vLLM's python, work_dir; vllm-serve's max_num_seqs)."""
    if kind not in ROLLOUT_KINDS:
        raise ValueError(f"rollout kind {kind!r} is not one of {', '.join(ROLLOUT_KINDS)}")
    unknown = sorted(set(options) - _OPTIONS[kind])
    if unknown:
        raise ValueError(f"rollout kind {kind!r} takes no option {', '.join(unknown)} "
                         f"(it takes {', '.join(sorted(_OPTIONS[kind]))})")
    if kind == "vllm":
        from megatron_fp4.rl.rollouts.vllm import VLLMRollout
        return VLLMRollout(trainer, pad_id, bucket_bytes, **options)
    if kind == "vllm-serve":
        from megatron_fp4.rl.rollouts.vllm import VLLMServeRollout
        return VLLMServeRollout(trainer, pad_id, bucket_bytes, **options)
    if kind == "engine-process" or trainer.mesh.is_distributed:
        return RemoteRollout(trainer, pad_id, bucket_bytes, **options)
    # in process: the options of a rollout process do not apply (the name does)
    return InProcessRollout(trainer, pad_id, bucket_bytes, **{k: v for k, v in options.items() if k == "name"})
