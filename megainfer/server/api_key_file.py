"""API keys as the user configures them: `--api-key KEY` (repeatable), else the environment
variable MEGAINFER_API_KEY, plus `--api-key-file PATH`. Each key gets the default limits of
`--api-key-rate-limit` and `--api-key-max-concurrency` unless its entry in the file sets its own.

The key file, by its name:

- `*.yaml` / `*.yml`: a mapping with a `keys:` list; an item is a key (a string) or a mapping
  with `key` (required), `name` (who the key belongs to: the name metrics and logs use instead
  of the key), `rate_limit` (requests per second, sustained) and `max_concurrency` (requests
  in flight at once). A limit left out takes the flag's default; `null` means unlimited.

      keys:
        - key: sk-team-a-7f3c...
          name: team-a
          rate_limit: 5
          max_concurrency: 8
        - key: sk-batch-91ab...
          name: batch
          rate_limit: null        # unlimited, whatever --api-key-rate-limit says
        - sk-ops-2d4e...          # named by its fingerprint, default limits

- any other name: one key per line; blank lines and lines starting with `#` are skipped.

Keys never appear in an error message or a log line: entries are named by their position and
name.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megainfer.errors import ConfigError
from megainfer.settings import API_KEY

API_KEY_ENV = API_KEY.name
YAML_SUFFIXES = (".yaml", ".yml")
ENTRY_FIELDS = ("key", "name", "rate_limit", "max_concurrency")


@dataclass(frozen=True)
class KeyLimits:
    rate_limit: float | None = None  # requests admitted per second, sustained; None: unlimited
    max_concurrency: int | None = None  # requests in flight at once; None: unlimited


@dataclass(frozen=True)
class KeyEntry:
    key: str  # the secret itself: hashed by AccessPolicy, never logged nor put in a message
    name: str | None  # who holds it; None: named by the key's fingerprint
    limits: KeyLimits
    source: str  # where it was configured, for messages: "--api-key #1", "--api-key-file keys.yaml keys[2]"


def check_key(key: Any, where: str) -> str:
    """A usable key, else ConfigError naming `where` (never the key)."""
    if not isinstance(key, str) or not key.strip():
        raise ConfigError(f"{where}: a key must be a non-empty string (in YAML, quote a key that reads as a "
                          "number); write the secret clients send as `Authorization: Bearer <key>`")
    if any(c.isspace() for c in key) or not key.isprintable() or not key.isascii():
        raise ConfigError(f"{where}: a key cannot contain spaces, control or non-ASCII characters (it travels in "
                          "an `Authorization: Bearer <key>` header); use ASCII letters, digits and punctuation")
    return key


def default_limits(rate_limit: float | None, max_concurrency: int | None) -> KeyLimits:
    """The flags' limits, checked (each names its flag)."""
    return KeyLimits(_rate(rate_limit, "--api-key-rate-limit"), _concurrency(max_concurrency,
                                                                             "--api-key-max-concurrency"))


def configured_keys(api_keys: Sequence[str] | None, api_key_file: str | os.PathLike | None,
                    limits: KeyLimits, environ: Mapping[str, str] | None = None) -> list[KeyEntry]:
    """Every configured key: the --api-key values (or MEGAINFER_API_KEY when none is given), then
    the key file's. Two entries with the same key or the same name are an error. `environ`: the
    environment to read MEGAINFER_API_KEY from (None: os.environ now)."""
    entries = [KeyEntry(check_key(key, f"--api-key #{i + 1}"), None, limits, f"--api-key #{i + 1}")
               for i, key in enumerate(api_keys or [])]
    if not entries and (env_key := API_KEY.read(environ)):
        entries.append(KeyEntry(check_key(env_key, API_KEY_ENV), None, limits, API_KEY_ENV))
    if api_key_file is not None:
        entries += load_key_file(api_key_file, limits)
    _check_unique(entries)
    return entries


def load_key_file(path: str | os.PathLike, limits: KeyLimits) -> list[KeyEntry]:
    """The keys of a key file (format above); ConfigError naming the file, the entry and the fix."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-key-file {path}: cannot read it ({getattr(exc, 'strerror', None) or exc}); "
                          "give a readable file of keys") from None
    entries = _yaml_entries(path, text, limits) if path.suffix in YAML_SUFFIXES else _line_entries(path, text, limits)
    if not entries:
        raise ConfigError(f"--api-key-file {path}: no keys in it; add at least one (a file that configures no key "
                          "would leave the server open)")
    _check_unique(entries)
    return entries


def _line_entries(path: Path, text: str, limits: KeyLimits) -> list[KeyEntry]:
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            where = f"--api-key-file {path} line {number}"
            entries.append(KeyEntry(check_key(line, where), None, limits, where))
    return entries


def _yaml_entries(path: Path, text: str, limits: KeyLimits) -> list[KeyEntry]:
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        # The parser's own message may quote the offending text, which may be a key: not repeated.
        raise ConfigError(f"--api-key-file {path}: not valid YAML{at}; write a mapping with a `keys:` list "
                          "(or name the file other than *.yaml for one key per line)") from None
    if not isinstance(document, dict) or set(document) != {"keys"} or not isinstance(document["keys"], list):
        raise ConfigError(f"--api-key-file {path}: expected a mapping with one field, `keys:`, holding a list of "
                          "keys or of mappings with `key`, `name`, `rate_limit`, `max_concurrency`")
    return [_yaml_entry(item, f"--api-key-file {path} keys[{i}]", limits) for i, item in enumerate(document["keys"])]


def _yaml_entry(item: Any, where: str, limits: KeyLimits) -> KeyEntry:
    if not isinstance(item, dict):
        return KeyEntry(check_key(item, where), None, limits, where)
    name = item.get("name")
    if name is not None:
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{where}: name must be a non-empty string; name the key's holder, "
                              "e.g. name: team-a")
        where = f"{where} (name {name!r})"
    unknown = sorted(set(map(str, item)) - set(ENTRY_FIELDS))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}; an entry has "
                          f"{', '.join(ENTRY_FIELDS)}")
    if "key" not in item:
        raise ConfigError(f"{where}: the `key` field is missing; add `key: <secret>`")
    key = check_key(item["key"], f"{where} key")
    rate = _rate(item["rate_limit"], f"{where} rate_limit") if "rate_limit" in item \
        else limits.rate_limit
    concurrency = _concurrency(item["max_concurrency"], f"{where} max_concurrency") \
        if "max_concurrency" in item else limits.max_concurrency
    return KeyEntry(key, name, KeyLimits(rate, concurrency), where)


def _rate(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{where}: must be a number of requests per second > 0, got {value!r}; leave it out "
                          "(or null in a key file) for no limit")
    return float(value)


def _concurrency(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: must be a whole number of requests >= 1, got {value!r}; leave it out "
                          "(or null in a key file) for no limit")
    return value


def _check_unique(entries: list[KeyEntry]) -> None:
    first_of_key: dict[str, KeyEntry] = {}
    first_of_name: dict[str, KeyEntry] = {}
    for entry in entries:
        if entry.key in first_of_key:
            raise ConfigError(f"{entry.source}: the same key as {first_of_key[entry.key].source}; give each holder "
                              "a key of its own and list it once")
        first_of_key[entry.key] = entry
        if entry.name is not None:
            if entry.name in first_of_name:
                raise ConfigError(f"{entry.source}: the name {entry.name!r} is taken by "
                                  f"{first_of_name[entry.name].source}; names must be unique (they tell "
                                  "requests' owners apart)")
            first_of_name[entry.name] = entry
