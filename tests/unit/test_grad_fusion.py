"""Gradient-accumulation fusion (fp4/grad_fusion.py): the grouped expert kernels write their weight
gradients into ZeroAdamW's zeroed buffer. The reference is the ordinary path (the kernel returns the
gradient, autograd adds it into the buffer): the same bits for gradients, losses and weights, and a
claim is refused wherever the fused write would change a sum's order or overwrite an accumulation."""
import pytest
import torch

from megatron_fp4.config import Config
from megatron_fp4.fp4.grad_fusion import FusedGrad, finish_fused
from megatron_fp4.fp4.tiled import tiled_grouped_linear
from megatron_fp4.parallel.mesh import ParallelMesh
from megatron_fp4.parallel.zero import ZeroAdamW
from megatron_fp4.training.step_loss import lm_loss_fn
from megatron_fp4.training.trainer import Trainer


@pytest.fixture
def granted(monkeypatch):
    """Counts the claims granted (so a test can tell the fused path ran)."""
    count = {"granted": 0, "refused": 0}
    claim = FusedGrad.claim

    def counting(self):
        dest = claim(self)
        count["granted" if dest is not None else "refused"] += 1
        return dest

    monkeypatch.setattr(FusedGrad, "claim", counting)
    return count


def _cfg(mode):
    cfg = Config()
    cfg.model.num_layers, cfg.model.num_experts, cfg.model.top_k = 2, 4, 2
    cfg.schedule.global_batch_size, cfg.schedule.micro_batch_size, cfg.schedule.seq_len = 4, 2, 16
    cfg.data.num_samples = 40
    cfg.fp4.train_mode, cfg.fp4.compile = mode, "off"
    cfg.logging.tensorboard_dir, cfg.logging.progress = None, False
    return cfg


def _hex(t):
    return [float(v).hex() for v in t.detach().reshape(-1).tolist()]


@pytest.mark.parametrize("mode,tied", [("bf16", False), ("fp4_resq", False), ("bf16", True)])  # bf16: FP4 off
def test_trainer_steps_equal_the_unfused_path_bitwise(mode, tied, granted):
    """Two steps of two micro-batches each (the second accumulates on the ordinary path): every
    gradient (as float.hex: -0.0 and +0.0 apart), loss, grad norm and weight equals a Trainer whose
    kernels see no fused destination. The dense tiled GEMMs (attention projections, router, LM head)
    write their weight gradients too, and so does the embedding; tied embeddings: the LM head's fused
    write, then the embedding's ordinary accumulation into the same buffer."""
    cfg = _cfg(mode)
    cfg.model.tie_embeddings = tied
    fused, plain = Trainer(cfg, ParallelMesh.single()), Trainer(cfg, ParallelMesh.single())
    plain.model.load_state_dict(fused.model.state_dict())
    plain.reset_optimizer()
    fused.reset_optimizer()
    for p in plain.model.parameters():
        del p.fused_grad  # the ordinary path: the kernels return the gradient
    for _ in range(2):
        mbs = fused.next_micro_batches()
        plain.next_micro_batches()
        results, grads = [], []
        for t in (fused, plain):
            t.model.train()
            t.zero_grad()
            t.forward_backward(mbs, lm_loss_fn)
            grads.append({n: _hex(p.grad) for n, p in t.model.named_parameters()})
            results.append(t.apply_update())
        assert grads[0] == grads[1]
        assert float(results[0]["loss"]).hex() == float(results[1]["loss"]).hex()
        assert float(results[0]["grad_norm"]).hex() == float(results[1]["grad_norm"]).hex()
        for (name, p), (_, q) in zip(fused.model.named_parameters(), plain.model.named_parameters()):
            assert torch.equal(p, q), name
    experts = sum(1 for n, _ in fused.model.named_parameters() if n.endswith((".w13", ".w2")))
    # every other matrix goes through a tiled GEMM (FP4 on the experts only) or, the embedding,
    # `layers.Embedding`'s index_add (tied: the LM head's weight is the embedding, claimed by the head)
    dense = sum(1 for _, p in fused.model.named_parameters() if p.dim() == 2)
    kernels = experts + dense
    assert granted["granted"] == 2 * kernels  # each step's first micro-batch wrote into the buffer
    assert granted["refused"] >= 2 * kernels  # the second accumulated


def _optimizer(weight):
    cfg = Config()
    opt = ZeroAdamW([("experts.w13", weight)], cfg.optimizer, ParallelMesh.single(), zero_stage=1)
    opt.zero_grad()
    return opt


def _data(seed, counts=(3, 0, 5), H=8, O=6):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(len(counts), O, H, generator=g)
    x = torch.randn(sum(counts), H, generator=g)
    dy = torch.randn(sum(counts), O, generator=g)
    return w, x, dy, list(counts)


