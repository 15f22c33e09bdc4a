"""`memory_plan.weight_grad_transient` against the weight gradients a real `Trainer`'s backward returns
to autograd's accumulation (a leaf's tensor hook sees each before it is added into the flat buffer's
view; a fused expert kernel that writes straight into the buffer returns none)."""
from __future__ import annotations

import pytest
import torch

from megatron_fp4.config import default_config_path, load_config
from megatron_fp4.model.moe import GroupedExperts
from megatron_fp4.training.memory_plan import plan_memory

TINY = ["schedule.micro_batch_size=2", "schedule.seq_len=32", "logging.tensorboard_dir=null", "checkpoint.dir=null",
        "logging.progress=false", "device=cpu"]


def _returned_grad_bytes(trainer) -> tuple[int, set]:
    """(largest per-module sum of returned weight-gradient bytes in one micro-batch's backward, the
    kinds of module whose gradients were returned) over one step."""
    per_module: dict = {}
    kinds: set = set()
    current = {"mb": 0}

    def hook_for(module):
        def hook(grad):
            if grad is None:  # a fused kernel wrote into the buffer: nothing returned
                return
            key = (id(module), current["mb"])
            per_module[key] = per_module.get(key, 0) + grad.numel() * grad.element_size()
            kinds.add(type(module).__name__)
        return hook

    handles = [p.register_hook(hook_for(m)) for m in trainer.model.modules()
               for p in m.parameters(recurse=False) if p.requires_grad]
    s = trainer.cfg.schedule
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, trainer.cfg.model.vocab_size, (trainer.num_microbatches, s.micro_batch_size, s.seq_len),
                           generator=gen)

    def loss_fn(model, mb):
        from megatron_fp4.training.trainer import lm_loss_fn
        current["mb"] += 1
        return lm_loss_fn(model, mb)

    trainer.train_step_with_loss([{"tokens": t, "labels": t} for t in tokens], loss_fn)
    for h in handles:
        h.remove()
    return max(per_module.values()), kinds


@pytest.mark.parametrize("extra", [["schedule.global_batch_size=8"], ["schedule.global_batch_size=2"],
                                   ["schedule.global_batch_size=4", "fp4.scope=none"]])
def test_grad_transient_is_the_largest_module_gradient_returned(extra):
    from megatron_fp4.training.trainer import Trainer

    cfg = load_config(default_config_path(), TINY + extra)
    trainer = Trainer(cfg, build_data=False)
    largest, kinds = _returned_grad_bytes(trainer)
    plan = plan_memory(cfg, 1)[0]
    assert plan.grad_transient == largest
    # one micro-batch: the grouped expert kernels write into the zeroed buffer (no gradient returned)
    assert (GroupedExperts.__name__ in kinds) == (trainer.num_microbatches > 1)
    assert plan.grad_transient > 0


def _returned_by_module(trainer) -> dict:
    """Per module name: the weight-gradient bytes its backward returned in one step of one micro-batch."""
    out: dict = {}

    def hook_for(name):
        def hook(grad):
            if grad is not None:
                out[name] = out.get(name, 0) + grad.numel() * grad.element_size()
        return hook

    handles = [p.register_hook(hook_for(n)) for n, m in trainer.model.named_modules()
               for p in m.parameters(recurse=False) if p.requires_grad]
    s = trainer.cfg.schedule
    tokens = torch.randint(0, trainer.cfg.model.vocab_size, (s.micro_batch_size, s.seq_len),
                           generator=torch.Generator().manual_seed(0))
    from megatron_fp4.training.trainer import lm_loss_fn
    trainer.train_step_with_loss([{"tokens": tokens, "labels": tokens}], lm_loss_fn)
    for h in handles:
        h.remove()
    return out


@pytest.mark.parametrize("family, extra", [
    ("qwen3_moe", ["fp4.scope=experts+attention"]),  # MoEResQLinear quantizing: _WgradHalf returns its gradient
    ("qwen3_moe", ["fp4.scope=experts+attention", "fp4.train_mode=bf16"]),  # bf16 mode: the tiled GEMM fuses
    ("qwen3_moe", ["dtype=bf16"]),  # the router's fp32 upcast is a copy: its gradient is returned
    ("gpt_oss", []),  # the per-expert loop (views of w13/w2: no claim) and every bias
])
def test_returned_grad_bytes_per_module(family, extra):
    """`returned_grad_bytes` (which weights `_fused_weights` writes into the buffer) equals, module by
    module, the gradients a real Trainer's backward returns at one micro-batch per step."""
    from megatron_fp4.training.memory_plan import local_meta_model, returned_grad_bytes
    from megatron_fp4.training.trainer import Trainer
    from tests.distributed.test_family_layouts import FAMILIES

    cfg = load_config(default_config_path(), TINY + ["schedule.global_batch_size=2"] + extra)
    if family != "qwen3_moe":
        FAMILIES[family](cfg.model)
    cfg.validate()
    measured = _returned_by_module(Trainer(cfg, build_data=False))
    assert returned_grad_bytes(local_meta_model(cfg, 0, 0), cfg, 1, 1) == measured
