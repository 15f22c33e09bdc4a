"""A sharded DCP checkpoint of an ep2 × dp2 run reads back, in one process without a process group,
as the full model state (expert slices stacked in global order) — bitwise equal to the live params,
and converts to HF safetensors through tools/convert_checkpoint.py."""
import torch

from tests.distributed.launch import run_distributed
from tests.distributed.test_parallel_training import tiny_cfg


def _train_and_save(rank, world_size, root):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    cfg = tiny_cfg(ep=2, zero_stage=2)
    t = Trainer(cfg, ParallelMesh.build(1, 2, 2))
    t.train_step()
    t.save_checkpoint(root)
    out = {}
    for name, p in t.model.named_parameters():
        offset = 0
        for moe in t.model.moe_layers():
            if p is moe.experts.w13 or p is moe.experts.w2:
                offset = moe.experts.expert_offset
        out[name] = (offset, p.detach().clone())
    return out


def test_dcp_checkpoint_reads_back_whole_and_converts(tmp_path):
    from megatron_fp4.training.checkpoint.dcp import load_full_model_state
    from tools.convert_checkpoint import main

    results = run_distributed(_train_and_save, 2, args=(str(tmp_path / "ckpt"),))
    full = load_full_model_state(tmp_path / "ckpt")
    for rank_params in results:
        for name, (offset, value) in rank_params.items():
            want = full[name][offset:offset + value.shape[0]] if offset or ".experts." in name else full[name]
            assert torch.equal(want, value), name
    assert full["layers.0.mlp.experts.w13"].shape[0] == 8  # both ranks' 4 experts, stacked
    assert main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").exists()
