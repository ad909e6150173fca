"""The ``async with`` lifecycle the simulated engine and its publishers share.

`AsyncService.__aenter__` enters what `_start` puts on an exit stack (task groups, servers,
callbacks) and keeps that stack until ``__aexit__`` unwinds it; `_release` then frees what lives
outside the stack (sockets, a ZMQ context), and also runs when `_start` fails half-way.

An exception the ``async with`` block raises leaves it as raised, as `kvroute.KvEventClient`'s does:
handed to the stack, the service's task groups would wrap it in an ExceptionGroup, and an
``except TimeoutError`` around the block would miss it. Only a cancellation goes into the stack (it may
be a task group's own, which only that group can absorb and replace with what failed).
"""

from __future__ import annotations

import abc
import contextlib
from types import TracebackType
from typing import TypeVar

import anyio

__all__ = ["AsyncService"]

_S = TypeVar("_S", bound="AsyncService")


class AsyncService(abc.ABC):
    """Base of objects run with ``async with`` (module docstring)."""

    _stack: contextlib.AsyncExitStack | None = None

    @abc.abstractmethod
    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        """Start the service, entering everything to unwind on exit into ``stack``."""

    def _release(self) -> None:
        """Free what is not on the stack; runs after the stack unwound, or after `_start` failed."""
        return None

    async def __aenter__(self: _S) -> _S:
        try:
            async with contextlib.AsyncExitStack() as stack:
                await self._start(stack)
                self._stack = stack.pop_all()
        except BaseException:
            self._release()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._stack is not None
        stack, self._stack = self._stack, None
        try:
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                await stack.__aexit__(exc_type, exc, tb)
                return None
            try:
                await stack.__aexit__(None, None, None)
            except BaseException as failure:
                # stopping failed: that error leaves, with the block's own attached to it
                if exc is not None and failure.__context__ is None:
                    failure.__context__ = exc
                raise
        finally:
            self._release()
        return None
