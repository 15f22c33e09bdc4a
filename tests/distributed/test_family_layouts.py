"""The model families beside Qwen3-MoE on the parallel layouts match the single-process run: pp2
(1F1B), ep2 with the all-to-all and the GC-MoE dispatchers, FP4 off, and ep2 with FP4 MoEResQ
experts, tp2 with and without sequence parallel, context parallel cp2 and cp2×ep2 (2 gloo
processes); tp2×dp2×ep2, pp2×tp2, FP4 experts routing each tp rank's own tokens
(moe_tp_tokens=local, ep folding tp), pp2×dp2×ep2, pp2×tp2×ep2 (all three axes in one run: the ep
group folds the tp ranks, moe_tp_tokens=local; FP4 off and with FP4 experts), expert tensor
parallel etp2, cp2×tp2 and cp2×pp2×ep2 (4 processes); tiny models:

- GPT-OSS (`model/gpt_oss.py`): sliding-window and full layers, YaRN, sinks, biases; under cp the
  window (4 keys, crossing the cp chunks of 4 tokens) and the sinks masked by the queries' global
  positions;
- DeepSeek-V3 (`model/deepseek_v3.py`): latent attention, a dense first layer, a shared expert,
  group-limited sigmoid routing and aux-loss-free bias updates between the steps (the expert loads
  summed over dp × cp); under cp the per-head non-rotary keys and values and the one rotary key part
  all heads share (decoupled RoPE, rotated at the global positions) gathered in one all-gather.

Float64, as tests/distributed/test_parallel_training_ep.py: losses, the first step's gradients and
the parameters after the steps within ``FP64_REL`` (1e-10) relative per tensor. Under EP an
expert's GEMM runs on both dp ranks' tokens at once and the dp gradient sum runs in another order,
both fp64 rounding (~1e-16) effects; with FP4 the expert's weight gradient is quantized per source
micro-batch (`DispatchPlan.expert_segments`), so the same holds. Under tp the ranks add the
same products in another order (partial sums over the heads, the vocab-parallel softmax), the same
fp64 rounding effects (derivation: tests/distributed/test_tp_trainer.py); under cp the K/V
gather's backward and the loss shares sum in another order (tests/distributed/test_cp_layouts.py). Expert tensors (w13, w2 and
GPT-OSS's b13, b2) and tp/etp-cut tensors are compared with the slice of the full tensor this rank holds; the router biases
after the steps (DeepSeek-V3's, moved by the data-parallel sum of the expert loads) must be equal.
"""
import pytest
import torch

from megatron_fp4.config import Config
from tests.distributed.conftest import layout_results
from tests.numerics import FP64_REL, rel, single_thread

STEPS = 2
PARALLEL = {
    "pp2": dict(pp=2),
    "ep2": dict(ep=2),
    "ep2_gcmoe": dict(ep=2, expert_dispatcher="gcmoe", gcmoe_chunk_tokens=8, gcmoe_ring_slots=2),
    "fp4_ep2": dict(ep=2, fp4=True),
    "tp2_sp": dict(tp=2),
    "tp2_no_sp": dict(tp=2, sequence_parallel=False),
    "cp2": dict(cp=2),
    "cp2_ep2": dict(cp=2, ep=2),
}
PARALLEL_4 = {  # 4 processes
    "tp2_dp2_ep2": dict(tp=2, ep=2),
    "tp2_pp2": dict(tp=2, pp=2),
    "fp4_tp2_dp2_ep2_local": dict(tp=2, ep=2, moe_tp_tokens="local", fp4=True),
    "pp2_dp2_ep2": dict(pp=2, ep=2),
    # pp × tp × ep in one run: the ep group folds the tp ranks (each routes its own tokens)
    "pp2_tp2_ep2_local": dict(pp=2, tp=2, ep=2, moe_tp_tokens="local"),
    "fp4_pp2_tp2_ep2_local": dict(pp=2, tp=2, ep=2, moe_tp_tokens="local", fp4=True),
    "cp2_tp2": dict(cp=2, tp=2),
    "cp2_pp2_ep2": dict(cp=2, pp=2, ep=2),
}
ETP_4 = {"tp2_dp2_ep2_etp2": dict(tp=2, ep=2, etp=2), "fp4_tp2_etp2": dict(tp=2, etp=2, fp4=True)}


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
LAYOUTS_4 = {f"{family}/{name}": (family, spec) for family in FAMILIES
             for name, spec in {**PARALLEL_4, **ETP_4}.items()}


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
    if trainer.tp_plan is not None:  # as `apply_update` does before the dp reduction
        trainer.tp_plan.finish_grads()
        if trainer.mesh.ep > 1:
            trainer._agree_whole_grads_over_tp()
    trainer.optimizer.finish_grad_sync()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.sampler.load_state_dict({"epoch": 0, "consumed": 0})
    losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
    dispatchers = {type(m.dispatcher).__name__ for m in trainer.model.moe_layers()}
    trainer.optimizer.remove_hooks()
    return dict(losses=losses, grads=grads, params=held_params(trainer), shards=held_slices(trainer),
                dispatchers=dispatchers)


