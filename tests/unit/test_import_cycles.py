"""No import circles among our modules (issue 24), lazy imports included.

The graph is built with `ast` over megatron_fp4/, benchmarks/ and tools/: every `import` and
`from ... import`, also those inside functions (a lazy import that closes a cycle is still a circle
in the design, only hidden from the interpreter). An edge goes to the module a statement names, or
to the submodule when `from package import name` names one. benchmarks/ and tools/ are scripts run
with their own folder on sys.path, so there `import sweep` names the sibling `benchmarks/sweep.py`.
Each cycle is reported as a path, with the modules of its strongly connected component.
"""
import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("megatron_fp4", "benchmarks", "tools")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_package(path: pathlib.Path) -> bool:
    return path.name == "__init__.py"


def _targets(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
                yield _sibling(name, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if _is_package(path) else name.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join(here + ([base] if base else []))
            if not node.level:
                yield from _targets_from(_sibling(name, base), node, modules)
            yield from _targets_from(base, node, modules)


def _targets_from(base: str, node: ast.ImportFrom, modules: dict[str, pathlib.Path]):
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        yield sub if sub in modules else base


def _sibling(importer: str, target: str) -> str:
    """A script's bare import of a module next to it (benchmarks/, tools/ put their folder on sys.path)."""
    top = importer.split(".")[0]
    return f"{top}.{target}" if top in ("benchmarks", "tools") else target


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        graph[name] = {t for t in _targets(name, path, modules) if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle path per strongly connected component with more than one module."""
    return [_path_in(comp, graph) for comp in components(graph)]


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan), by first module."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(comps, key=min)


def _path_in(comp: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module, as a path back to itself."""
    start = min(comp)
    parent, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, v, start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in component {comp}")


def test_cycle_finder_reports_a_lazy_circle_as_a_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    graph = import_graph()
    found = [f"{' -> '.join(_path_in(c, graph))}   [circle: {', '.join(sorted(c))}]" for c in components(graph)]
    assert not found, "import circles (break them: see issue 24):\n" + "\n".join(found)
