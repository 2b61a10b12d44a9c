"""The shape the code keeps (one job per module), in every package: no class over 200 lines, no
function over 60 (the CLI's argument tables apart: `megainfer/cli/`, whose `register` functions
are tables of flags); one module per name."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megainfer", "deploy", "transport", "kernels", "planner")
MAX_CLASS_LINES = dict.fromkeys(PACKAGES, 200)
MAX_FUNCTION_LINES = dict.fromkeys(PACKAGES, 60)
EXEMPT_FUNCTIONS = ("megainfer/cli/",)  # argument tables


def _definitions(folder: str, kinds: tuple[type, ...], exempt: tuple[str, ...] = ()):
    for path in sorted((ROOT / folder).rglob("*.py")):
        if path.relative_to(ROOT).as_posix().startswith(exempt):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kinds):
                yield f"{path.relative_to(ROOT)}:{node.name}", node.end_lineno - node.lineno + 1


def test_no_class_over_200_lines():
    for folder, limit in MAX_CLASS_LINES.items():
        long = {name: n for name, n in _definitions(folder, (ast.ClassDef,)) if n > limit}
        assert not long, f"classes over {limit} lines: {long}"


def test_no_function_over_60_lines():
    for folder, limit in MAX_FUNCTION_LINES.items():
        long = {name: n for name, n in _definitions(folder, (ast.FunctionDef, ast.AsyncFunctionDef), EXEMPT_FUNCTIONS)
                if n > limit}
        assert not long, f"functions over {limit} lines: {long}"


# A package's own error types, entry points and command modules are alike by convention.
SHARED_NAMES = {"__init__.py", "__main__.py", "errors.py", "cli.py", "bench.py"}


def test_no_two_modules_share_a_name_across_packages():
    names = Counter(p.name for folder in PACKAGES
                    for p in (ROOT / folder).rglob("*.py")
                    if p.name not in SHARED_NAMES and p.parent.name != "cli")
    assert not [n for n, c in names.items() if c > 1], [n for n, c in names.items() if c > 1]
