"""Context parallelism (``parallel.cp``) trains and scores like the single process (gloo, CPU, tiny model).

- **training, float64**: cp 2, cp 2 × ep 2 (the ep group is the cp group: experts all-to-all between
  the ranks that split a sequence), cp 2 × dp 2, cp 2 × pp 2, cp 2 × tp 2 (sequence parallel) and
  cp 2 × tp 2 × ep 2 train 3 AdamW steps (two of them with prompt labels masked, so the cp ranks
  hold unequal shares of the loss's labels); the losses, the first step's
  reduced gradients and every parameter after the steps are within ``FP64_REL`` = 1e-10 relative
  of the single process (tests/numerics.py: the layouts only change summation orders — the K/V
  gather's backward sums dK/dV over the cp ranks, the loss its shares — each an fp64 rounding of
  a few ulps, far below 1e-10). The aux and z losses are on (their token counts summed over cp).
- **scoring**: per-token log-probs of a forward at cp 2 vs `rollout.scoring.compute_log_probs` in
  one process: float64 within 1e-10 at the ``standard`` level; **bitwise** (fp32) at the ``batch``
  and ``exact`` levels, FP4 off and with FP4 MoEResQ (NVFP4) experts in ``fp4_resq``, by
  construction: their attention reads keys by position with a fixed reduction tree
  (`fp4/invariant.py`), which the gathered keys in position order feed unchanged, and every other
  op computes a row on its own.
"""
import pytest
import torch

from megatron_fp4.config import Config
from tests.distributed.conftest import layout_results
from tests.distributed.launch import run_distributed
from tests.numerics import FP64_REL, rel, single_thread

pytestmark = pytest.mark.distributed
STEPS = 3


def cp_cfg(dtype: str = "fp64", **parallel) -> Config:
    cfg = Config()
    cfg.dtype = dtype
    s = cfg.schedule
    s.global_batch_size, s.micro_batch_size, s.seq_len, s.train_steps, s.warmup_steps = 8, 2, 16, STEPS, 1
    cfg.data.num_samples = 200
    cfg.logging.tensorboard_dir, cfg.logging.progress = None, False
    cfg.fp4.scope, cfg.fp4.train_mode = "none", "bf16"
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


# masked: the first MASKED labels of every row are -100 (a prompt), so the cp ranks hold unequal
# shares of the loss's labels (rank 0 of cp 2 at seq 16 holds positions 0-3 and 12-15)
MASKED = 5
# bias: aux-loss-free balancing on (the router bias moves by the sign of the load summed over dp × cp)
LAYOUTS_2 = {"cp2_bias": dict(cp=2, bias=True), "cp2_ep2_masked": dict(cp=2, ep=2, masked=True)}
LAYOUTS_4 = {"cp2_dp2": dict(cp=2, dp=2), "cp2_pp2": dict(cp=2, pp=2),
             "cp2_tp2_masked": dict(cp=2, tp=2, masked=True),
             "cp2_tp2_ep2": dict(cp=2, tp=2, ep=2)}
LEVELS = ("standard", "batch", "exact", "fp4_batch", "fp4_exact")
SCORING = "scoring"  # a key of the 2-process spawn's layouts: the cp 2 scoring runs in the same spawn


def _build(world_size, spec):
    from megatron_fp4.parallel.dims import ParallelDims
    from megatron_fp4.parallel.mesh import ParallelMesh
    from megatron_fp4.training.trainer import Trainer

    spec = dict(spec)
    fp4, bias, level = spec.pop("fp4", False), spec.pop("bias", False), spec.pop("level", None)
    cfg = cp_cfg(**spec)
    if level is not None:
        cfg.numerics.invariance = level
    if bias:
        cfg.model.moe_router_bias_update_rate = 1e-3
    if fp4:  # FP4 MoEResQ experts for scoring; training stays bf16 (FP4 training is refused with cp)
        cfg.fp4.scope = "experts"
    return Trainer(cfg, ParallelMesh.from_dims(ParallelDims.from_config(cfg, world_size)))


def _batches(t, masked: bool) -> list:
    micro_batches = t.next_micro_batches()
    for mb in micro_batches if masked else ():
        mb["labels"] = mb["labels"].clone()
        mb["labels"][:, :MASKED] = -100
    return micro_batches


def _steps(t, masked: bool) -> list:
    from megatron_fp4.training.trainer import lm_loss_fn

    t.sampler.load_state_dict({"epoch": 0, "consumed": 0})
    return [t.train_step_with_loss(_batches(t, masked), lm_loss_fn)["loss"] for _ in range(STEPS)]


