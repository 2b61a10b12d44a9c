"""The README's table of environment variables, written from the settings tables of the three
layers that read them (`kernels/kernel_settings.py`, `transport/transport_settings.py`,
`megainfer/settings.py`): `python -m megainfer.tools.settings_table` prints it, and
tests/test_settings.py checks that the README holds what it prints."""

from __future__ import annotations

from kernels import kernel_settings
from megainfer import settings
from transport import transport_settings

LAYERS = (settings, transport_settings, kernel_settings)  # each holds its SETTINGS table
BEGIN = "<!-- settings table: python -m megainfer.tools.settings_table -->"
END = "<!-- end of settings table -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """The table, between the README's markers."""
    rows = [BEGIN, "| variable | type | default | meaning | parsed in |", "|---|---|---|---|---|"]
    for layer in LAYERS:
        home = layer.__name__.replace(".", "/") + ".py"
        for s in layer.SETTINGS:
            default = "unset" if s.default in (None, "") else f"`{s.default}`"
            rows.append(f"| `{s.name}` | {_cell(s.kind)} | {default} | {_cell(s.meaning)} | `{home}` |")
    return "\n".join([*rows, END])


if __name__ == "__main__":
    print(markdown())
