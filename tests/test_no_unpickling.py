"""Nothing received from a client or a peer is ever unpickled (docs/reliability.md): no module of
the serving path imports a deserializer that can run code (pickle and its kin), or calls one
that can unless told not to (yaml.load without a safe loader, torch.load, numpy.load with
pickles allowed). Requests arrive as protobuf or JSON, the M2N wire is `struct`-packed
(transport/wire.py); Ray pickles its own control messages between the driver and the node actors
it started, which no client reaches."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megainfer", "transport", "deploy", "planner", "kernels")
FORBIDDEN_IMPORTS = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "jsonpickle"}
FORBIDDEN_CALLS = {("yaml", "load"), ("yaml", "unsafe_load"), ("yaml", "full_load"), ("torch", "load"),
                   ("np", "load"), ("numpy", "load")}


def _violations(source: str, where: str) -> list[str]:
    """What `source` (the text of module `where`) imports or calls of the forbidden."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module.split(".")[0]]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name):
            if (node.func.value.id, node.func.attr) in FORBIDDEN_CALLS:
                found.append(f"{where}:{node.lineno} calls {node.func.value.id}.{node.func.attr}")
            continue
        else:
            continue
        found += [f"{where}:{node.lineno} imports {name}" for name in names
                  if name in FORBIDDEN_IMPORTS]
    return found


def test_no_serving_module_can_unpickle_what_it_receives():
    found = [v for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             for v in _violations(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))]
    assert not found, found


def test_the_check_sees_what_it_forbids():
    source = "import pickle\nfrom marshal import loads\nimport yaml\nyaml.load(x)\ntorch.load(f)\nyaml.safe_load(x)\n"
    found = _violations(source, "probe.py")
    assert [f.split(" ", 1)[1] for f in found] == ["imports pickle", "imports marshal", "calls yaml.load",
                                                  "calls torch.load"]
