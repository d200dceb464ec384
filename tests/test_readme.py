"""Every code block of the README runs as written.

* a ```python block runs as a script of its own, in a fresh folder, with the
  repository on ``PYTHONPATH``; it must exit 0 (a process forked from the fork
  server of `tests.forked`, which imported the framework already);
* a ```sh block runs line by line with bash from the repository's root (the
  README's commands are written for it), each line must exit 0; the line
  ``scripts/dev test`` is what CI itself runs and is not run again here;
* ```toml blocks are loaded as settings files; text blocks are output.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from reliable.settings import Settings
from tests import forked

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
NOT_RUN_AGAIN = ("scripts/dev test",)


def blocks(language: str) -> list[tuple[int, str]]:
    text = README.read_text()
    return [
        (text.count("\n", 0, match.start()) + 1, match.group(2))
        for match in BLOCK.finditer(text)
        if match.group(1) == language
    ]


def env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    bin_dir = str(Path(sys.executable).parent)  # the `reliable` command of this environment
    return {**os.environ, "PYTHONPATH": path, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "RELIABLE_SETTINGS": ""}


def test_the_readme_has_the_two_setup_commands():
    commands = [line.split("#")[0].strip() for _, block in blocks("sh") for line in block.splitlines()]
    assert "scripts/dev example" in commands
    assert "scripts/dev test" in commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/dev test" in ci


@pytest.mark.parametrize(("line", "code"), blocks("python"), ids=lambda value: str(value)[:20])
def test_python_block_runs(line, code, tmp_path):
    script = tmp_path / f"readme_line_{line}.py"
    script.write_text(code)
    run = forked.python([script.name], tmp_path, env(), timeout=300)  # `python SCRIPT`, without its imports
    assert run.returncode == 0, f"README.md line {line}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"


@pytest.mark.parametrize(("line", "commands"), blocks("sh"), ids=lambda value: str(value)[:20])
def test_sh_block_runs(line, commands):
    for command in commands.splitlines():
        runnable = command.split(" #")[0].strip()
        if not runnable or runnable.startswith("#") or runnable.startswith(NOT_RUN_AGAIN):
            continue
        run = subprocess.run(["bash", "-c", runnable], cwd=ROOT, env=env(),
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, (
            f"README.md block at line {line}: {runnable!r} exited {run.returncode}:\n"
            f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
        )


@pytest.mark.parametrize(("line", "toml"), blocks("toml"), ids=lambda value: str(value)[:20])
def test_toml_block_is_valid_settings(line, toml, tmp_path):
    path = tmp_path / "reliable.toml"
    path.write_text(toml)
    Settings.load(path)  # raises, naming the key, on anything not allowed

