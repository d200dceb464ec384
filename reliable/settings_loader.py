"""Where the settings come from: the file lookup and pydantic-settings' sources over it.

pydantic-settings reads the TOML file (`TomlConfigSettingsSource`), the
``RELIABLE_SECTION__KEY`` variables (`EnvSettingsSource`, nested by ``__``)
and merges them under the keyword arguments. What stays here is what it does
not do: the lookup rules of the file (``$RELIABLE_SETTINGS``, a missing file
named on purpose is an error), an environment given as a mapping rather than
``os.environ`` (tests and embedded apps pass one), a ``RELIABLE_`` variable
naming no setting (pydantic-settings ignores it; a typo must not be), and
which variable set which key so errors can name it.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    TomlConfigSettingsSource,
)

from reliable.settings_errors import SettingsError

ENV_PREFIX = "RELIABLE_"
SETTINGS_ENV = "RELIABLE_SETTINGS"
DEFAULT_FILE = "reliable.toml"
NESTED = "__"


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


def file_source(settings_cls: type[BaseSettings], file: Path | None) -> TomlConfigSettingsSource:
    """The tables of ``file`` (none: no tables); a syntax error is reported with its line and column."""
    try:
        return TomlConfigSettingsSource(settings_cls, toml_file=file)
    except tomllib.TOMLDecodeError as exc:
        text = str(exc)
        where = re.search(r"\(at line (\d+), column (\d+)\)", text)
        reason = re.sub(r"\s*\(at [^)]*\)$", "", text)
        at = f" at line {where[1]}, column {where[2]}" if where else ""
        raise SettingsError([f"{file}: invalid TOML{at}: {reason}"]) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError([f"{file}: cannot read the settings file: {exc}"]) from exc


class EnvironmentSource(EnvSettingsSource):
    """pydantic-settings' environment source over ``environ`` instead of ``os.environ``.

    Only a value written as a JSON list or table (``[...]``, ``{...}``) is
    decoded; anything else, and JSON that does not decode, is passed on as the
    string it is, so a handler's ``...__CACHE__PREFIX=123`` stays the string it
    names and validation reports a bad value with its variable, key and value
    ("expected a list") instead of failing on the decoding.
    """

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        super().__init__(settings_cls)
        self.env_vars = {name.lower(): value for name, value in environ.items() if _is_ours(name)}

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        if isinstance(value, str) and not value.lstrip().startswith(("[", "{")):
            return value
        try:
            return super().decode_complex_value(field_name, field, value)
        except ValueError:
            return value


Layers = Callable[[type[BaseSettings]], tuple[PydanticBaseSettingsSource, ...]]
"""The sources under the keyword arguments, highest first: what one `Settings` construction reads."""


def _from_process(settings_cls: type[BaseSettings]) -> tuple[PydanticBaseSettingsSource, ...]:
    return (EnvironmentSource(settings_cls, os.environ),
            file_source(settings_cls, find_file(None, os.environ)))


_LAYERS: ContextVar[Layers] = ContextVar("reliable_settings_layers", default=_from_process)


def layers() -> Layers:
    """The layers being read: the process's variables over its settings file unless `reading`."""
    return _LAYERS.get()


@contextmanager
def reading(chosen: Layers) -> Iterator[None]:
    """Read ``chosen`` instead while inside (``Settings.load``'s file and mapping, a handler's tables)."""
    token = _LAYERS.set(chosen)
    try:
        yield
    finally:
        _LAYERS.reset(token)


def variable_keys(environ: Mapping[str, str]) -> dict[tuple[str, ...], str]:
    """The key each ``RELIABLE_`` variable sets (``('store', 'url')``), to name it in errors."""
    return {tuple(name[len(ENV_PREFIX):].lower().split(NESTED)): name for name in environ if _is_ours(name)}


def check_variables(environ: Mapping[str, str], sections: Collection[str]) -> None:
    """A ``RELIABLE_`` variable that names no section is a `SettingsError` with the closest names
    (pydantic-settings would ignore it, and a typo must not be silently ignored)."""
    unknown = [_unknown_variable(name, list(key), sections)
               for key, name in sorted(variable_keys(environ).items(), key=lambda item: item[1])
               if key[0] not in sections or len(key) < 2]
    if unknown:
        raise SettingsError(unknown)


def _is_ours(name: str) -> bool:
    return name.upper().startswith(ENV_PREFIX) and name.upper() != SETTINGS_ENV


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
