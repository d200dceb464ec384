"""The clients' methods, one per operation of the table, derived rather than written per client.

A client class mixes in `SyncCalls` (or `AsyncCalls`) and supplies
``_request(op, fields)``: how one request reaches the server (a TCP
connection, an asyncio stream, the local socket). Every operation of
`broker.protocol.operations` is then a method named by its ``method``: the
call's arguments become the request's fields, the reply becomes the Python
value. They are looked up in the table when called, so an operation added to
the table is a method of every client at once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from broker.protocol.operations import BY_METHOD, Operation


def _operation(owner: object, method: str) -> Operation:
    op = BY_METHOD.get(method)
    if op is None or method.startswith("_"):
        raise AttributeError(f"{type(owner).__name__!r} has no operation {method!r}")
    return op


class SyncCalls:
    """One method per operation, over the class's ``_request``."""

    def _request(self, op: Operation, fields: Mapping[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def __getattr__(self, method: str) -> Callable[..., Any]:
        op = _operation(self, method)

        def call(*args: Any, **kwargs: Any) -> Any:
            return op.result(self._request(op, op.request(args, kwargs)))
        return call


class AsyncCalls:
    """One coroutine per operation, over the class's coroutine ``_request``."""

    async def _request(self, op: Operation, fields: Mapping[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def __getattr__(self, method: str) -> Callable[..., Awaitable[Any]]:
        op = _operation(self, method)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return op.result(await self._request(op, op.request(args, kwargs)))
        return call