def held_slices(trainer) -> dict:
    """name -> [(dim, index)]: the slice of the single process's tensor this rank holds (expert
    parallel's experts, then the tp / etp cut)."""
    names = {p: n for n, p in trainer.model.named_parameters()}
    shards = {}
    for moe in trainer.model.moe_layers():
        for p in (getattr(moe.experts, a, None) for a in ("w13", "w2", "b13", "b2")):
            if p is not None:
                off = moe.experts.expert_offset
                shards[names[p]] = [(0, torch.arange(off, off + p.shape[0]))]
    for n, p in trainer.model.named_parameters():
        for attr in ("tp_shard", "etp_shard"):
            if getattr(p, attr, None) is not None:
                shards.setdefault(n, []).append(getattr(p, attr))
    return shards


def held_params(trainer) -> dict:
    """Every parameter this rank holds and the routers' expert_bias buffers (moved outside the optimizer)."""
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    params.update({n: b.clone() for n, b in trainer.model.named_buffers() if n.endswith("router.expert_bias")})
    return params


def slice_of(full: torch.Tensor, shards: list) -> torch.Tensor:
    """The part of the single process's tensor `full` that a rank holding `shards` has."""
    for dim, index in shards:
        full = full.index_select(dim, index)
    return full


def _run(rank, world_size, layouts):
    from megatron_fp4.parallel.dims import ParallelDims
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    out = {}
    for name, (family, spec) in layouts.items():
        cfg = family_cfg(family, spec)
        p = cfg.parallel
        if p.cp > 1:
            mesh = ParallelMesh.from_dims(ParallelDims.from_config(cfg, world_size))
        else:
            mesh = ParallelMesh.build(p.pp, world_size // (p.pp * p.tp), p.ep, tp=p.tp, etp=p.etp)
        trainer = Trainer(cfg, mesh)
        assert (trainer.cp_plan is not None) == (p.cp > 1)
        out[name] = _train(trainer)
    return out


_REFERENCES: dict = {}  # (family, fp4) -> the single-process run (the checks only read it)


def _reference(family: str, spec: dict) -> dict:
    """The single-process run for a layout: it depends on the family and on FP4 only (the parallel
    fields are the layout's), so it runs once per (family, fp4) pair for the module's 36 layouts."""
    from megatron_fp4.training.trainer import Trainer

    key = (family, bool(spec.get("fp4", False)))
    if key not in _REFERENCES:
        with single_thread():
            _REFERENCES[key] = _train(Trainer(family_cfg(family, {"fp4": key[1]})))
    return _REFERENCES[key]


def check_layout(name: str, family: str, spec: dict, results: list) -> None:
    ref = _reference(family, spec)
    seen = set()
    for rank, res in enumerate(results):
        r = res[name]
        for got, want in zip(r["losses"], ref["losses"]):
            assert abs(got - want) <= FP64_REL * abs(want), (name, rank, r["losses"], ref["losses"])
        for kind in ("grads", "params"):
            for pname, value in r[kind].items():
                want = slice_of(ref[kind][pname].detach(), r["shards"].get(pname, ()))
                assert value.shape == want.shape, (name, rank, kind, pname, value.shape, want.shape)
                assert rel(value, want) <= FP64_REL, (name, rank, kind, pname, rel(value, want))
                seen.add(pname)
    assert seen == set(ref["params"]), f"{name}: held by no rank: {set(ref['params']) - seen}"
    if "gcmoe" in name:
        assert all(res[name]["dispatchers"] == {"GCMoEDispatcher"} for res in results)
    if spec.get("tp", 1) > 1:  # really cut: the attention by head, the vocabulary, and etp the experts' ffn
        cut = {n for res in results for n, shard in res[name]["shards"].items() if len(shard) > (1 if "experts" in n
                                                                                                 else 0)}
        attn = {"gpt_oss": ("q_proj.bias", "sinks", "o_proj.weight"),
                "deepseek_v3": ("q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight")}[family]
        experts = {"gpt_oss": ("experts.w13", "experts.w2", "experts.b13", "experts.b2"),
                   "deepseek_v3": ("experts.w13", "experts.w2")}[family]
        for part in attn + ("lm_head",) + (experts if spec.get("etp", 1) > 1 else ()):
            assert any(part in n for n in cut), (name, part, sorted(cut))


results = layout_results(_run, 2, LAYOUTS, timeout_s=900)
results_4 = layout_results(_run, 4, LAYOUTS_4, timeout_s=900)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(results, name):
    check_layout(name, *LAYOUTS[name], results)


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_layout_4_matches_single_process(results_4, name):
    check_layout(name, *LAYOUTS_4[name], results_4)
