"""The update-time row of bench_vllm_goals.py for a separate `vllm serve` process: every tensor of the
`--update-mb` MB fp32 model pushed through vLLM's weight-transfer API with the plugin's `megatron_fp4`
backend (`integrations.vllm.serve.VLLMServerTransport` in a `WeightPublisher`), median of 3.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 PYTHONPATH=$PWD /work/venv-vllm/bin/python benchmarks/bench_vllm_goals.py \\
        --only update-time-serve

Two times per publish: `publish()` returning (the snapshot: the trainer may go on) and snapshot ->
loaded (pause, start, the bytes over the PeerGroup with the server's checks, finish = the load,
resume), the second being the issue's "update time".
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path


def update_time_serve_rows(args, work: Path, update_config, row, log) -> list:
    import torch

    from megatron_fp4.integrations.hf import load_hf_checkpoint
    from megatron_fp4.integrations.vllm import export_for_vllm
    from megatron_fp4.integrations.vllm.serve import VLLMServerTransport, start_vllm_server
    from megatron_fp4.model import build_model
    from megatron_fp4.rollout.weight_sync.peer_group import new_sync_token
    from megatron_fp4.rollout.weight_sync.publisher import WeightPublisher

    cfg = update_config(args.update_mb)
    d = export_for_vllm(build_model(cfg, seed=0), cfg, work / "upd_serve", dtype=None, overwrite=True)
    tensors = load_hf_checkpoint(d)[1]
    mb = sum(t.numel() * t.element_size() for t in tensors.values()) / 2 ** 20
    token = new_sync_token()
    log(f"update-time-serve: {mb:.0f} MB fp32 ({len(tensors)} tensors), vllm serve start")
    server = start_vllm_server(d, sys.executable, token, log=work / "upd_serve.log",
                               extra=["--max-model-len", "64", "--max-num-seqs", "2", "--kv-cache-memory-bytes",
                                      str(32 << 20)])
    try:
        transport = VLLMServerTransport(server.url, token=token, timeout_s=600)
        snaps, loads = [], []
        for i in range(3):
            update = {k: v * (1.0 + 0.01 * (i + 1)) for k, v in tensors.items()}
            h = WeightPublisher(lambda: update.items(), [transport], bucket_bytes=64 << 20).publish(i + 1)
            h.wait_loaded(600)
            snaps.append(h.snapshot_s)
            loads.append(h.load_s)
            server.client.completions([[1, 2, 3, 4]], 2, server.model)
        transport.close()
    finally:
        server.stop()
    s = statistics.median(loads)
    log(f"update-time-serve: loaded after {', '.join(f'{x:.2f}' for x in loads)} s; snapshot "
        f"{', '.join(f'{x:.2f}' for x in snaps)} s")
    return [row(f"update time into `vllm serve`, {mb:.0f} MB fp32, weight-transfer API (median of 3; snapshot "
                f"{statistics.median(snaps):.2f} s; threads {torch.get_num_threads()})", f"{s:.2f} s", "≤ 2 s", s <= 2.0)]
