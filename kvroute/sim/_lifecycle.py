"""The ``async with`` lifecycle the simulated engine and its publishers share.

`AsyncService.__aenter__` enters what `_start` puts on an exit stack (task groups, servers,
callbacks) and keeps that stack until ``__aexit__`` unwinds it; `_release` then frees what lives
outside the stack (sockets, a ZMQ context), and also runs when `_start` fails half-way.
"""

from __future__ import annotations

import abc
import contextlib
from types import TracebackType
from typing import TypeVar

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
            await stack.__aexit__(exc_type, exc, tb)
        finally:
            self._release()
        return None
