"""Typed messages: a handler's message parameter annotated with a pydantic model or dataclass.

``def h(order: Order)`` gets the body validated into ``Order``;
``def h(msg: reliable.Message[Order])`` keeps the envelope, with ``msg.body``
an ``Order``. Validation is pydantic's (`TypeAdapter`, built once when the
handler is decorated). A body that does not validate is poison: the handler
does not run, and the message is dead-lettered at once with pydantic's
errors in its record (`BodyValidationError`).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from backends.types import Message
from reliable.errors import BodyValidationError


class BodyType:
    """How a typed handler's argument is made from a message."""

    def __init__(self, model: type, envelope: bool) -> None:
        self.model, self.envelope = model, envelope
        self._adapter: TypeAdapter[Any] = TypeAdapter(model)

    @classmethod
    def of(cls, func: Any) -> BodyType | None:
        """The body type of ``func``'s first parameter, or None when it is not typed."""
        annotation = _first_annotation(func)
        if annotation is Message:  # the envelope as it comes (a dataclass itself, not a body type)
            return None
        envelope = typing.get_origin(annotation) is Message
        if envelope:
            annotation = (typing.get_args(annotation) or (Any,))[0]
        if isinstance(annotation, type) and (issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation)):
            return cls(annotation, envelope)
        return None

    def argument(self, message: Message) -> Any:
        """The validated body (or the envelope carrying it); `BodyValidationError` if it does not validate."""
        try:
            body = self._adapter.validate_python(message.body)
        except ValidationError as exc:
            raise BodyValidationError(
                f"message {message.id} does not validate as {self.model.__name__}: {exc}") from exc
        return message.with_body(body) if self.envelope else body


def _first_annotation(func: Any) -> Any:
    """The annotation of ``func``'s first parameter, resolved in its module (None if absent or
    not resolvable there, e.g. a class defined inside a function under postponed annotations)."""
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    if not parameters or parameters[0].annotation is inspect.Parameter.empty:
        return None
    annotation = parameters[0].annotation
    if isinstance(annotation, str):  # postponed: resolved as typing resolves it, in the module
        target = func if inspect.isfunction(func) or inspect.ismethod(func) else type(func).__call__
        try:
            annotation = typing.get_type_hints(target).get(parameters[0].name)
        except Exception:
            return None
    return annotation