def test_two_uses_in_one_graph_take_the_ordinary_path(granted):
    """Two calls through one weight in one graph: no claim is granted (a fused write would sum the
    three-way total in another order) and the gradient is autograd's own sum."""
    w, x, dy, counts = _data(0)
    ref = w.clone().requires_grad_()
    (tiled_grouped_linear(x, ref, counts) * dy + tiled_grouped_linear(2 * x, ref, counts) * dy).sum().backward()
    weight = torch.nn.Parameter(w.clone())
    _optimizer(weight)
    (tiled_grouped_linear(x, weight, counts) * dy + tiled_grouped_linear(2 * x, weight, counts) * dy).sum().backward()
    assert granted == {"granted": 0, "refused": 2}
    assert _hex(weight.grad) == _hex(ref.grad)


def test_an_earlier_accumulation_is_never_overwritten(granted):
    """An ordinary accumulation (a use outside the fused kernels) before the kernel's backward in the
    step: the claim is refused and the kernel's gradient is added to it."""
    w, x, dy, counts = _data(1)
    weight = torch.nn.Parameter(w.clone())
    opt = _optimizer(weight)
    (weight * 3).sum().backward()
    (tiled_grouped_linear(x, weight, counts) * dy).sum().backward()
    assert granted == {"granted": 0, "refused": 1}
    ref = w.clone().requires_grad_()
    (tiled_grouped_linear(x, ref, counts) * dy).sum().backward()
    assert _hex(weight.grad) == _hex(torch.zeros_like(w) + torch.full_like(w, 3.0) + ref.grad)
    opt.zero_grad()  # a new step: the buffer is zero again, the claim is granted, an idle expert's rows stay 0
    (tiled_grouped_linear(x, weight, counts) * dy).sum().backward()
    assert granted["granted"] == 1
    assert _hex(weight.grad) == _hex(torch.zeros_like(w) + ref.grad) and not weight.grad[1].any()


def test_a_grad_set_to_none_or_a_copy_of_the_parameter_is_not_fused(granted):
    import copy

    w, x, dy, counts = _data(2)
    weight = torch.nn.Parameter(w.clone())
    _optimizer(weight)
    twin = copy.deepcopy(weight)  # carries the attribute, not the buffer
    (tiled_grouped_linear(x, twin, counts) * dy).sum().backward()
    assert granted["granted"] == 0 and not weight.grad.any()
    weight.grad = None
    (tiled_grouped_linear(x, weight, counts) * dy).sum().backward()
    assert granted == {"granted": 0, "refused": 1} and _hex(weight.grad) == _hex(twin.grad)


def test_finish_fused_has_the_bits_of_adding_into_zero():
    t = torch.tensor([-0.0, 0.0, -1.5, float("nan"), float("-inf"), 1e-45])
    want = torch.zeros_like(t) + t
    finish_fused(t)
    assert _hex(t) == _hex(want) and not torch.signbit(t[0])


def test_autograd_grad_and_a_retained_graph_take_the_ordinary_path(granted):
    """`torch.autograd.grad` (the zero-bubble schedules' split passes) returns gradients and leaves
    `.grad` alone; a retained graph's second backward adds to the first's fused write."""
    w, x, dy, counts = _data(3)
    weight = torch.nn.Parameter(w.clone())
    _optimizer(weight)
    xr = x.clone().requires_grad_()
    loss = (tiled_grouped_linear(xr, weight, counts) * dy).sum()
    (dx,) = torch.autograd.grad(loss, [xr], retain_graph=True)
    (dw,) = torch.autograd.grad(loss, [weight], retain_graph=True)
    assert not weight.grad.any() and granted["granted"] == 0
    loss.backward(retain_graph=True)
    loss.backward()
    assert granted["granted"] == 0  # the first backward was not this forward's only one
    assert _hex(weight.grad) == _hex(torch.zeros_like(w) + dw + dw)
    ref = x.clone().requires_grad_()
    (tiled_grouped_linear(ref, w, counts) * dy).sum().backward()
    assert _hex(dx) == _hex(ref.grad)


def test_dense_tiled_linear_writes_its_weight_gradient_with_the_ordinary_bits(granted):
    """A dense tiled GEMM (attention projections, LM head): the fused write into the buffer equals the
    gradient autograd accumulates into it (float.hex), zeros included (an input column of ``-0.0``,
    an output-gradient column of zeros: ``+0.0`` in both; the ``-0.0`` rule itself:
    `test_finish_fused_has_the_bits_of_adding_into_zero`); a wide weight (column blocks) and a narrow one."""
    from megatron_fp4.fp4.tiled import tiled_linear

    for n, k in ((2900, 1024), (6, 8)):
        g = torch.Generator().manual_seed(n)
        w, x, dy = torch.randn(n, k, generator=g), torch.randn(21, k, generator=g), torch.randn(21, n, generator=g)
        x[:, 1] = -0.0
        dy[:, 0] = 0.0
        ref = torch.nn.Parameter(w.clone())
        ref.grad = torch.zeros_like(w)  # the ordinary path: autograd adds the returned gradient into a zeroed .grad
        (tiled_linear(x, ref) * dy).sum().backward()
        weight = torch.nn.Parameter(w.clone())
        _optimizer(weight)
        before = granted["granted"]
        (tiled_linear(x, weight) * dy).sum().backward()
        assert granted["granted"] == before + 1
        assert _hex(weight.grad) == _hex(ref.grad)
        assert not torch.signbit(weight.grad[:, 1]).any()
