"""The shape the code keeps (one job per module), in every package: no class over 200 lines, no
function over 60 (the CLI's argument tables apart: in `megainfer/cli/`, the `register` functions
and `_add_..._options` helpers, which are tables of flags; the CLI's other functions keep the bar);
one module per name."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megainfer", "deploy", "transport", "kernels", "planner")
MAX_CLASS_LINES = dict.fromkeys(PACKAGES, 200)
MAX_FUNCTION_LINES = dict.fromkeys(PACKAGES, 60)


def _argument_table(path: str, name: str) -> bool:
    """A CLI command's table of flags: `register`, or an `_add_..._options` helper of it."""
    return path.startswith("megainfer/cli/") and (name == "register" or
                                                 (name.startswith("_add_") and name.endswith("_options")))


def _definitions(folder: str, kinds: tuple[type, ...], exempt=lambda path, name: False):
    for path in sorted((ROOT / folder).rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kinds) and not exempt(relative, node.name):
                yield f"{relative}:{node.name}", node.end_lineno - node.lineno + 1


def test_no_class_over_200_lines():
    for folder, limit in MAX_CLASS_LINES.items():
        long = {name: n for name, n in _definitions(folder, (ast.ClassDef,)) if n > limit}
        assert not long, f"classes over {limit} lines: {long}"


def test_no_function_over_60_lines():
    for folder, limit in MAX_FUNCTION_LINES.items():
        long = {name: n for name, n in _definitions(folder, (ast.FunctionDef, ast.AsyncFunctionDef), _argument_table)
                if n > limit}
        assert not long, f"functions over {limit} lines: {long}"


# A package's own error types, entry points and command modules are alike by convention.
SHARED_NAMES = {"__init__.py", "__main__.py", "errors.py", "cli.py", "bench.py"}


def test_no_two_modules_share_a_name_across_packages():
    names = Counter(p.name for folder in PACKAGES
                    for p in (ROOT / folder).rglob("*.py")
                    if p.name not in SHARED_NAMES and p.parent.name != "cli")
    assert not [n for n, c in names.items() if c > 1], [n for n, c in names.items() if c > 1]
