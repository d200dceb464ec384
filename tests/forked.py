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
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

PRELOAD = [
    "tests.transports.chaos_worker",
    "tests.transports.keyed_worker",
    "tests.transports.outbox_chain_worker",
    "tests.framework.offsets_worker",
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
