"""DESIGN.md's layer rule: a module imports only from layers above it, never from below.

Order (top first): config → fp4 → model → parallel → training → rollout → integrations → rl.
`rl` (GRPO on the one trainer, the rollout process) joins training, rollout and integrations.
`fp4` imports nothing of ours; the CLI (`megatron_fp4/train.py`) sits on top of everything.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "megatron_fp4"
ORDER = ["config", "config_validate", "fp4", "model", "parallel", "training", "rollout", "integrations", "rl"]
RANK = {name: i for i, name in enumerate(ORDER)}
RANK["config_validate"] = RANK["config_choices"] = RANK["config"]


def _layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


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
