"""``MODULE:APP``: the `App` a command runs (``reliable run``, ``reliable relay``)."""

from __future__ import annotations

import importlib
import os
import sys

import click

from reliable.app import App


def load_app(target: str) -> App:
    """Import ``module:attribute`` and return the `App` it names."""
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
