"""The project's modules import one another without a circle: every import counts, deferred ones
inside functions too; only `if TYPE_CHECKING:` imports (never run) are exempt. A module's import
of its own package (`from transport import _m2n_core` inside transport/) is the package's
structure, not an edge; a name a package does not define (a compiled extension module) is no
module of ours."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megainfer", "transport", "kernels", "deploy", "planner")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _never_run(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:`."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def _bound_names(path: Path) -> set[str]:
    """Names a package's __init__ binds (assignments, defs, imports)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped = _never_run(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)} | {name}
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name in modules]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in modules:
                        targets.append(sub)
                    elif base in modules and (modules[base].name != "__init__.py"
                                              or alias.name in _bound_names(modules[base])):
                        targets.append(base)
            graph[name] |= {t for t in targets if t not in ancestors}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    graph = import_graph()
    found = circles(graph)
    detail = "; ".join(" / ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in found)
    assert not found, f"import circles: {detail}"


def test_the_graph_sees_deferred_imports_and_skips_type_checking_ones():
    graph = import_graph()
    assert "megainfer.scheduling.scheduler" in graph["megainfer.scheduling.node_state"]
    assert "megainfer.scheduling.scheduler" not in graph["megainfer.messages"]  # messages: plain data
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
