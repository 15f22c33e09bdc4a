"""Numerics as a value (issue 24): what a GEMM computes is the model's ``fp4.Numerics``, passed down
at build time and to the fp4 functions explicitly. No ContextVar, process-global mode or
environment variable read after config load decides it, so two models in one process compute
their own numerics."""
from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch

import megatron_fp4
from megatron_fp4.config import Config
from megatron_fp4.fp4 import STANDARD, Numerics, apply_numerics
from megatron_fp4.model import build_model
from megatron_fp4.model.specs import numerics_from_config

PACKAGE = Path(megatron_fp4.__file__).parent
# The one ContextVar left: whether code runs inside a recompute region, which decides what is
# saved for backward, never what an op computes.
CONTEXTVAR_ALLOWED = {"model/recompute.py"}
# Triton's own switch (TRITON_INTERPRET, read by Triton itself on triton >= 3.4), not a setting of ours.
ENVIRON_ALLOWED_IN_FP4 = {("triton_fp4.py", "interpreting")}


def _modules(root: Path):
    for path in sorted(root.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _functions_of(tree):
    """{node: name of the function it is in ('' at module level)}."""
    owner = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                owner.setdefault(node, fn.name)
    return owner


def test_no_contextvar_anywhere_but_the_recompute_region():
    found = []
    for name, tree in _modules(PACKAGE):
        for node in ast.walk(tree):
            hit = (isinstance(node, ast.Import) and any(a.name == "contextvars" for a in node.names)) or \
                (isinstance(node, ast.ImportFrom) and node.module == "contextvars") or \
                (isinstance(node, ast.Attribute) and node.attr == "ContextVar")
            if hit and name not in CONTEXTVAR_ALLOWED:
                found.append(f"{name}:{node.lineno}")
    assert not found, f"ContextVar state (numerics must be the model's Numerics value): {found}"


def test_fp4_reads_no_environment_variable():
    found = []
    for name, tree in _modules(PACKAGE / "fp4"):
        owner = _functions_of(tree)
        for node in ast.walk(tree):
            reads = (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb")
                     and isinstance(node.value, ast.Name) and node.value.id == "os")
            if reads and (name.split("/")[-1], owner.get(node, "")) not in ENVIRON_ALLOWED_IN_FP4:
                found.append(f"{name}:{node.lineno}")
    assert not found, f"fp4/ reads the environment (read it while loading the config instead): {found}"


def test_the_fp4_environment_variables_are_read_only_while_loading_the_config():
    names = ("MEGATRON_FP4_COMPILE", "MEGATRON_FP4_TRITON")
    readers = sorted(name for name, tree in _modules(PACKAGE) for node in ast.walk(tree)
                     if isinstance(node, ast.Constant) and node.value in names)
    assert set(readers) == {"config_choices.py"}, readers


def _cfg(**fp4):
    cfg = Config()
    cfg.model.vocab_size, cfg.model.num_layers = 64, 2
    cfg.fp4.scope = "experts+attention"
    for key, value in fp4.items():
        setattr(cfg.fp4, key, value)
    return cfg


def _tokens():
    return torch.randint(1, 64, (3, 12), generator=torch.Generator().manual_seed(0))


def test_two_models_compute_their_own_batch_invariance():
    """Same weights, different Numerics: each model computes its own (a process-global mode would
    give both the same bits)."""
    a, b = build_model(_cfg(), seed=1).eval(), build_model(_cfg(), seed=1).eval()
    apply_numerics(a, Numerics(invariance="exact"))
    tokens = _tokens()
    with torch.no_grad():
        ya, yb = a(tokens).logits, b(tokens).logits
        assert not torch.equal(ya, yb)  # the exact GEMMs round differently from the standard ones
        with b.numerics.invariant("exact"):  # b alone switched: a is untouched
            assert torch.equal(b(tokens).logits, ya)
            assert torch.equal(a(tokens).logits, ya)
        assert torch.equal(b(tokens).logits, yb)
        with a.numerics.invariant("standard"):
            assert torch.equal(a(tokens).logits, yb) and torch.equal(b(tokens).logits, yb)


def test_two_models_draw_their_own_stochastic_rounding_streams():
    """Each model's step position keys its SR streams: a step opened on one model does not move the
    other's (a process-global step context, the innermost winning, would)."""
    def grads(model):
        model.zero_grad(set_to_none=True)
        model(_tokens()).logits.float().pow(2).mean().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    cfg = _cfg(grad_rounding="stochastic")
    a, b = build_model(cfg, seed=1), build_model(cfg, seed=1)
    assert a.numerics is not b.numerics
    with a.numerics.training_step(3), a.numerics.micro_batch(1):
        alone = grads(a)
    with a.numerics.training_step(3), a.numerics.micro_batch(1), b.numerics.training_step(5):
        assert a.numerics.position.micro_batch == 1 and b.numerics.position.micro_batch == 0
        nested = grads(a)
        other = grads(b)
    assert all(torch.equal(x, y) for x, y in zip(nested, alone))
    assert not all(torch.equal(x, y) for x, y in zip(other, alone))  # step 5, micro-batch 0: other draws
    with b.numerics.training_step(3), b.numerics.micro_batch(1):
        assert all(torch.equal(x, y) for x, y in zip(grads(b), alone))  # same weights, same position


def test_standard_numerics_cannot_change_and_every_layer_shares_the_models():
    with pytest.raises(ValueError, match="STANDARD numerics cannot be changed"):
        STANDARD.invariant("batch")
    with pytest.raises(ValueError, match="STANDARD numerics cannot be changed"):
        STANDARD.invariance = "batch"
    assert copy.deepcopy(STANDARD) is STANDARD and STANDARD.invariance == "standard"
    model = build_model(_cfg(), seed=0)
    holders = [m for m in model.modules() if hasattr(m, "numerics")]
    assert len(holders) > 10 and all(m.numerics is model.numerics for m in holders)
    with pytest.raises(ValueError, match="triton='fast'"):
        Numerics(triton="fast")


def test_trainer_and_rollout_numerics_come_from_the_config():
    from megatron_fp4.training.trainer import Trainer

    cfg = _cfg(triton="off")
    cfg.model.num_layers = 1
    cfg.schedule.global_batch_size, cfg.schedule.micro_batch_size, cfg.schedule.seq_len = 2, 2, 8
    cfg.data.num_samples, cfg.logging.tensorboard_dir, cfg.logging.progress = 8, None, False
    numerics = Trainer(cfg).model.numerics
    assert (numerics.mode, numerics.triton, numerics.invariance) == ("train", "off", "standard")
    assert build_model(cfg, seed=0).numerics.triton == "off"  # any build honours the config's backend
    rollout = numerics_from_config(cfg, "rollout")
    assert (rollout.mode, rollout.invariance) == ("rollout", cfg.numerics.invariance)