def _train(rank, world_size, layouts):
    from megatron_fp4.training.trainer import lm_loss_fn

    out = {}
    for name, spec in layouts.items():
        spec = dict(spec)
        masked = spec.pop("masked", False)
        t = _build(world_size, spec)
        t.model.train()
        t.optimizer.zero_grad()
        t.forward_backward(_batches(t, masked), lm_loss_fn)
        if t.tp_plan is not None:  # as apply_update: the partial (sequence-parallel) grads summed over tp first
            t.tp_plan.finish_grads()
            if t.mesh.ep > 1:
                t._agree_whole_grads_over_tp()
        t.optimizer.finish_grad_sync()
        grads = {n: p.grad.clone() for n, p in t.model.named_parameters()}
        t.optimizer.zero_grad()
        losses = _steps(t, masked)
        offsets = {}  # expert params: offset of this rank's block in the full [E, ...] tensor
        for moe in t.model.moe_layers():
            for pname in ("w13", "w2"):
                p = getattr(moe.experts, pname)
                offsets[[n for n, q in t.model.named_parameters() if q is p][0]] = moe.experts.expert_offset
        params = _weights(t)
        # tp: (dim, index) of the single process's tensor each shard holds
        shards = {n: p.tp_shard for n, p in t.model.named_parameters() if getattr(p, "tp_shard", None) is not None}
        out[name] = dict(losses=losses, grads=grads, params=params, offsets=offsets, shards=shards,
                         data=t.mesh.coord("data"), cp=t.mesh.coord("cp"))
        t.optimizer.remove_hooks()
    return out


def _run(rank, world_size, layouts):
    """The training layouts of `layouts`, then (key ``SCORING``) the cp 2 scoring: one spawn for both."""
    layouts = dict(layouts)
    scoring = layouts.pop(SCORING, False)
    out = _train(rank, world_size, layouts)
    if scoring:
        out[SCORING] = _score(rank, world_size)
    return out


def _score(rank, world_size):
    """cp 2 scoring of one micro-batch at every level (fp64 standard, fp32 batch and exact)."""
    out = {}
    for dtype, fp4, levels in (("fp64", False, ("standard",)), ("fp32", False, ("batch", "exact")),
                               ("fp32", True, ("batch", "exact"))):
        for level in levels:  # a trainer built at each level (the level is fixed at build), scoring in fp4_resq
            t = _build(world_size, dict(cp=2, dtype=dtype, fp4=fp4, level=level))
            if fp4:
                t.model.set_fp4_mode("fp4_resq")
            tokens, out[("fp4_" if fp4 else "") + level] = cp_token_log_probs(t)
            out[dtype + "_tokens"] = tokens
            t.optimizer.remove_hooks()
    return out


def cp_token_log_probs(t) -> tuple:
    """(tokens [B, T] of the trainer's next micro-batch, their per-token log-probs [B, T] from a
    forward of `t`'s model in eval mode, each cp rank its chunks, gathered back in sequence order)."""
    from megatron_fp4.parallel import context
    from megatron_fp4.rollout.logprobs import context_parallel_log_probs, log_softmax_rows

    t.model.eval()
    tokens = t.next_micro_batches()[0]["tokens"]
    with torch.no_grad():
        positions = torch.arange(tokens.shape[1]).expand(tokens.shape)
        logits = t.model(context.split_sequence(tokens, t.cp_plan), context.split_sequence(positions, t.cp_plan)).logits
        rows = log_softmax_rows(logits, t.model.numerics)
        return tokens, context_parallel_log_probs(rows, tokens, t.cp_plan)


def _weights(t) -> dict:
    """Every parameter and the routers' expert_bias buffers (moved outside the optimizer)."""
    out = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    out.update({n: b.clone() for n, b in t.model.named_buffers() if n.endswith("expert_bias")})
    return out


def _reference(spec):
    from megatron_fp4.training.trainer import Trainer, lm_loss_fn

    spec = dict(spec)
    masked, bias = spec.pop("masked", False), spec.pop("bias", False)
    cfg = cp_cfg(**spec)
    if bias:
        cfg.model.moe_router_bias_update_rate = 1e-3
    cfg.parallel.cp, cfg.parallel.dp, cfg.parallel.ep, cfg.parallel.pp, cfg.parallel.tp = 1, -1, 1, 1, 1
    with single_thread():
        t = Trainer(cfg)
        t.model.train()
        t.optimizer.zero_grad()
        t.forward_backward(_batches(t, masked), lm_loss_fn)
        t.optimizer.finish_grad_sync()
        grads = {n: p.grad.clone() for n, p in t.model.named_parameters()}
        t.optimizer.zero_grad()
        losses = _steps(t, masked)
    return losses, grads, _weights(t)


def check(name, spec, results):
    ref_losses, ref_grads, ref_params = _reference(spec)
    seen = set()
    for rank, res in enumerate(results):
        r = res[name]
        for got, want in zip(r["losses"], ref_losses):
            assert abs(got - want) <= FP64_REL * abs(want), (name, rank, r["losses"], ref_losses)
        for kind, got_all, want_all in (("grad", r["grads"], ref_grads), ("param", r["params"], ref_params)):
            for pname, value in got_all.items():
                want = want_all[pname].detach()
                if pname in r["offsets"]:
                    off = r["offsets"][pname]
                    want = want[off:off + value.shape[0]]
                if pname in r["shards"]:
                    dim, index = r["shards"][pname]
                    want = want.index_select(dim, index)
                assert rel(value, want) <= FP64_REL, (name, rank, kind, pname, rel(value, want))
                seen.add(pname)
    assert seen == set(ref_params), f"{name}: parameters missing on every rank: {set(ref_params) - seen}"
    if spec.get("bias"):  # the balancing really moved the biases
        assert any(v.abs().sum() > 0 for n, v in ref_params.items() if n.endswith("expert_bias"))


