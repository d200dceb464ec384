"""The streams `nats://` uses, reconciled with the settings rather than assumed.

A stream is created on first use. One that exists already (made by another
client, or by an earlier deployment) is compared with what the settings ask
for: what JetStream can change in place (replicas, the duplicate window, the
subjects, the discard policy) is updated with a stream update; what it cannot
(retention, storage) is refused with a `ConfigurationError` naming each
difference. Nothing is silently left as it was: a deployment that moves to
``replicas = 3``, as docs/cluster.md advises, gets three replicas.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import nats.js.errors
import structlog
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from backends.errors import ConfigurationError, ReliableError
from backends.transport.nats_client import Connection

log = structlog.get_logger(__name__)

NAME_IN_USE = 10058
"""JetStream's "stream name already in use with a different configuration"."""
STREAM_NOT_FOUND = 10059
GONE = {10014: "consumer", STREAM_NOT_FOUND: "stream"}
"""JetStream's "consumer not found" and "stream not found": deleted under a running member."""
UPDATABLE = ("num_replicas", "duplicate_window", "subjects", "discard")
"""The fields of ours a stream update may change."""
FIXED = ("retention", "storage")
"""The fields of ours JetStream refuses to change on an existing stream."""


class Streams:
    """The streams one transport has created or reconciled (each once per transport)."""

    def __init__(self, connection: Connection, *, replicas: int, duplicate_window: float) -> None:
        self._connection = connection
        self._replicas = replicas
        self._duplicate_window = duplicate_window
        self._known: set[str] = set()
        self._lock = threading.Lock()

    def ensure(self, stream: str, subjects: list[str]) -> None:
        """``stream`` with ``subjects`` as the settings want it: created, updated, or refused."""
        with self._lock:
            if stream in self._known:
                return
        wanted = StreamConfig(
            name=stream,
            subjects=subjects,
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            duplicate_window=self._duplicate_window,
            num_replicas=self._replicas,
        )
        self._connection.guarded(lambda: self._reconcile(wanted), f"create stream {stream!r}")
        with self._lock:
            self._known.add(stream)

    def forget(self) -> None:
        """Forget what was reconciled (the streams were deleted)."""
        with self._lock:
            self._known.clear()

    def missing(self, stream: str) -> bool:
        """Whether ``stream`` is gone (deleted under us: a publish to it went unanswered); if so
        it is forgotten, so the next `ensure` creates it again. Another failure is raised."""
        async def look() -> bool:
            try:
                await self._connection.js.stream_info(stream)
                return False
            except nats.js.errors.NotFoundError as exc:
                if exc.err_code != STREAM_NOT_FOUND:
                    raise
                return True

        gone = self._connection.guarded(look, f"look for stream {stream!r}")
        if gone:
            with self._lock:
                self._known.discard(stream)
        return gone

    async def _reconcile(self, wanted: StreamConfig) -> None:
        js = self._connection.js
        try:
            await js.add_stream(wanted)  # succeeds as well when the stream exists exactly so
            return
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != NAME_IN_USE:
                raise
        existing = (await js.stream_info(wanted.name or "")).config
        fixed = differences(existing, wanted, FIXED)
        if fixed:
            raise ConfigurationError(
                f"nats: stream {wanted.name!r} exists with {'; '.join(fixed)}; JetStream cannot change "
                "that on an existing stream: delete the stream or change the settings"
            )
        changed = differences(existing, wanted, UPDATABLE)
        if changed:
            update = {field: getattr(wanted, field) for field in UPDATABLE}
            await js.update_stream(replace(existing, **update))
            log.info("transport.stream_updated", stream=wanted.name, changed=changed)


def differences(existing: StreamConfig, wanted: StreamConfig, fields: tuple[str, ...]) -> list[str]:
    """``"field: existing, settings want wanted"`` for each of ``fields`` that differs."""
    found = []
    for field in fields:
        have, want = _comparable(getattr(existing, field)), _comparable(getattr(wanted, field))
        if have != want:
            found.append(f"{field} {have} (the settings want {want})")
    return found


def _comparable(value: object) -> object:
    if isinstance(value, list):
        return sorted(value)
    return getattr(value, "value", value)


def deleted(exc: BaseException) -> str | None:
    """``"consumer"`` or ``"stream"`` when ``exc`` (or its cause) is JetStream saying it is not found."""
    cause = exc.__cause__ if isinstance(exc, ReliableError) else exc
    if isinstance(cause, nats.js.errors.NotFoundError):
        return GONE.get(cause.err_code or 0)
    return None
