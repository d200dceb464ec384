"""Worker processes for the kill -9 runs, forked from a server that has imported them already.

A kill -9 run starts a worker process about twenty times. Started with
``python -m``, each one spent about a second of CPU (five seconds of wall time
on a loaded machine) importing the framework before it consumed anything.
Here they are forked from multiprocessing's fork server, which imports the
worker modules once (`PRELOAD`): each start costs a fork. A forked worker is
still a process of its own, with its own connections, and SIGKILL ends it
just the same.

``start(target, args, env, cwd, output)`` runs ``target(*args)`` in such a
process with ``env`` as its whole environment, ``cwd`` as its directory and
its standard output and error written to ``output`` (``os.devnull`` to drop them).

``reliable(arguments, cwd, env)`` and ``python(arguments, cwd, env)`` run a
``reliable`` command or a Python script to its end the same way and return what
`subprocess.run` would (exit status, standard output and error apart). Such a
process ends as a normal one does, its ``atexit`` hooks run (the embedded broker
writes its offsets there). A test of the CLI that is not about the installed
script spends a fork instead of the 0.8 CPU-second a fresh ``reliable``
process took (`tests/framework/test_cli.py`: 33 CPU-seconds, now 5).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

PRELOAD = [
    "tests.transports.chaos_worker",
    "tests.transports.keyed_worker",
    "tests.transports.outbox_chain_worker",
    "tests.framework.offsets_worker",
    "tests.framework.shared_queue_worker",
    "reliable.cli",
    "broker.server.run",
    "backends.transport.embedded",
    "backends.transport.redis_streams",
    "backends.transport.remote",
    "backends.transport.kafka",
    "backends.transport.nats_transport",
    "backends.transport.amqp_transport",
]
"""What the fork server imports before it forks a worker (a module that fails to import is skipped)."""

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


def start(target: Callable[..., Any], args: Sequence[Any], env: Mapping[str, str], cwd: Path,
          output: str | Path = os.devnull) -> BaseProcess:
    """``target(*args)`` in a worker process forked from the fork server, started."""
    process = _CONTEXT.Process(target=_run, args=(target, tuple(args), dict(env), str(cwd), str(output)), daemon=True)
    process.start()
    return process


def _run(target: Callable[..., Any], args: tuple[Any, ...], env: dict[str, str], cwd: str, output: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    with open(output, "a") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    target(*args)


def run_cli(*arguments: str) -> None:
    """The ``reliable`` command with ``arguments``, as a `start` target."""
    from reliable.cli import main

    sys.argv = ["reliable", *arguments]
    main()


def reliable(arguments: Sequence[str], cwd: Path, env: Mapping[str, str], input: str | None = None,
             timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``reliable ARGUMENTS`` run to its end as `subprocess.run` gives it (exit status, standard output
    and error apart), in a process forked from the fork server: the command's own process, without
    the second of imports a ``reliable`` process spends first (`tests/README.md`)."""
    return _to_the_end(run_cli, ["reliable", *arguments], cwd, env, input, timeout)


def python(arguments: Sequence[str], cwd: Path, env: Mapping[str, str], input: str | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT ARGS...`` (``arguments``) as `reliable` runs the command: the script run as
    ``__main__`` in a process forked from the fork server."""
    return _to_the_end(run_script, ["python", *arguments], cwd, env, input, timeout)


def run_script(script: str, *arguments: str) -> None:
    """The Python script ``script`` with ``arguments``, as ``python SCRIPT ARGS...`` runs it."""
    sys.argv = [script, *arguments]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


def _to_the_end(target: Callable[..., Any], command: list[str], cwd: Path, env: Mapping[str, str],
                input: str | None, timeout: float) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="reliable-forked-") as folder:
        streams = [Path(folder, name) for name in ("stdin", "stdout", "stderr")]
        streams[0].write_text(input or "")
        process = _CONTEXT.Process(target=_ended_normally, args=(target, command[1:], dict(env), str(cwd),
                                                                 *map(str, streams)), daemon=True)
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(command, timeout)
        return subprocess.CompletedProcess(command, process.exitcode, streams[1].read_text(), streams[2].read_text())


def _ended_normally(target: Callable[..., Any], arguments: list[str], env: dict[str, str], cwd: str, stdin: str,
                    stdout: str, stderr: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path, mode in ((0, stdin, os.O_RDONLY), (1, stdout, os.O_WRONLY | os.O_CREAT),
                           (2, stderr, os.O_WRONLY | os.O_CREAT)):
        opened = os.open(path, mode)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)  # multiprocessing gave the process's own os.devnull
    try:
        target(*arguments)
    finally:  # as a process that ends normally does (multiprocessing's end skips them): the
        atexit._run_exitfuncs()  # embedded broker writes its offsets there
