"""The shape the deployment side keeps (one job per module): no class in deploy/ over 200
lines, no function over 60 lines in deploy/ or the disaggregated runtime, routing and
simulator packages; one module per name."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_CLASS_LINES = {"deploy": 200}
MAX_FUNCTION_LINES = {"deploy": 60, "megainfer/disagg": 60, "megainfer/routing": 60, "megainfer/tools/simulator": 60}


def _definitions(folder: str, kinds: tuple[type, ...]):
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kinds):
                yield f"{path.relative_to(ROOT)}:{node.name}", node.end_lineno - node.lineno + 1


def test_no_class_in_deploy_over_200_lines():
    for folder, limit in MAX_CLASS_LINES.items():
        long = {name: n for name, n in _definitions(folder, (ast.ClassDef,)) if n > limit}
        assert not long, f"classes over {limit} lines: {long}"


def test_no_function_over_60_lines_in_the_deployment_side():
    for folder, limit in MAX_FUNCTION_LINES.items():
        long = {name: n for name, n in _definitions(folder, (ast.FunctionDef, ast.AsyncFunctionDef)) if n > limit}
        assert not long, f"functions over {limit} lines: {long}"


# A package's own error types, entry points and command modules are alike by convention.
SHARED_NAMES = {"__init__.py", "__main__.py", "errors.py", "cli.py", "bench.py"}


def test_no_two_modules_share_a_name_across_packages():
    names = Counter(p.name for folder in ("megainfer", "deploy", "transport", "kernels", "planner")
                    for p in (ROOT / folder).rglob("*.py")
                    if p.name not in SHARED_NAMES and p.parent.name != "cli")
    assert not [n for n, c in names.items() if c > 1], [n for n, c in names.items() if c > 1]
