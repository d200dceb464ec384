"""Reading the settings: finding and parsing the TOML file, applying environment overrides.

The environment is read here rather than by pydantic-settings because its env
source only reads ``os.environ`` and cannot tell which variable a bad value
came from; `Origin` records it so errors can name the variable.
"""

from __future__ import annotations

import difflib
import json
import re
import tomllib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from reliable.settings_errors import Origin, SettingsError

ENV_PREFIX = "RELIABLE_"
SETTINGS_ENV = "RELIABLE_SETTINGS"
DEFAULT_FILE = "reliable.toml"


def find_file(path: str | Path | None, environ: Mapping[str, str]) -> Path | None:
    """``path``, else the file $RELIABLE_SETTINGS names, else ./reliable.toml if it exists."""
    if path is None and environ.get(SETTINGS_ENV):
        path = environ[SETTINGS_ENV]
        if not Path(path).is_file():
            raise SettingsError([f"{path}: settings file not found (named by {SETTINGS_ENV})"])
    if path is None:
        return Path(DEFAULT_FILE) if Path(DEFAULT_FILE).is_file() else None
    if not Path(path).is_file():
        raise SettingsError([f"{path}: settings file not found"])
    return Path(path)


def read_toml(file: Path) -> dict[str, Any]:
    """The tables of ``file``; a syntax error is reported with its line and column."""
    try:
        with file.open("rb") as stream:
            return tomllib.load(stream)
    except tomllib.TOMLDecodeError as exc:
        text = str(exc)
        where = re.search(r"\(at line (\d+), column (\d+)\)", text)
        reason = re.sub(r"\s*\(at [^)]*\)$", "", text)
        at = f" at line {where[1]}, column {where[2]}" if where else ""
        raise SettingsError([f"{file}: invalid TOML{at}: {reason}"]) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError([f"{file}: cannot read the settings file: {exc}"]) from exc


def apply_env(
    data: dict[str, Any], environ: Mapping[str, str], origin: Origin, sections: Collection[str]
) -> None:
    """Set each ``RELIABLE_SECTION__KEY`` on ``data``; a ``RELIABLE_`` variable that names no
    section is a `SettingsError` with the closest names (a typo must not be silently ignored)."""
    unknown: list[str] = []
    for variable, value in sorted(environ.items()):
        upper = variable.upper()
        if not upper.startswith(ENV_PREFIX) or upper == SETTINGS_ENV:
            continue
        parts = variable[len(ENV_PREFIX):].lower().split("__")
        if parts[0] not in sections or len(parts) < 2:
            unknown.append(_unknown_variable(variable, parts, sections))
            continue
        node: dict[str, Any] = data
        loc: tuple[str, ...] = ()
        for part in parts[:-1]:
            key = _same_key(node, part)
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node, loc = node[key], (*loc, key)
        key = _same_key(node, parts[-1])
        node[key] = _env_value(value)
        origin.variables[(*loc, key)] = variable
    if unknown:
        raise SettingsError(unknown)


def _unknown_variable(variable: str, parts: list[str], sections: Collection[str]) -> str:
    """Why ``variable`` names no setting, with the closest ``RELIABLE_SECTION__KEY`` spelling."""
    guess = difflib.get_close_matches(parts[0].split("_")[0] if len(parts) == 1 else parts[0],
                                      list(sections), n=1)
    hint = ""
    if guess:
        rest = parts[1:] or ["_".join(parts[0].split("_")[1:]) or "KEY"]
        hint = f"; did you mean {ENV_PREFIX}{guess[0].upper()}__{'__'.join(rest).upper()}?"
    return (f"environment variable {variable} names no setting: expected "
            f"{ENV_PREFIX}SECTION__KEY with SECTION one of {', '.join(sorted(sections))}{hint}")


def _same_key(node: Mapping[str, Any], part: str) -> str:
    """The existing key ``part`` names, ignoring case (handler names may have capitals)."""
    return next((key for key in node if key.lower() == part), part)


def _env_value(value: str) -> Any:
    if value.lstrip().startswith(("[", "{")):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def deep_merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` laid over it, tables merged key by key."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
