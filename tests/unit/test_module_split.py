"""The split of retry and settings into smaller modules keeps every public name where it was."""

import importlib

import pytest

from reliable import classify, durations, settings_errors, settings_loader

RETRY_NAMES = {
    classify: ("Verdict", "Classifier", "Rule", "fatal_on", "retry_on", "when", "classify",
               "build_classifier", "POISON"),
    durations: ("parse_duration", "DURATION_HELP"),
}
SETTINGS_NAMES = {
    settings_errors: ("SettingsError",),
    settings_loader: ("ENV_PREFIX", "SETTINGS_ENV", "DEFAULT_FILE"),
}


@pytest.mark.parametrize(("facade", "homes"), [("reliable.retry", RETRY_NAMES), ("reliable.settings", SETTINGS_NAMES)])
def test_facade_re_exports_the_same_objects(facade, homes):
    module = importlib.import_module(facade)
    for home, names in homes.items():
        for name in names:
            assert getattr(module, name) is getattr(home, name), f"{facade}.{name}"


@pytest.mark.parametrize("facade", ["reliable.retry", "reliable.settings"])
def test_every_name_in_all_is_importable(facade):
    module = importlib.import_module(facade)
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert missing == []


def test_retry_keeps_its_own_public_names():
    import reliable.retry as retry

    expected = {"UNLIMITED", "NO_LIMIT", "Check", "ROCKETMQ_DELAY_LEVELS", "Redelivery", "RedeliveryPolicy",
                "DelayLevels", "InProcessRetry", "call_with_retry"}
    assert expected <= set(retry.__all__)


def test_the_package_names_its_public_objects_without_importing_them():
    """``import reliable`` is light (a Spark executor importing `reliable.spark.source` pays
    for it on every query); each public name is still the object of its home module."""
    import subprocess
    import sys

    probe = ("import sys, reliable.spark.source; "
             "print(sorted(m for m in ('sqlalchemy', 'reliable.app', 'backends.store') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"

    import reliable
    from reliable.app import App
    from reliable.retry import fatal_on

    assert reliable.App is App and reliable.fatal_on is fatal_on
    assert all(hasattr(reliable, name) for name in reliable.__all__)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        reliable.Nope  # noqa: B018
