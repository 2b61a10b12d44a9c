"""Training text that ships with Python: the standard library's sources (docstrings included),
and chat samples built from its documented functions.

The selection is a fixed, sorted walk of the source tree, so a run is reproducible on one
Python version; tests and generated tables are left out because they teach nothing a demo
should say.
"""

from __future__ import annotations

import ast
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "pydoc_data", "__pycache__"})
SKIP_PREFIXES = ("test_", "_sysconfigdata")
MAX_FILE_BYTES = 300_000  # larger files in the stdlib are generated data, not code
MAX_FUNCTION_CHARS = 2_000  # longer functions make chat samples mostly truncated source


@dataclass(frozen=True)
class ChatSample:
    request: str  # the user's turn
    answer: str  # the assistant's turn: the function's source


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[Path]:
    """The .py files under root worth training on, in sorted (reproducible) order."""
    chosen = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]) or rel.name.startswith(SKIP_PREFIXES):
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        chosen.append(path)
    return chosen


def read_sources(files: list[Path]) -> list[str]:
    """Each file's text; files that are not UTF-8 or are generated tables are left out."""
    texts = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        # Codec tables and similar machine output announce themselves in their header.
        if "generated from" in text[:1000].lower() or not text.strip():
            continue
        texts.append(text)
    return texts


def chat_samples(text: str) -> list[ChatSample]:
    """One sample per documented function or method: asked for by name and docstring summary,
    answered with its source."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    samples = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        summary = doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""
        if not summary or node.end_lineno is None:
            continue
        first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        source = textwrap.dedent("".join(lines[first - 1:node.end_lineno])).rstrip()
        if len(source) <= MAX_FUNCTION_CHARS:
            samples.append(ChatSample(f"Write a function `{node.name}`: {summary}", source))
    return samples
