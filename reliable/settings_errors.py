"""Settings errors: pydantic's validation errors turned into lines naming where, key, value and what is allowed.

Each problem reads ``WHERE: KEY = VALUE is not allowed; expected ALLOWED``, where
WHERE is the settings file or the environment variable that set the key
(`Origin` remembers which); an unknown key suggests the closest allowed one.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from backends.errors import ConfigurationError


class SettingsError(ConfigurationError):
    """Raised when the settings file or an environment override cannot be read or is invalid."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = tuple(problems)
        text = self.problems[0] if len(self.problems) == 1 else "invalid settings:\n  " + "\n  ".join(problems)
        super().__init__(text)


class SettingsConflictError(ConfigurationError):
    """Raised when settings are given to an app whose backends are already open with others."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = tuple(keys)
        super().__init__(f"the backends are already open with other settings ({', '.join(self.keys)} differ); "
                         "settings can change only before the backends open")


def changed_keys(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two dumps of the settings (``store.url``)."""
    keys: list[str] = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if isinstance(a, Mapping) and isinstance(b, Mapping) and name != "handlers":
            keys.extend(changed_keys(a, b, f"{prefix}{name}."))
        elif a != b:
            keys.append(prefix + name)
    return keys


class Origin:
    """Where values came from: a keyword argument, the environment variable that set a key, or the file."""

    def __init__(self, file: str | None, variables: Mapping[tuple[str, ...], str] | None = None,
                 arguments: Collection[str] = ()) -> None:
        self.file = file
        self.variables = dict(variables or {})
        self.arguments = frozenset(arguments)

    def source(self, loc: tuple[str, ...]) -> str:
        """The argument (they win) or variable that set ``loc`` or a table holding it, else the file."""
        if loc and loc[0] in self.arguments:
            return f"argument {loc[0]}"
        for end in range(len(loc), 0, -1):
            if loc[:end] in self.variables:
                return f"environment variable {self.variables[loc[:end]]}"
        return self.file or "settings"


def describe(error: Any, origin: Origin, prefix: tuple[str, ...], root: type[BaseModel]) -> str:
    """One line for one pydantic ``error`` on a ``root`` model validated at key ``prefix``."""
    relative = tuple(f"[{part}]" if isinstance(part, int) else part for part in error["loc"])
    loc = prefix + relative
    key = ".".join(loc).replace(".[", "[")
    where = origin.source(loc)
    if error["type"] == "extra_forbidden":
        allowed = _allowed_keys(root, relative[:-1])
        guess = difflib.get_close_matches(relative[-1], allowed, n=1)
        table = f" in [{'.'.join(loc[:-1])}]" if len(loc) > 1 else ""
        hint = f"; did you mean {guess[0]!r}?" if guess else ""
        return f"{where}: unknown key {key}{hint} (allowed{table}: {', '.join(allowed)})"
    value = error["input"]
    shown = str(value).lower() if isinstance(value, bool) else repr(value)  # as TOML writes it
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return f"{where}: {key} = {shown} is not allowed; expected {_expected(error)}"


def _allowed_keys(root: type[BaseModel], loc: tuple[str, ...]) -> list[str]:
    model = root
    for part in loc:
        field = model.model_fields.get(part)
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


_EXPECTED = {
    "int": "an integer",
    "float": "a number",
    "finite": "a finite number",
    "bool": "true or false",
    "string": "a string",
    "list": "a list",
    "dict": "a table",
    "model": "a table",
}


def _expected(error: Any) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == "literal_error":
        return "one of " + ", ".join(re.findall(r"'([^']*)'", str(ctx.get("expected", ""))))
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    family = kind.split("_")[0]
    return _EXPECTED.get(family, error["msg"][:1].lower() + error["msg"][1:])