results_2 = layout_results(_run, 2, {**LAYOUTS_2, SCORING: True}, timeout_s=900)
results_4 = layout_results(_train, 4, LAYOUTS_4, timeout_s=600)


@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_cp_two_process_layout_matches_single_process(results_2, name):
    check(name, LAYOUTS_2[name], results_2)


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_cp_four_process_layout_matches_single_process(results_4, name):
    if name == "cp2_dp2":  # data replica, cp rank: cp fastest
        assert [(r[name]["data"], r[name]["cp"]) for r in results_4] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    check(name, LAYOUTS_4[name], results_4)


@pytest.fixture(scope="module")
def scores(results_2):
    return [r[SCORING] for r in results_2]


def _reference_scores(dtype, tokens, level):
    from megatron_fp4.rollout.scoring import compute_log_probs
    from megatron_fp4.training.trainer import Trainer

    cfg = cp_cfg(dtype=dtype)
    fp4 = level.startswith("fp4_")
    cfg.numerics.invariance = level.removeprefix("fp4_")  # the trainer's model is built at the level
    if fp4:
        cfg.fp4.scope = "experts"
    with single_thread(), torch.no_grad():
        t = Trainer(cfg, build_data=False)
        if fp4:
            t.model.set_fp4_mode("fp4_resq")
        t.model.eval()
        return compute_log_probs(t.model, tokens, torch.ones_like(tokens)).log_probs


@pytest.mark.parametrize("level", LEVELS)
def test_cp_scoring_matches_single_process(scores, level):
    dtype = "fp64" if level == "standard" else "fp32"
    tokens = scores[0][dtype + "_tokens"]
    want = _reference_scores(dtype, tokens, level)
    for rank, res in enumerate(scores):
        got = res[level]
        assert got.shape == want.shape and got.dtype == want.dtype
        if level == "standard":
            assert rel(got, want) <= FP64_REL, (rank, rel(got, want))
        else:  # by construction (module doc): the same bits
            assert torch.equal(got, want), (rank, level, (got - want).abs().max())
        if level.startswith("fp4_"):  # FP4 really ran: not the unquantized experts' numbers
            assert not torch.equal(got, res[level.removeprefix("fp4_")])


# -- DCP checkpoints reshard across cp: the dp axis holds dp × cp ranks, so cp is a dp layout to DCP --
def _save_cp2_then_resume(rank, world_size, root):
    t = _build(world_size, dict(cp=2))
    losses = [t.train_step()["loss"] for _ in range(2)]
    t.save_checkpoint(root)
    losses += [t.train_step()["loss"] for _ in range(2)]
    out = {"full": (losses, {n: p.detach().clone() for n, p in t.model.named_parameters()})}
    t.optimizer.remove_hooks()
    for name, spec in (("cp2", dict(cp=2)), ("dp2", dict(dp=2))):
        r = _build(world_size, spec)
        assert r.load_checkpoint(root) == 2
        out[name] = ([r.train_step()["loss"] for _ in range(2)],
                     {n: p.detach().clone() for n, p in r.model.named_parameters()})
        r.optimizer.remove_hooks()
    return out


def _resume_single(rank, world_size, root):
    r = _build(world_size, {})
    assert r.load_checkpoint(root) == 2
    return ([r.train_step()["loss"] for _ in range(2)], {n: p.detach().clone() for n, p in r.model.named_parameters()})


def test_cp_checkpoint_resumes_and_reshards(tmp_path):
    """Saved at cp2 after 2 of 4 steps: resumed at cp2 bitwise equal to the uninterrupted run (the
    same kernels on the same shapes), at dp2 and in one process within 1e-10 of the single process."""
    from megatron_fp4.training.trainer import Trainer

    cfg = cp_cfg()
    with single_thread():
        t = Trainer(cfg)
        ref_losses = [t.train_step()["loss"] for _ in range(4)]
        ref_params = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    root = str(tmp_path / "cp2")
    first = run_distributed(_save_cp2_then_resume, 2, (root,), timeout_s=600)
    single = run_distributed(_resume_single, 1, (root,), timeout_s=600)[0]
    runs = [(first[r][name], name) for r in range(2) for name in ("full", "dp2")] + [(single, "single")]
    for (losses, params), name in runs:
        want = ref_losses if name == "full" else ref_losses[2:]
        assert all(abs(g - w) <= FP64_REL * abs(w) for g, w in zip(losses, want)), (name, losses, want)
        assert all(rel(params[n], ref_params[n]) <= FP64_REL for n in ref_params), name
    for r in range(2):
        losses, params = first[r]["cp2"]
        assert losses == first[r]["full"][0][2:]
        assert all(torch.equal(params[n], first[r]["full"][1][n]) for n in ref_params)
