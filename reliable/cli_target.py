"""``MODULE:APP``: the `App` a command runs (``reliable run``, ``reliable relay``)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:  # the framework is imported by the command that runs an app, not by `reliable --help`
    from reliable.app import App


def load_app(target: str, settings_path: str | None = None) -> App:
    """Import ``module:attribute`` and return the `App` it names, on the settings file
    ``settings_path`` if one is given.

    The file is in effect while the module is imported (as ``$RELIABLE_SETTINGS``), so an
    ``App()`` whose module opens its backends at import opens them on it; an app whose backends
    opened on other settings is a usage error saying which keys differ and what to do.
    """
    from reliable.settings import Settings
    from reliable.settings_errors import SettingsConflictError

    settings = Settings.load(settings_path) if settings_path else None  # a bad file: refused before importing
    with _settings_file(settings_path):
        app = _import(target)
    if settings is not None:
        try:
            app.use_settings(settings)
        except SettingsConflictError as exc:
            raise click.UsageError(
                f"--settings {settings_path}: {target} opened its backends while its module was imported, "
                f"on other settings ({', '.join(exc.keys)} differ). Open them later (in a function, not at "
                "import), build the app with reliable.App() (it reads --settings), or leave out --settings"
            ) from exc
    return app


@contextmanager
def _settings_file(path: str | None) -> Iterator[None]:
    """``$RELIABLE_SETTINGS`` names ``path`` inside (nothing changes without one)."""
    from reliable.settings_loader import SETTINGS_ENV

    before = os.environ.get(SETTINGS_ENV)
    if path:
        os.environ[SETTINGS_ENV] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SETTINGS_ENV, None)
        else:
            os.environ[SETTINGS_ENV] = before


def _import(target: str) -> App:
    from reliable.app import App

    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise click.BadParameter(f"{target!r} is not MODULE:APP (e.g. examples.payments:app)")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise click.BadParameter(f"cannot import module {module_name!r}: {exc}") from exc
    if not hasattr(module, attribute):
        apps = sorted(name for name, value in vars(module).items() if isinstance(value, App))
        hint = f"; it has {', '.join(apps)}" if apps else ""
        raise click.BadParameter(f"module {module_name!r} has no attribute {attribute!r}{hint}")
    app = getattr(module, attribute)
    if not isinstance(app, App):
        raise click.BadParameter(f"{target!r} is not a reliable.App (found {type(app).__name__})")
    return app
