"""Nothing from a file or a peer executes (DESIGN.md rule 8), checked on the syntax tree of every
module of the package (and of tools/, examples/, benchmarks/), not by grepping a few named files:

- no ``pickle`` / ``cPickle`` / ``_pickle`` / ``dill`` / ``marshal`` / ``shelve`` import, except the
  two modules listed in ``PICKLE_ALLOWED`` with exactly the names they need;
- ``torch.load`` only with ``weights_only=True``; ``np.load`` never with ``allow_pickle=True``;
  ``yaml.load`` only with a safe loader, no ``yaml.unsafe_load`` / ``full_load``;
- no object collectives (they pickle what a peer sends): ``broadcast_object_list``,
  ``all_gather_object``, ``gather_object``, ``scatter_object_list``, ``send_object_list``,
  ``recv_object_list``;
- no builtin ``eval`` / ``exec`` / ``compile`` / ``__import__`` on anything but a string literal;
- no ``0.0.0.0`` literal (listeners bind the address they advertise).

The checker itself is tested on snippets that break each rule, so a rule that stops matching fails.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("megatron_fp4", "tools", "examples", "benchmarks")
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "marshal", "shelve", "cloudpickle"}
OBJECT_COLLECTIVES = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list"}
EXEC_BUILTINS = {"eval", "exec", "compile", "__import__"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}
# The only pickle uses, and why they are safe: checkpoint/directory.py catches the exception torch.load
# (weights_only=True) raises for a file that holds more than tensors; checkpoint/dcp_metadata.py is the
# allow-list unpickler for DCP's `.metadata` (torch writes it as a pickle; tests/unit/test_checkpoint_safety.py).
PICKLE_ALLOWED = {"megatron_fp4/training/checkpoint/directory.py": {"UnpicklingError"},
                  "megatron_fp4/training/checkpoint/dcp_metadata.py": {"Unpickler", "UnpicklingError"}}


def _dotted(node) -> str:
    """`a.b.c` for a Name/Attribute chain, '' otherwise."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _kw(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _docstrings(tree) -> set:
    """ids of the string constants that are docstrings (prose may name what the code avoids)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def violations(source: str, rel: str = "<snippet>") -> list[str]:
    """Every rule broken in `source` as 'rel:line: what'."""
    tree = ast.parse(source)
    allowed = PICKLE_ALLOWED.get(rel)
    pickle_names = set()  # local names bound to a pickle-like module
    found = []

    def bad(node, what):
        found.append(f"{rel}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PICKLE_MODULES:
                    if allowed is None or a.name != "pickle":
                        bad(node, f"import {a.name}")
                    pickle_names.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
            names = {a.name for a in node.names}
            if allowed is None or node.module != "pickle" or not names <= allowed:
                bad(node, f"from {node.module} import {sorted(names)}")
        elif isinstance(node, ast.ImportFrom) and any(a.name in OBJECT_COLLECTIVES for a in node.names):
            bad(node, f"imports an object collective from {node.module}")
        elif isinstance(node, ast.Attribute) and _dotted(node.value) in pickle_names:
            if allowed is None or node.attr not in allowed:
                bad(node, f"{_dotted(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "0.0.0.0" in node.value:
            if id(node) not in _docstrings(tree):
                bad(node, f"{node.value!r}: binds every interface")
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        last = name.rsplit(".", 1)[-1]
        if name == "torch.load" and not _is_true(_kw(node, "weights_only")):
            bad(node, "torch.load without weights_only=True")
        elif last == "load" and name.split(".")[0] in ("np", "numpy") and _is_true(_kw(node, "allow_pickle")):
            bad(node, f"{name}(allow_pickle=True)")
        elif name in ("yaml.unsafe_load", "yaml.full_load", "yaml.load_all", "yaml.unsafe_load_all"):
            bad(node, name)
        elif name == "yaml.load":
            loader = _kw(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            if _dotted(loader).rsplit(".", 1)[-1] not in SAFE_YAML_LOADERS:
                bad(node, "yaml.load without a safe Loader")
        elif last in OBJECT_COLLECTIVES:
            bad(node, f"object collective {name}")
        elif isinstance(node.func, ast.Name) and name in EXEC_BUILTINS and not (
                node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            bad(node, f"builtin {name}() on a value that is not a literal")
    return found


def package_files() -> list[Path]:
    files = sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 100 and ROOT / "megatron_fp4" / "rollout" / "weight_sync" / "peer_group.py" in files
    return files


def test_no_module_unpickles_executes_or_binds_every_interface():
    found = []
    for path in package_files():
        found += violations(path.read_text(), path.relative_to(ROOT).as_posix())
    assert not found, "\n".join(found)


@pytest.mark.parametrize("snippet", [
    "import pickle", "import cPickle as p", "import dill", "import marshal", "from pickle import loads",
    "from _pickle import Unpickler", "import pickle as p\np.loads(b'')",
    "torch.load(f)", "torch.load(f, weights_only=False)", "torch.load(f, weights_only=flag)",
    "np.load(f, allow_pickle=True)", "numpy.load(f, allow_pickle=True)",
    "yaml.load(s)", "yaml.load(s, Loader=yaml.Loader)", "yaml.unsafe_load(s)", "yaml.full_load(s)",
    "dist.broadcast_object_list(x)", "torch.distributed.all_gather_object(o, x)", "dist.gather_object(x)",
    "dist.scatter_object_list(o, x)", "dist.send_object_list(x, 1)", "dist.recv_object_list(x, 0)",
    "from torch.distributed import broadcast_object_list",
    "eval(text)", "exec(code)", "compile(src, 'f', 'exec')", "__import__(name)",
    "HOST = '0.0.0.0'", "def f():\n    x = 1\n    return ('0.0.0.0', 80)",
])
def test_checker_flags_each_rule(snippet):
    assert violations(snippet), snippet


def test_checker_accepts_the_safe_forms_and_the_listed_exceptions():
    safe = ("torch.load(f, map_location='cpu', weights_only=True)\nnp.load(f, allow_pickle=False)\n"
            "yaml.load(s, Loader=yaml.SafeLoader)\nyaml.safe_load(s)\nmodel.eval()\nre.compile('x')\n"
            "torch.compile(m)\n__import__('os')\ndef f():\n    '''never bind 0.0.0.0'''\n    return '127.0.0.1'\n")
    assert violations(safe) == []
    uses = "import pickle\ntry:\n    pass\nexcept pickle.UnpicklingError:\n    pass\n"
    assert violations(uses, "megatron_fp4/training/checkpoint/directory.py") == []
    assert violations(uses + "pickle.loads(b'')", "megatron_fp4/training/checkpoint/directory.py")  # only what is listed
    assert violations(uses, "megatron_fp4/rollout/wire.py")  # and only where it is listed
