"""Environment variables: every one megainfer owns is declared in its layer's settings table
(kernels/kernel_settings.py, transport/transport_settings.py, megainfer/settings.py), parsed
there with an error naming the variable, the bad value and the fix, and listed in the README's
table, which `python -m megainfer.tools.settings_table` writes; nothing else reads os.environ
but the reads and writes of other programs' variables the settings modules name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kernels import kernel_settings
from megainfer import settings
from megainfer.tools.settings_table import BEGIN, END, LAYERS, markdown
from transport import transport_settings

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megainfer", "transport", "kernels", "deploy", "planner")
# Modules that touch os.environ for variables megainfer does not own (each named in
# megainfer/settings.py's docstring), or that write a child's environment.
FOREIGN = {"megainfer/hub_cache.py", "kernels/launch.py", "megainfer/tools/bench/serve_requests.py",
           "megainfer/tools/gpucheck/environment.py", "megainfer/tools/gpucheck/runner.py",
           "megainfer/tools/gpucheck/engine_check.py", "megainfer/tools/demo_train.py"}
SETTINGS_MODULES = {"megainfer/settings.py", "transport/transport_settings.py", "kernels/kernel_settings.py"}


def _sources():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")


def test_the_readme_table_is_the_one_the_settings_write():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    assert readme[start:end] == markdown(), "regenerate it: python -m megainfer.tools.settings_table"


def test_every_variable_the_code_names_is_in_a_table_once():
    declared = [s.name for layer in LAYERS for s in layer.SETTINGS]
    assert len(declared) == len(set(declared))
    named = {m for _, text in _sources() for m in re.findall(r"\bMEGAINFER_[A-Z0-9_]*[A-Z0-9]\b", text)}
    assert named <= set(declared), f"named in the code, declared nowhere: {sorted(named - set(declared))}"
    for layer in LAYERS:
        for s in layer.SETTINGS:
            assert s.meaning and "\n" not in s.meaning and s.name.startswith("MEGAINFER_")


def test_only_the_settings_modules_read_the_environment():
    readers = set()
    for rel, text in _sources():
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb")
                    and isinstance(node.value, ast.Name) and node.value.id == "os"):
                readers.add(rel)
    assert readers - SETTINGS_MODULES == FOREIGN, sorted(readers ^ (FOREIGN | SETTINGS_MODULES))


@pytest.mark.parametrize("layer", [transport_settings, kernel_settings], ids=lambda m: m.__name__)
def test_each_layer_parses_alike(layer):
    """The two lower layers restate one `Setting` shape (neither may import the other)."""
    fields = [f for f in layer.Setting.__dataclass_fields__]
    assert fields == ["name", "default", "meaning", "choices", "minimum", "maximum"]
    choice = layer.Setting("X_MODE", "auto", "m", choices=("auto", "on"))
    number = layer.Setting("X_PORT", 1, "m", minimum=1)
    text = layer.Setting("X_NAME", None, "m")
    assert choice.read({}) == "auto" and choice.read({"X_MODE": " ON "}) == "on"
    assert number.read({"X_PORT": " "}) == 1 and number.read({"X_PORT": "7"}) == 7
    assert text.read({}) is None and text.read({"X_NAME": "mlx5_0"}) == "mlx5_0"
    with pytest.raises(layer.SettingError, match=r"X_MODE='bogus' is not one of auto, on; set it to auto or on, "
                                                 r"or unset it \(default: auto\)"):
        choice.read({"X_MODE": "bogus"})
    with pytest.raises(layer.SettingError, match=r"X_PORT='0' is not an integer >= 1; set it to an integer >= 1, "
                                                 r"or unset it \(default: 1\)"):
        number.read({"X_PORT": "0"})
    with pytest.raises(layer.SettingError, match="X_PORT='two'"):
        number.read({"X_PORT": "two"})
    bounded = layer.Setting("X_LEVEL", 0, "m", minimum=0, maximum=15)
    assert bounded.read({"X_LEVEL": "15"}) == 15 and bounded.kind == "integer 0..15"
    with pytest.raises(layer.SettingError, match=r"X_LEVEL='16' is not an integer 0\.\.15; set it to an integer "
                                                 r"0\.\.15, or unset it \(default: 0\)"):
        bounded.read({"X_LEVEL": "16"})


def test_reads_happen_at_the_call(monkeypatch):
    monkeypatch.setenv("MEGAINFER_M2N_CORE", "off")
    assert transport_settings.M2N_CORE.read() == "off"
    monkeypatch.delenv("MEGAINFER_M2N_CORE")
    assert transport_settings.M2N_CORE.read() == "auto"
    monkeypatch.setenv("MEGAINFER_KERNELS", "Reference")
    assert kernel_settings.KERNELS.read() == "reference"


def test_megainfers_settings_are_text_never_refused():
    assert all(s.kind == "string" for s in settings.SETTINGS)
    key = settings.API_KEY
    assert key.read({}) is None and key.read({"MEGAINFER_API_KEY": "  "}) is None
    assert key.read({"MEGAINFER_API_KEY": "k-1"}) == "k-1"


def test_a_bad_value_is_the_layers_error():
    with pytest.raises(ValueError, match="MEGAINFER_M2N_CORE='maybe' is not one of auto, on, off"):
        transport_settings.M2N_CORE.read({"MEGAINFER_M2N_CORE": "maybe"})
