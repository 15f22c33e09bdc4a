"""DESIGN.md's layer rule: a module imports only from layers above it, never from below.

Order (top first): config → fp4 → model → parallel → training → rollout → integrations → rl →
verl, each a top-level package (or module) of `megatron_fp4`, with no exceptions. `rl` owns RL
(losses, IS correction, the GRPO loop, rewards, tasks, RL datasets) and joins training, rollout and
the HF/vLLM integrations; the verl adapters put verl's trainer on top of `rl` (its policy loss and
rollout correction), so `verl` is the lowest layer and nothing else imports it. `fp4` imports
nothing of ours; the CLI (`megatron_fp4/train.py`) sits on top of everything.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "megatron_fp4"
ORDER = ["config", "fp4", "model", "parallel", "training", "rollout", "integrations", "rl", "verl"]
RANK = {name: i for i, name in enumerate(ORDER)}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else module


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_fp4."):
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("megatron_fp4."))


def test_no_module_imports_from_a_layer_below_it():
    violations = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        own = rel.parts[0].removesuffix(".py")
        if own not in RANK:
            continue  # __init__.py, train.py (the CLI on top)
        for module in _imports(path):
            target = _layer(module)
            if target in RANK and RANK[target] > RANK[own]:
                violations.append(f"{rel} imports {module}")
    assert not violations, "layer order broken (see DESIGN.md):\n" + "\n".join(violations)


RL_NAMES = {"PolicyLoss", "policy_loss", "rollout_correction", "RolloutCorrection", "compute_score", "RLDataset",
            "carry_rows", "math_rows", "grpo_advantages", "run_grpo"}


def test_rl_code_lives_in_rl():
    """Issue 24: losses, IS correction, rewards, tasks and RL datasets are defined in `rl/` only."""
    elsewhere = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "rl":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in RL_NAMES:
                elsewhere.append(f"{rel}: {node.name}")
    assert not elsewhere, "RL code outside megatron_fp4/rl/:\n" + "\n".join(elsewhere)
