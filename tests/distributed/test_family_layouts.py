"""The model families beside Qwen3-MoE on the parallel layouts match the single-process run: pp2
(1F1B), ep2 with the all-to-all and the GC-MoE dispatchers, FP4 off, and ep2 with FP4 MoEResQ
experts; 2 gloo processes, tiny models:

- GPT-OSS (`model/gpt_oss.py`): sliding-window and full layers, YaRN, sinks, biases;
- DeepSeek-V3 (`model/deepseek_v3.py`): latent attention, a dense first layer, a shared expert,
  group-limited sigmoid routing and aux-loss-free bias updates between the steps.

Float64, as tests/distributed/test_parallel_training_ep.py: losses, the first step's gradients and
the parameters after the steps within ``FP64_REL`` (1e-10) relative per tensor. Under EP an
expert's GEMM runs on both dp ranks' tokens at once and the dp gradient sum runs in another order,
both fp64 rounding (~1e-16) effects; with FP4 the expert's weight gradient is quantized per source
micro-batch (`DispatchPlan.expert_segments`), so the same holds. Expert tensors (w13, w2 and
GPT-OSS's b13, b2) are compared with the rows of the full tensor this rank holds; the router biases
after the steps (DeepSeek-V3's, moved by the data-parallel sum of the expert loads) must be equal.
"""
import pytest

from megatron_fp4.config import Config
from tests.distributed.conftest import layout_results
from tests.numerics import FP64_REL, rel, single_thread

STEPS = 2
PARALLEL = {
    "pp2": dict(pp=2),
    "ep2": dict(ep=2),
    "ep2_gcmoe": dict(ep=2, expert_dispatcher="gcmoe", gcmoe_chunk_tokens=8, gcmoe_ring_slots=2),
    "fp4_ep2": dict(ep=2, fp4=True),
}


def _gpt_oss(m) -> None:
    m.family, m.num_layers, m.vocab_size = "gpt_oss", 4, 32
    m.layer_types, m.sliding_window = ["sliding_attention", "full_attention"] * 2, 4
    m.rope_scaling = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8}


def _deepseek_v3(m) -> None:
    m.family, m.num_layers, m.vocab_size, m.num_kv_heads = "deepseek_v3", 4, 32, 4
    m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim = 16, 16, 8, 4, 12
    m.num_experts, m.top_k, m.moe_n_group, m.moe_topk_group, m.moe_routed_scaling_factor = 8, 3, 4, 2, 2.5
    m.num_shared_experts, m.shared_expert_ffn_hidden_size, m.dense_layers = 1, m.moe_ffn_hidden_size, [0]
    m.moe_router_bias_update_rate = 1e-3


FAMILIES = {"gpt_oss": _gpt_oss, "deepseek_v3": _deepseek_v3}
LAYOUTS = {f"{family}/{name}": (family, spec) for family in FAMILIES for name, spec in PARALLEL.items()}


def family_cfg(family: str, spec: dict) -> Config:
    spec = dict(spec)
    fp4 = spec.pop("fp4", False)
    cfg = Config()
    cfg.dtype = "fp64"
    FAMILIES[family](cfg.model)
    cfg.numerics.invariance = "standard"
    s = cfg.schedule
    s.global_batch_size, s.micro_batch_size, s.seq_len, s.train_steps, s.warmup_steps = 8, 2, 16, STEPS, 1
    cfg.data.num_samples = 200
    cfg.logging.tensorboard_dir, cfg.logging.progress = None, False
    cfg.fp4.compile = "off"
    if not fp4:
        cfg.fp4.scope, cfg.fp4.train_mode = "none", "bf16"
    for key, value in spec.items():
        setattr(cfg.parallel, key, value)
    return cfg


def _train(trainer) -> dict:
    from megatron_fp4.training.trainer import lm_loss_fn

    trainer.model.train()
    trainer.optimizer.zero_grad()
    trainer.forward_backward(trainer.next_micro_batches(), lm_loss_fn)
    trainer.optimizer.finish_grad_sync()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.sampler.load_state_dict({"epoch": 0, "consumed": 0})
    losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
    names = {p: n for n, p in trainer.model.named_parameters()}
    offsets = {names[p]: moe.experts.expert_offset for moe in trainer.model.moe_layers()
               for p in (getattr(moe.experts, a, None) for a in ("w13", "w2", "b13", "b2")) if p is not None}
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    params.update({n: b.clone() for n, b in trainer.model.named_buffers() if n.endswith("router.expert_bias")})
    dispatchers = {type(m.dispatcher).__name__ for m in trainer.model.moe_layers()}
    trainer.optimizer.remove_hooks()
    return dict(losses=losses, grads=grads, params=params, offsets=offsets, dispatchers=dispatchers)


def _run(rank, world_size, layouts):
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    out = {}
    for name, (family, spec) in layouts.items():
        cfg = family_cfg(family, spec)
        pp = cfg.parallel.pp
        out[name] = _train(Trainer(cfg, ParallelMesh.build(pp, world_size // pp, cfg.parallel.ep)))
    return out


def _reference(name: str) -> dict:
    from megatron_fp4.training.trainer import Trainer

    family, spec = LAYOUTS[name]
    with single_thread():
        return _train(Trainer(family_cfg(family, {k: v for k, v in spec.items() if k == "fp4"})))


results = layout_results(_run, 2, LAYOUTS, timeout_s=900)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(results, name):
    ref = _reference(name)
    seen = set()
    for rank, res in enumerate(results):
        r = res[name]
        for got, want in zip(r["losses"], ref["losses"]):
            assert abs(got - want) <= FP64_REL * abs(want), (name, rank, r["losses"], ref["losses"])
        for kind in ("grads", "params"):
            for pname, value in r[kind].items():
                want = ref[kind][pname].detach()
                if pname in r["offsets"]:
                    off = r["offsets"][pname]
                    want = want[off:off + value.shape[0]]
                assert rel(value, want) <= FP64_REL, (name, rank, kind, pname, rel(value, want))
                seen.add(pname)
    assert seen == set(ref["params"]), f"{name}: held by no rank: {set(ref['params']) - seen}"
    if "gcmoe" in name:
        assert all(res[name]["dispatchers"] == {"GCMoEDispatcher"} for res in results)
