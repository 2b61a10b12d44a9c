"""Reading a JSON file a planner flag names (an operator profile, a host profile): a missing
file, a file that is not JSON or not a JSON object, each a PlanError naming the flag, the
file and how to make a good one."""

from __future__ import annotations

import json
from pathlib import Path

from megainfer.errors import PlanError


def read_json_file(path: Path, what: str, fix: str) -> dict:
    """The JSON object in `path`; `what` names it in errors (the flag and the file), `fix` says
    how to make one."""
    if not path.is_file():
        raise PlanError(f"{what}: no such file ({fix})")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlanError(f"{what}: not valid JSON ({exc}); {fix}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{what}: not a JSON object; {fix}")
    return data
