"""The model knows no parallelism (issue 24): expert blocks are constructor arguments (a shard is
the full model's slice), dispatchers implement `model.dispatch.Dispatcher` and are handed to the
layer (not assigned), and the pipeline passes per-micro-batch inputs as schedule kwargs."""
import pytest
import torch

from megatron_fp4.fp4 import Recipe
from megatron_fp4.model.dispatch import Dispatched, Dispatcher, LocalDispatcher
from megatron_fp4.model.experts import GroupedExperts
from megatron_fp4.model.moe import MoELayer, init_moe_params


def _experts(E=4, H=16, F=8, dtype=torch.float64):
    ex = GroupedExperts(E, H, F, Recipe(mode="bf16")).to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ex.w13.copy_(torch.randn(ex.w13.shape, generator=g, dtype=dtype))
        ex.w2.copy_(torch.randn(ex.w2.shape, generator=g, dtype=dtype))
    return ex


def test_expert_block_is_a_constructor_argument_and_shard_equals_the_full_experts():
    full = _experts()
    block = GroupedExperts(4, 16, 8, Recipe(mode="bf16"), expert_offset=2, num_local_experts=2).double()
    assert (block.expert_offset, block.num_local_experts, block.num_global_experts) == (2, 2, 4)
    assert block.w13.shape == (2, 16, 16) and block.num_experts == 2
    shard = full.shard(2, 2)
    assert (shard.expert_offset, shard.num_local_experts, shard.num_global_experts) == (2, 2, 4)
    assert torch.equal(shard.w13, full.w13[2:]) and torch.equal(shard.w2, full.w2[2:])
    x = torch.randn(7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for e in range(2):  # the shard's local expert e is the full module's expert 2 + e, bit for bit
        assert torch.equal(shard.expert(e, x), full.expert(2 + e, x))
    with torch.device("meta"):
        meta = GroupedExperts(4, 16, 8, Recipe(mode="bf16"))
    assert meta.shard(1, 3).w13.is_meta  # nothing allocated before materialisation
    for bad in (dict(expert_offset=3, num_local_experts=2), dict(expert_offset=-1), dict(num_local_experts=0)):
        with pytest.raises(ValueError, match="non-empty block"):
            GroupedExperts(4, 16, 8, Recipe(mode="bf16"), **bad)
    with pytest.raises(ValueError, match="not held here"):
        shard.shard(0, 2)


def test_model_init_of_a_shard_is_the_full_models_slice():
    from megatron_fp4.config import Config
    from megatron_fp4.model import build_model, materialize

    cfg = Config()
    cfg.model.num_layers = 1
    full = build_model(cfg)
    with torch.device("meta"):
        part = build_model(cfg, device="meta")
    E = cfg.model.num_experts
    for moe in part.moe_layers():
        moe.set_experts(moe.experts.shard(E // 2, E // 2))
    materialize(part, "cpu", cfg.schedule.seed)
    for a, b in zip(full.moe_layers(), part.moe_layers()):
        assert torch.equal(a.experts.w13[E // 2:], b.experts.w13) and torch.equal(a.experts.w2[E // 2:], b.experts.w2)


class _Reversing(Dispatcher):
    """A custom dispatcher: the local one, but handing the experts each expert's rows reversed."""

    def __init__(self, num_experts):
        self.inner, self.calls = LocalDispatcher(num_experts), []

    def dispatch(self, x, topk_idx, topk_w):
        d = self.inner.dispatch(x, topk_idx, topk_w)
        perm = torch.cat([torch.arange(n - 1, -1, -1) + s for s, n in
                          zip(torch.tensor([0] + d.counts).cumsum(0)[:-1].tolist(), d.counts)])
        self.calls.append("dispatch")
        return Dispatched(d.tokens[perm], d.counts, None, (d.handle, perm))

    def combine(self, expert_out, handle):
        inner, perm = handle
        self.calls.append("combine")
        return self.inner.combine(torch.empty_like(expert_out).index_copy(0, perm, expert_out), inner)


def test_moe_layer_runs_a_custom_dispatcher_given_to_it():
    torch.manual_seed(0)
    layer = MoELayer(16, 4, 2, 8, Recipe(mode="bf16")).double()
    init_moe_params(layer, 0.02, 0.02, torch.Generator().manual_seed(3))
    x = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    want = layer(x)
    custom = _Reversing(4)
    layer.set_dispatcher(custom)
    assert layer.dispatcher is custom
    got = layer(x)
    assert custom.calls == ["dispatch", "combine"]
    # rows reordered within an expert: the same per-row GEMMs up to BLAS blocking; fp64 with K <= 16 terms
    # per dot product rounds each output within ~16·eps·Σ|terms| (< 1e-13 here), so 1e-10 / 1e-15 is loose
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-15)
    built = MoELayer(16, 4, 2, 8, Recipe(mode="bf16"), dispatcher=_Reversing(4))
    assert isinstance(built.dispatcher, _Reversing)
    with pytest.raises(TypeError, match="is not a megatron_fp4.model.dispatch.Dispatcher"):
        layer.set_dispatcher(lambda x, i, w, e: x)
    with pytest.raises(AttributeError):
        layer.dispatcher = LocalDispatcher(4)
    with pytest.raises(ValueError, match="4-expert layer"):
        layer.set_experts(GroupedExperts(8, 16, 8, Recipe(mode="bf16")))


def test_local_dispatcher_refuses_a_shard():
    layer = MoELayer(16, 4, 2, 8, Recipe(mode="bf16"))
    init_moe_params(layer, 0.02, 0.02, torch.Generator().manual_seed(3))
    layer.set_experts(layer.experts.shard(0, 2))
    with pytest.raises(ValueError, match="expert-parallel dispatcher"):
        layer(torch.randn(3, 16))


def test_pipeline_chunk_takes_its_micro_batch_inputs_as_kwargs():
    from megatron_fp4.config import Config
    from megatron_fp4.model import build_model
    from megatron_fp4.parallel.pipeline import build_chunks, stage_kwargs

    cfg = Config()
    cfg.model.num_layers = 1
    model = build_model(cfg).eval()
    seen = []
    original = model.run_layers

    def run_layers(*args, **kwargs):
        seen.append(model.numerics.position.micro_batch)
        return original(*args, **kwargs)
    model.run_layers = run_layers
    [(_, chunk)] = build_chunks(model, pp=1, pp_rank=0)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), model.numerics.training_step(5, first_micro_batch=4):
        chunk(tokens, micro_batch=torch.tensor([1]))
        with model.numerics.micro_batch(0):
            chunk(tokens)  # no index: the caller's context
    assert seen == [5, 4]
    mask = torch.ones(2, 6, dtype=torch.long)
    kw = stage_kwargs([{"tokens": tokens, "attention_mask": mask}, {"tokens": tokens, "attention_mask": mask}])
    assert set(kw) == {"micro_batch", "attention_mask"} and kw["attention_mask"].shape == (4, 6)
    assert kw["micro_batch"].tolist() == [0, 1]
    with pytest.raises(ValueError, match="'positions' for some micro-batches"):
        stage_kwargs([{"positions": mask}, {"positions": None}])
