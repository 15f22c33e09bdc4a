"""The ``auto`` warm-up compile of one fake-quant variant, in a child process (``fused.py``).

    python -m megatron_fp4.fp4.compile_worker '{"key": ["nvfp4", "row", "1d", "float32", "float32"], "blocks": [512, 4, 16]}'

(the spec is the last argument; ``fused._worker_command`` starts it for this copy of the package).

Compiles the variant's kernels and checks them against the uncompiled bodies on the same probe
inputs the parent will use, which leaves inductor's on-disk cache warm for the parent's own
(quick) compile. Exit code 0: ready; ``WORKER_NOT_EXACT``: the kernels are not bit-exact on this
CPU; ``WORKER_BROKEN``: the backend failed (the reason is the last line on stderr). The child
runs nothing of the parent's job, so its compile cannot touch the parent's torch state, and it
exits when its parent does (the parent kills it at exit; a watchdog covers a parent that died).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time


def exit_with_parent(spec_json: str) -> None:
    """End this process once the parent named in the spec is gone (also if it went while we imported)."""
    parent = json.loads(spec_json)["parent"]
    threading.Thread(target=_watch, args=(parent,), daemon=True).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def main(spec_json: str) -> int:
    exit_with_parent(spec_json)
    import torch

    from megatron_fp4.fp4 import fused, fused_resq

    torch.set_num_threads(1)  # the parent's job keeps the cores; the compile is not in a hurry
    spec = json.loads(spec_json)
    key = tuple(getattr(torch, k) if isinstance(getattr(torch, k, None), torch.dtype) else k for k in spec["key"])
    variant = fused.variant_of(key, make=fused_resq.make_variant if key[0] == fused_resq.KIND else None)
    variant.build(fused._samples(tuple(spec["blocks"]), key[-2]), loud=False)
    if variant.state == "ready":
        return 0
    if variant.store.broken is not None:
        print(variant.store.broken.strip().replace("\n", " "), file=sys.stderr, flush=True)
        return fused.WORKER_BROKEN
    return fused.WORKER_NOT_EXACT


if __name__ == "__main__":
    code = main(sys.argv[-1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # do not wait for inductor's worker pools: the cache is written
